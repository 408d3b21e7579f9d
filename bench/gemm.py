"""One linear product (linalg.linear_forward) per weight format: x [T, K] @ W [K, N].

    python bench/gemm.py                                  # 512x768x3072, 1 thread, this checkout
    python bench/gemm.py --old /path/to/old/checkout      # the same beside another checkout
    python bench/gemm.py --shape 512,3072,768 --threads 2 --rounds 7

The kernel-level view of prefill (T >= 4 rows: the GEMM path).  Every
measurement is a fresh process (random weights, 3 warm-up calls, then the
median of --calls calls with a reused Workspace); checkouts and formats take
turns within each round; the table gives the median (min-max) over rounds
and each format's speed against float32 of the same checkout.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("float32", "bfloat16", "int8", "int4")

CHILD = r"""
import json, sys, time
import numpy as np
from cyformer.formats import quantize
from cyformer.kernels import linalg
fmt, T, K, N, threads, calls = sys.argv[1], *map(int, sys.argv[2:7])
rng = np.random.default_rng(0)
Wf = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
W = Wf if fmt == "float32" else quantize(Wf, fmt)
x = rng.standard_normal((T, K)).astype(np.float32)
out = np.empty((T, N), np.float32)
ws = linalg.Workspace()
for _ in range(3):
    linalg.linear_forward(x, W, out=out, threads=threads, workspace=ws)
ts = []
for _ in range(calls):
    t = time.perf_counter()
    linalg.linear_forward(x, W, out=out, threads=threads, workspace=ws)
    ts.append(time.perf_counter() - t)
print(json.dumps(float(np.median(ts))))
"""


def run(checkout, fmt, shape, threads, calls):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    r = subprocess.run([sys.executable, "-c", CHILD, fmt, *map(str, shape), str(threads), str(calls)],
                       env=env, capture_output=True, text=True, cwd="/", check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="512,768,3072", help="T,K,N (default 512,768,3072)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=7, help="timed calls per process (their median counts)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--old", default=None, help="another checkout (built in place) to run beside this one")
    a = ap.parse_args(argv)
    shape = tuple(int(v) for v in a.shape.split(","))
    if len(shape) != 3 or min(shape) <= 0:
        ap.error(f"--shape must be T,K,N of positive integers, got {a.shape!r}")
    formats = [f for f in a.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"unknown formats {unknown}; known: {list(FORMATS)}")
    checkouts = {"new": os.path.dirname(HERE)}
    if a.old:
        checkouts = {"old": a.old, **checkouts}
    times = {(c, f): [] for c in checkouts for f in formats}
    for r in range(a.rounds):
        for f in formats:
            for c, path in checkouts.items():
                times[c, f].append(run(path, f, shape, a.threads, a.calls))
                print(f"round {r + 1}/{a.rounds} {c} {f}: {times[c, f][-1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    T, K, N = shape
    print(f"x [{T}, {K}] @ W [{K}, {N}], {a.threads} thread(s), median (min-max) of {a.rounds} rounds, "
          f"each the median of {a.calls} calls in a fresh process")
    print()
    cols = list(checkouts)
    print("| format | " + " | ".join(f"{c} ms" for c in cols) + " | " + " | ".join(f"{c} vs float32" for c in cols)
          + (" | new vs old |" if "old" in checkouts else " |"))
    print("|---" * (1 + 2 * len(cols) + ("old" in checkouts)) + "|")
    for f in formats:
        cells = []
        for c in cols:
            v = np.array(times[c, f]) * 1e3
            cells.append(f"{np.median(v):.2f} ({v.min():.2f}-{v.max():.2f})")
        for c in cols:
            if (c, "float32") in times:
                cells.append(f"{np.median(times[c, 'float32']) / np.median(times[c, f]):.2f}x")
            else:
                cells.append("-")
        if "old" in checkouts:
            cells.append(f"{np.median(times['old', f]) / np.median(times['new', f]):.2f}x")
        print(f"| {f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
