"""Decode's matrix-vector product with the weights in DRAM: GB/s per layout.

    python bench/matvec_dram.py                                 # int4 [K, N] and [N, K], 768x3072 and 3072x768
    python bench/matvec_dram.py --old /path/to/old/checkout     # the same beside another checkout
    python bench/matvec_dram.py --layouts int4:kn,int4:nk,int8:nk,q4_0 --shapes 768x3072 --threads 2
    python bench/matvec_dram.py --layouts float32:kn,float32:nk --shapes 768x3072,768x50257 --rows 1,8,16

One product is x [1, K] @ W through linalg.linear_forward: one row of x,
so it is bound by how fast W streams from memory.  A measurement, in a
fresh process, lays out --matrices distinct copies of one matrix (40 of
768x3072 in int4 are 47 MB, past the last-level cache), runs x through all
of them in turn (a pass: every matrix comes from DRAM), and reports the
bytes of W (data + scales) of a pass over its time: the median of --passes
passes after one warm-up pass.  Layouts, shapes, thread counts and
checkouts take turns within each round; the table gives the median
(min-max) over rounds.

With --rows B > 1 a product is the batched decode step's, x [B, K] @ W
through linalg.matvec_rows (every row bitwise its own one-row product),
and the table adds GFLOP/s (2 B K N a product).

A layout is FORMAT:kn (W stored [K, N], inputs as rows) or FORMAT:nk (a row
per output, linear_forward's w_transposed=True); q8_0 and q4_0 are always a
row per output.  A shape is KxN (inputs x outputs).
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, sys, time
import numpy as np
from dataclasses import replace
from cyformer.formats import quantize
from cyformer.kernels import linalg
layout, K, N, threads, nmat, passes, B = sys.argv[1], *map(int, sys.argv[2:8])
fmt, _, orient = layout.partition(":")
t = orient == "nk"
rng = np.random.default_rng(0)
Wf = (rng.standard_normal((N, K) if t else (K, N)) / np.sqrt(K)).astype(np.float32)
if fmt == "float32":
    mats = [Wf.copy() for _ in range(nmat)]
else:
    one = quantize(Wf, fmt, transposed=t)
    mats = [replace(one, data=one.data.copy(), scale=None if one.scale is None else one.scale.copy())
            for _ in range(nmat)]
x = rng.standard_normal((B, K)).astype(np.float32)
out = np.empty((1, N), np.float32)
ws = linalg.Workspace()
def run():
    s = time.perf_counter()
    for W in mats:
        if B == 1:
            linalg.linear_forward(x, W, out=out, w_transposed=t, threads=threads, workspace=ws)
        else:
            linalg.matvec_rows(x, W, w_transposed=t, threads=threads)
    return time.perf_counter() - s
run()
ts = [run() for _ in range(passes)]
print(json.dumps({"seconds": float(np.median(ts)), "bytes": int(sum(W.nbytes for W in mats))}))
"""


def measure(checkout, layout, shape, threads, nmat, passes, rows):
    """(GB/s of W, GFLOP/s) of one process"""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    r = subprocess.run([sys.executable, "-c", CHILD, layout, *map(str, shape), str(threads), str(nmat), str(passes),
                        str(rows)], env=env, capture_output=True, text=True, cwd="/")
    if r.returncode:
        sys.exit(f"{layout} {shape} in {checkout} failed:\n{r.stderr}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res["bytes"] / res["seconds"] / 1e9, 2 * rows * shape[0] * shape[1] * nmat / res["seconds"] / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="int4:kn,int4:nk")
    ap.add_argument("--shapes", default="768x3072,3072x768", help="KxN, comma-separated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1", help="rows of x per product, comma-separated (batched step: > 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--matrices", type=int, default=40, help="distinct matrices per pass")
    ap.add_argument("--passes", type=int, default=15, help="timed passes per process (their median counts)")
    ap.add_argument("--old", help="another checkout to measure beside this one (labelled 'old')")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    rows = [int(v) for v in args.rows.split(",")]
    checkouts = [("new", os.path.dirname(HERE))] + ([("old", args.old)] if args.old else [])
    keys = [(c, lay, s, th, b) for s in shapes for th in threads for lay in layouts for b in rows
            for c, _ in checkouts]
    where = dict(checkouts)
    got = {k: [] for k in keys}
    for rnd in range(args.rounds):
        order = keys[rnd % len(keys):] + keys[:rnd % len(keys)]  # rotate who goes first
        for k in order:
            c, lay, s, th, b = k
            got[k].append(measure(where[c], lay, s, th, args.matrices, args.passes, b))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    sys.path.insert(0, HERE)
    from run import cpu_model

    print(f"# matrix-vector product from DRAM ({cpu_model()}; {args.matrices} matrices a pass, "
          f"median of {args.passes} passes per process, {args.rounds} rounds)\n")
    print("| shape KxN | threads | layout | rows | " + " | ".join(f"{c} GB/s | {c} GFLOP/s" for c, _ in checkouts)
          + " |")
    print("|---|---|---|---|" + "---|---|" * len(checkouts))
    for s in shapes:
        for th in threads:
            for lay in layouts:
                for b in rows:
                    cells = []
                    for c, _ in checkouts:
                        v = np.array(got[(c, lay, s, th, b)])
                        for col in (0, 1):
                            cells.append(f"{np.median(v[:, col]):.1f} ({v[:, col].min():.1f}-{v[:, col].max():.1f})")
                    print(f"| {s[0]}x{s[1]} | {th} | {lay} | {b} | " + " | ".join(cells) + " |")
    print("\n" + json.dumps({f"{c} {lay} {s[0]}x{s[1]} t{th} rows{b}": got[(c, lay, s, th, b)]
                            for (c, lay, s, th, b) in keys}))


if __name__ == "__main__":
    main()
