"""How many cores this process may use, and how many other work leaves it.

A team of OpenMP threads that meet at barriers runs at the pace of its
slowest member: on a machine where other processes keep cores busy, a member
waits for a core, and every other member waits for it.  So the team a kernel
call gets is capped by the cores that other processes leave free, measured
from /proc/stat over the last ~0.2 s:

    free = cores in our affinity mask - their busy time spent by others

"others" is every process but this one (our own time comes from
getrusage), less time at a positive nice level.  A niced process does not
leave its core to us, though: the scheduler still gives it a share (a nice-5
loop gets a quarter of a core beside one of ours), and a member descheduled
for it holds up the rest of the team at every barrier.  So the cap also
subtracts the scheduler's own account of what we did not get: the time our
threads spent runnable but waiting for a CPU (/proc/self/task/*/schedstat's
run delay), whoever took the CPU, niced or not:

    free = cores - others' busy time - our threads' wait for a CPU

Results do not depend on the team size, so the cap changes only the speed.
CYFORMER_ADAPTIVE_THREADS=0 turns it off: every call then gets exactly the
threads asked for; "others" counts only others' busy time (the rule before
issue 29, kept for comparisons).  Without /proc/stat (macOS, Windows) there
is no cap; without schedstat, no wait is counted.
"""

import os
import resource
import threading
import time

WINDOW_S = 0.2       # sampling interval: long enough for 10 ms clock ticks to count
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available():
    """Cores this process may run on (CPU affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpus():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _busy_seconds(cpus):
    """Non-idle, non-nice CPU seconds of the given CPUs since boot (None: unknown)."""
    want = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                if fields[0] in want:
                    # user nice system idle iowait irq softirq steal
                    v = [int(x) for x in fields[1:9]]
                    total += v[0] + v[2] + v[5] + v[6] + v[7]
    except (OSError, ValueError, IndexError):
        return None
    return total / _TICK


def _waiting_seconds():
    """Seconds this process's threads have spent runnable but waiting for a
    CPU (the run delay of /proc/self/task/*/schedstat), or None if unknown.
    Threads that have ended take their delay with them; callers clamp."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:  # the thread ended meanwhile
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _own_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _FreeCores:
    """free() -> cores others leave to this process, re-measured every WINDOW_S."""

    def __init__(self):
        self.cpus = _cpus()
        switch = os.environ.get("CYFORMER_ADAPTIVE_THREADS", "").strip().lower()
        self.enabled = (switch not in ("0", "false", "no", "off")
                        and self.cpus is not None and _busy_seconds(self.cpus) is not None)
        self.count_waiting = switch != "others" and _waiting_seconds() is not None
        self.value = len(self.cpus) if self.cpus else available()
        self.restart()

    def restart(self):
        """Take the first sample now: at import, so that by the first kernel
        call (a model has loaded by then) a window has passed; and in a forked
        child, whose own CPU time starts again from zero."""
        self.lock = threading.Lock()
        self.last = (time.monotonic(), _busy_seconds(self.cpus), _own_seconds(),
                     self._waiting()) if self.enabled else None

    def _waiting(self):
        return _waiting_seconds() if self.count_waiting else None

    def free(self):
        now = time.monotonic()
        last = self.last
        if last is not None and now - last[0] < WINDOW_S:
            return self.value
        with self.lock:
            if self.last is not last:  # another thread just measured
                return self.value
            busy, own, waiting = _busy_seconds(self.cpus), _own_seconds(), self._waiting()
            if last is not None and busy is not None and last[1] is not None:
                span = now - last[0]
                others = max(0.0, (busy - last[1]) - (own - last[2])) / span
                waited = max(0.0, waiting - last[3]) / span if waiting is not None and last[3] is not None else 0.0
                self.value = max(1, round(len(self.cpus) - others - waited))
            self.last = (now, busy, own, waiting)
        return self.value


_free = _FreeCores()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _free.restart())


def enabled():
    """Whether the team is capped by the cores other processes leave free."""
    return _free.enabled


def team(n):
    """The team a kernel call asking for n threads gets: n, capped by the
    cores other processes leave free (at least 1)."""
    if not _free.enabled or n == 1:
        return n
    return min(n, _free.free())
