"""Processes made by fork after a threaded kernel call still run the model.

libgomp has no fork handler, so before the fix a child forked after a
parallel region waited forever for worker threads that only the parent had
(cyformer._openmp).  Every case runs in its own Python process, in its own
process group, under a timeout: a regression fails the test (and the whole
group is killed) instead of hanging the suite.

Each case: the parent loads the bundled model, runs a forward pass on 2
threads, then makes workers in the way named; every worker runs a forward
pass and a greedy generation and reports them with the thread count its
kernels get.  Results must equal the parent's bitwise (they do not depend on
the thread count), and the parent must keep working after the fork.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

TIMEOUT_S = 180

CHILD = r'''
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import sys

import cyformer
from cyformer import _checks, _openmp

IDS = list(range(1, 12))
MODEL = None  # inherited by forked workers; spawned ones load their own


def digest(model):
    logits = model.forward(IDS)
    return {"forward": hashlib.sha256(logits.tobytes()).hexdigest(),
            "generate": list(model.generate(IDS, max_new_tokens=8, temperature=0)),
            "threads": _checks.threads("test", model.threads)}


def work(fresh=False):
    model = cyformer.load(threads=2) if fresh or MODEL is None else MODEL
    return digest(model)


def in_forked_child(fn):
    """fn() in an os.fork child, its result back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


def main(mode):
    global MODEL
    if mode == "no-release":  # a libgomp that cannot end its workers
        _openmp._runtime = type("NoPause", (), {"release_threads": staticmethod(lambda: -1)})
    MODEL = cyformer.load(threads=2)
    parent = digest(MODEL)
    if mode in ("os.fork", "no-release"):
        workers = [in_forked_child(work)]
    elif mode == "os.fork fresh model":
        workers = [in_forked_child(lambda: work(fresh=True))]
    elif mode == "os.fork twice":
        workers = [in_forked_child(lambda: [work()] + [in_forked_child(work)])]
        workers = workers[0]
    elif mode.startswith("multiprocessing "):
        with mp.get_context(mode.split()[1]).Pool(2) as pool:
            workers = pool.map_async(work, [False, True]).get(timeout=120)
    elif mode.startswith("ProcessPoolExecutor "):
        ctx = mp.get_context(mode.split()[1])
        with cf.ProcessPoolExecutor(2, mp_context=ctx) as ex:
            workers = [f.result(timeout=120) for f in [ex.submit(work), ex.submit(work, True)]]
    else:
        raise SystemExit(f"unknown mode {mode}")
    after = digest(MODEL)  # the parent's own team starts again after the fork
    print(json.dumps({"parent": parent, "after": after, "workers": workers}))


if __name__ == "__main__":
    main(sys.argv[1])
'''


def run_isolated(script, *args, timeout=TIMEOUT_S):
    """Run a Python script in a new process group; kill the group on timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    p = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"{' '.join(args)}: no answer in {timeout} s (a worker hangs)")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # stray workers, if any
        except ProcessLookupError:
            pass
    assert p.returncode == 0, f"{' '.join(args)}: exit {p.returncode}\n{err[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("fork") / "child.py"
    path.write_text(CHILD)
    return str(path)


@pytest.mark.parametrize("mode,threads", [
    ("os.fork", [2]),
    ("os.fork fresh model", [2]),
    ("os.fork twice", [2, 2]),
    ("multiprocessing fork", [2, 2]),
    ("multiprocessing spawn", [2, 2]),
    ("ProcessPoolExecutor fork", [2, 2]),
    ("ProcessPoolExecutor spawn", [2, 2]),
    ("no-release", [1]),
])
def test_children_run_the_model_after_a_threaded_call(child_script, mode, threads):
    if not hasattr(os, "fork") and "spawn" not in mode:
        pytest.skip("no fork on this platform")
    r = run_isolated(child_script, mode)
    parent = r["parent"]
    assert parent["threads"] == 2 and r["after"] == parent
    assert [w["threads"] for w in r["workers"]] == threads
    for w in r["workers"]:
        assert (w["forward"], w["generate"]) == (parent["forward"], parent["generate"])


def test_kernels_run_again_after_the_thread_ends_its_team():
    """An Engine ends the OpenMP team of the thread that makes it
    (_openmp.release_this_thread), so that an idle team does not slow the
    engine's; that thread's next kernel call starts a new team, with the
    same results, while the engine runs and after it closes."""
    import numpy as np

    import cyformer
    from cyformer import _openmp
    from cyformer.engine import Engine

    m = cyformer.load(threads=2)
    ids = list(range(1, 30))
    want = m.forward(ids)
    _openmp.release_this_thread()
    assert np.array_equal(m.forward(ids), want)
    with Engine(m):
        assert np.array_equal(m.forward(ids), want)
    assert np.array_equal(m.forward(ids), want)
