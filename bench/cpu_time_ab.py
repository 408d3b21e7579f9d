"""Old checkout against new on one core, in thread CPU time: for a busy machine.

    python bench/cpu_time_ab.py --old /path/to/old/checkout --new /path/to/new/checkout
    python bench/cpu_time_ab.py --old ... --new ... --formats int8,int4 --rounds 5
    python bench/cpu_time_ab.py --old ... --new ... --formats float32 --batches 2,8,16 --geometry smollm2

On a shared machine wall-clock timings of two threads measure the scheduler
(a thread waiting at a barrier for its descheduled partner), so this times
one thread by its own CPU time (time.thread_time), which leaves preemption
out but not the neighbours' use of caches and memory bandwidth.  Each
checkout (built in place) runs in its own fresh process per measurement,
old and new alternating, --rounds rounds.  Per format, GPT-2-small (or
SmolLM2-135M) geometry with random weights: the decode step (one token
after a 32-token prompt, 64 steps: min and median), the batched decode
step of 8 sequences, or of each of --batches (16 steps: min and median),
and the [V, C] unembedding alone (x [1, C], min of 100 calls).  Prints
median (min-max) over the rounds and new/old.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GEOMETRIES = ("gpt2-small", "smollm2")


def metrics(batches):
    return ("step_ms_min", "step_ms_med", *(f"batch{b}_ms_{s}" for b in batches for s in ("min", "med")),
            "unembed_us_min")


def worker(fmt, batches, geometry):
    sys.path.insert(0, HERE)
    from run import CACHE
    from weights import GPT2_SMALL, SMOLLM2_135M, make_checkpoint, make_llama_checkpoint

    import cyformer
    from cyformer.kernels import linalg

    clk = time.thread_time
    path = (make_llama_checkpoint(os.path.join(CACHE, "smollm2-135m-random"), **SMOLLM2_135M)
            if geometry == "smollm2" else make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL))
    be = cyformer.load(path, dtype=fmt, threads=1).backend
    rng = np.random.default_rng(1)
    V = be.config.vocab_size
    kv = be.new_cache(200)
    be.run(rng.integers(0, V, 32), kv)
    steps = []
    for t in rng.integers(0, V, 64):
        t0 = clk()
        be.run(np.array([t]), kv, True)
        steps.append(clk() - t0)
    res = {"step_ms_min": min(steps) * 1e3, "step_ms_med": float(np.median(steps)) * 1e3}
    for B in batches:
        caches = []
        for n in range(B):
            c = be.new_cache(64)
            be.run(rng.integers(0, V, 16 + n % 16), c)
            caches.append(c)
        batch = []
        for _ in range(16):
            tokens = rng.integers(0, V, len(caches))
            t0 = clk()
            be.step.batch(tokens, [c.k for c in caches], [c.v for c in caches], [c.length for c in caches],
                          threads=1)
            batch.append(clk() - t0)
            for c in caches:
                c.length += 1
        res[f"batch{B}_ms_min"], res[f"batch{B}_ms_med"] = min(batch) * 1e3, float(np.median(batch)) * 1e3
    W = be.weights.lm_head
    x = rng.standard_normal((1, W.shape[1])).astype(np.float32)
    out, ws = np.empty((1, W.shape[0]), np.float32), linalg.Workspace()
    unembed = []
    for _ in range(100):
        t0 = clk()
        linalg.linear_forward(x, W, w_transposed=True, threads=1, out=out, workspace=ws)
        unembed.append(clk() - t0)
    res["unembed_us_min"] = min(unembed) * 1e6
    print(json.dumps(res))


def spawn(checkout, fmt, batches, geometry):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), CYFORMER_ADAPTIVE_THREADS="0")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", fmt,
                        ",".join(map(str, batches)), geometry], env=env,
                       cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], [int(b) for b in sys.argv[3].split(",")], sys.argv[4])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="8", help="sequences per batched step, comma-separated (default 8)")
    p.add_argument("--geometry", choices=GEOMETRIES, default="gpt2-small")
    a = p.parse_args()
    formats = a.formats.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    vals = {}
    for r in range(a.rounds):
        for fmt in formats:
            order = (("old", a.old), ("new", a.new)) if r % 2 == 0 else (("new", a.new), ("old", a.old))
            for side, checkout in order:
                got = spawn(checkout, fmt, batches, a.geometry)
                for k, v in got.items():
                    vals.setdefault((fmt, k, side), []).append(v)
                print(f"round {r} {fmt} {side}: {got}", file=sys.stderr, flush=True)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{a.geometry}, one thread, thread CPU time; {a.rounds} rounds, old/new alternating in fresh processes; "
          f"load average at the end {load}")
    print("| format | metric | old median (min-max) | new median (min-max) | new/old (medians) |")
    print("|---|---|---|---|---|")
    cell = lambda v: f"{np.median(v):.4g} ({min(v):.4g}-{max(v):.4g})"  # noqa: E731
    for fmt in formats:
        for m in metrics(batches):
            o, n = vals[(fmt, m, "old")], vals[(fmt, m, "new")]
            print(f"| {fmt} | {m} | {cell(o)} | {cell(n)} | {np.median(n) / np.median(o):.3f} |")


if __name__ == "__main__":
    main()
