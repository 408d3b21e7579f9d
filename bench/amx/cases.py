"""tdpbf16ps cases for an AMX CPU, and amx.h's model checked against what it gave.

    python bench/amx/cases.py write cases.bin            # 72 cases, 3 KB each
    ./probe cases.bin out.bin                             # on the AMX machine (probe.c)
    python bench/amx/cases.py check cases.bin out.bin    # outputs where the model differs

A case is one full-shape instruction: a [16, 32] and b [16, 32] bf16 codes,
c [16, 16] float32 (the bytes in that order); out.bin holds the new c per
case.  Families: normal values; values over a wide range of exponents; one
pair per output; denormal inputs and sums; cancelling products.  The model is
linalg.amx_tdpbf16ps_model; tests/data/tdpbf16ps_sapphire_rapids.npz keeps 8
cases recorded this way.
"""

import argparse
import sys

import numpy as np

FAMILIES = (("normal", 16), ("wide", 24), ("one pair", 16), ("tiny", 8), ("cancelling", 8))


def bf16(x):
    """float32 -> bf16 codes, truncated (any bf16 value serves)."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def cases(seed=1234):
    """[(a codes, b codes, c)] per case, FAMILIES in order."""
    rng = np.random.default_rng(seed)

    def spread(shape, lo, hi):
        return (rng.uniform(1, 2, shape) * np.exp2(rng.integers(lo, hi, shape))
                * rng.choice([-1, 1], shape)).astype(np.float32)

    out = []
    for i in range(16):
        out.append((rng.standard_normal((16, 32)), rng.standard_normal((16, 32)),
                    np.zeros((16, 16)) if i < 8 else rng.standard_normal((16, 16))))
    for i in range(24):
        out.append((spread((16, 32), -12, 12), spread((16, 32), -12, 12),
                    spread((16, 16), -10, 30) if i % 2 else np.zeros((16, 16))))
    for i in range(16):
        a, k = np.zeros((16, 32), np.float32), rng.integers(0, 16, 16)
        for r in range(16):
            a[r, 2 * k[r]] = spread(1, -8, 8)[0]
            a[r, 2 * k[r] + 1] = spread(1, -8, 8)[0] if i % 2 else 0
        out.append((a, spread((16, 32), -8, 8), spread((16, 16), -12, 12)))
    for i in range(8):
        a, b, c = spread((16, 32), -140, -100), spread((16, 32), -40, 0), spread((16, 16), -140, -120)
        out.append((a, b, c if i % 2 else np.zeros((16, 16))))
    for i in range(8):
        a, b = spread((16, 32), -2, 2), spread((16, 32), -2, 2)
        a[:, 0], b[:, 0], a[:, 30], b[:, 30] = 2.0 ** 20, 1.0, -(2.0 ** 20), 1.0
        out.append((a, b, spread((16, 16), -30, -10) if i % 2 else np.zeros((16, 16))))
    return [(bf16(a), bf16(b), np.asarray(c, np.float32)) for a, b, c in out]


def read(path):
    raw = np.fromfile(path, np.uint8).reshape(-1, 3072)
    return [(r[:1024].view(np.uint16).reshape(16, 32), r[1024:2048].view(np.uint16).reshape(16, 32),
             r[2048:].view(np.float32).reshape(16, 16)) for r in raw]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("write", "check"))
    ap.add_argument("cases")
    ap.add_argument("out", nargs="?", help="check: the outputs the hardware gave")
    args = ap.parse_args(argv)
    if args.what == "write":
        c = cases()
        np.concatenate([np.concatenate([a.view(np.uint8).ravel(), b.view(np.uint8).ravel(), x.view(np.uint8).ravel()])
                        for a, b, x in c]).tofile(args.cases)
        print(f"wrote {len(c)} cases to {args.cases}")
        return 0
    if args.out is None:
        ap.error("check needs the outputs file")
    from cyformer.kernels import linalg

    got = read(args.cases)
    hw = np.fromfile(args.out, np.float32).reshape(-1, 16, 16)
    if len(hw) != len(got):
        sys.exit(f"{args.out} has {len(hw)} cases, {args.cases} {len(got)}")
    start = 0
    for name, n in FAMILIES:
        bad = sum(int((linalg.amx_tdpbf16ps_model(a, b, c).view(np.uint32) != h.view(np.uint32)).sum())
                  for (a, b, c), h in zip(got[start:start + n], hw[start:start + n]))
        print(f"{name:11s} {n} cases: {bad} of {n * 256} outputs differ from the model")
        start += n
    return 0


if __name__ == "__main__":
    sys.exit(main())
