"""The team a kernel call gets shrinks to the cores other processes leave free.

cyformer._cores measures, from /proc/stat, how busy the cores of this
process's affinity mask are with work that is not ours, and caps the team
so that no thread waits at a barrier for a core it cannot get.  The
arithmetic is tested with a fake clock and fake counters; the measurement
itself with real busy loops pinned to the cores of a child process.  Thread
counts never change results, so nothing here checks logits.
"""

import os
import subprocess
import sys
import textwrap
import time
import types

import pytest

from cyformer import _cores


class Clock:
    def __init__(self):
        self.now, self.busy, self.own, self.waiting = 100.0, 1000.0, 10.0, 5.0

    def advance(self, seconds, others, ours=0.0, waiting=0.0):
        """seconds pass, with others' and our busy cores over them, and our
        threads runnable but waiting for a CPU (in cores) over them."""
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.own += ours * seconds
        self.waiting += waiting * seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(_cores, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    monkeypatch.setattr(_cores, "_busy_seconds", lambda cpus: c.busy)
    monkeypatch.setattr(_cores, "_own_seconds", lambda: c.own)
    monkeypatch.setattr(_cores, "_waiting_seconds", lambda: c.waiting)
    free = _cores._FreeCores()
    free.cpus, free.enabled, free.value, free.count_waiting = [0, 1, 2, 3], True, 4, True
    monkeypatch.setattr(_cores, "_free", free)
    return c


def test_team_follows_the_cores_others_keep_busy(clock):
    assert _cores.team(4) == 4  # first call: nothing measured yet
    for others, want in [(0.0, 4), (1.0, 3), (2.4, 2), (2.6, 1), (4.0, 1), (0.2, 4)]:
        clock.advance(_cores.WINDOW_S * 2, others)
        assert _cores.team(4) == want, others
        assert _cores.team(2) == min(2, want) and _cores.team(1) == 1


def test_our_own_threads_do_not_count_as_others(clock):
    _cores.team(4)
    clock.advance(1.0, others=0.0, ours=4.0)
    assert _cores.team(4) == 4
    clock.advance(1.0, others=1.0, ours=3.0)
    assert _cores.team(4) == 3


def test_time_our_threads_wait_for_a_cpu_counts_as_taken(clock):
    """A niced neighbour is not in others' busy time, but the scheduler still
    makes our threads wait for it: that wait shrinks the team too."""
    _cores.team(4)
    clock.advance(1.0, others=0.0, ours=3.0, waiting=1.0)
    assert _cores.team(4) == 3
    clock.advance(1.0, others=1.0, ours=2.0, waiting=2.0)
    assert _cores.team(4) == 1
    clock.advance(1.0, others=0.0, ours=4.0, waiting=0.0)
    assert _cores.team(4) == 4
    _cores._free.count_waiting = False  # CYFORMER_ADAPTIVE_THREADS=others
    _cores._free.restart()
    clock.advance(1.0, others=0.0, ours=2.0, waiting=2.0)
    assert _cores.team(4) == 4


def test_waiting_is_read_from_schedstat():
    w = _cores._waiting_seconds()
    if w is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    assert w >= 0.0


def test_between_measurements_the_last_answer_stands(clock):
    _cores.team(4)
    clock.advance(1.0, others=3.0)
    assert _cores.team(4) == 1
    clock.advance(_cores.WINDOW_S / 4, others=0.0)  # too short to measure again
    assert _cores.team(4) == 1


def test_switched_off_every_call_gets_what_it_asks(clock):
    _cores._free.enabled = False
    _cores.team(4)
    clock.advance(1.0, others=4.0)
    assert _cores.team(4) == 4


CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)
    from cyformer import _checks, _cores
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, cpus)) for _ in cpus]
    try:
        _checks.threads("probe", 2)
        time.sleep(3 * _cores.WINDOW_S)
        print(_checks.threads("probe", 2), _checks.threads("probe", None))
    finally:
        for h in hogs:
            h.kill()
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists("/proc/stat")
                    or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
@pytest.mark.skipif(hasattr(os, "nice") and os.nice(0) > 0,
                    reason="the busy loops would inherit this process's positive nice level, "
                           "and niced time is not counted as taken (it yields to us)")
def test_busy_loops_on_our_cores_shrink_the_team_to_one():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               CYFORMER_ADAPTIVE_THREADS="1", OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "1"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_measures_from_its_own_start(monkeypatch):
    """A child's CPU time starts from zero: it must not count its parent's as others'."""
    monkeypatch.setattr(_cores._free, "enabled", True)
    t = time.process_time()
    while time.process_time() - t < 0.3:  # make the parent's own time clearly nonzero
        pass
    _cores._free.restart()  # the parent's last sample: its own time now
    parent_own = _cores._free.last[2]
    pid = os.fork()
    if pid == 0:
        ok = _cores._free.last[2] < parent_own - 0.2
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
