"""How many cores this process may use, and how many other work leaves it.

A team of OpenMP threads that meet at barriers runs at the pace of its
slowest member: on a machine where other processes keep cores busy, a member
waits for a core, and every other member waits for it.  So the team a kernel
call gets is capped by the cores that other processes leave free, measured
from /proc/stat over the last ~0.2 s:

    free = cores in our affinity mask - their busy time spent by others

"others" is every process but this one (our own time comes from
getrusage), less time at a positive nice level (a niced process yields its
core to us).  Results do not depend on the team size, so the cap changes
only the speed.  CYFORMER_ADAPTIVE_THREADS=0 turns it off: every call then
gets exactly the threads asked for.  Without /proc/stat (macOS, Windows)
there is no cap.
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
        self.value = len(self.cpus) if self.cpus else available()
        self.restart()

    def restart(self):
        """Take the first sample now: at import, so that by the first kernel
        call (a model has loaded by then) a window has passed; and in a forked
        child, whose own CPU time starts again from zero."""
        self.lock = threading.Lock()
        self.last = (time.monotonic(), _busy_seconds(self.cpus), _own_seconds()) if self.enabled else None

    def free(self):
        now = time.monotonic()
        last = self.last
        if last is not None and now - last[0] < WINDOW_S:
            return self.value
        with self.lock:
            if self.last is not last:  # another thread just measured
                return self.value
            busy, own = _busy_seconds(self.cpus), _own_seconds()
            if last is not None and busy is not None and last[1] is not None:
                others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
                self.value = max(1, round(len(self.cpus) - others))
            self.last = (now, busy, own)
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
