"""What caching every activation costs next to a plain forward pass.

    python -m cyformer.interp.cost --tokens 128 --repeats 7

builds a GPT-2-small geometry with random weights in memory (nothing is read
from disk), then times ``forward`` and ``run_with_cache`` (all hook points)
interleaved, after a warm-up, and reports the median times and their ratio,
by the wall clock and by this process's CPU time (steadier on a busy machine).

Most of what caching adds is memory: about 31 d_model floats per position
and layer (hook_result alone is n_head of them) plus two [H, T, T] arrays
per layer, all freshly written.  Where first touches of new pages are slow
(virtual machines), that shows up in the ratio.
"""

import argparse
import time

import numpy as np

from ..config import Config
from ..arch import global_shapes, layer_shapes
from ..weights import Weights


def random_model(cfg=None, seed=0, threads=None):
    """A Model of ``cfg`` (default: GPT-2 small) with random weights."""
    from ..model import Model

    cfg = cfg or Config()
    rng = np.random.default_rng(seed)

    def arr(name, shape):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.1 if len(shape) == 1 else 0.02
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            a += np.float32(1.0)
        a.flags.writeable = False
        return a

    shapes = {**global_shapes(cfg), **{f"blocks.{i}.{n}": s for i in range(cfg.n_layer)
                                       for n, s in layer_shapes(cfg).items()}}
    params = {n: arr(n, s) for n, s in shapes.items() if s is not None and n != "lm_head"}
    return Model(cfg, Weights.from_params(cfg, params), threads=threads)


def cache_overhead(model=None, tokens=128, repeats=7, seed=0):
    """Median seconds of forward and of run_with_cache(names=None) on one
    random sequence, interleaved after a warm-up, by wall clock and by
    process CPU time; returns a dict with those, their ratios, and the
    ratios of the fastest runs (best_ratio, best_cpu_ratio)."""
    model = model or random_model()
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, size=tokens)
    model.forward(ids)
    model.run_with_cache(ids)
    clocks = (time.perf_counter, time.process_time)
    plain, cached = [], []
    for _ in range(repeats):
        t0 = [c() for c in clocks]
        model.forward(ids)
        t1 = [c() for c in clocks]
        _, cache = model.run_with_cache(ids)
        t2 = [c() for c in clocks]
        del cache
        plain.append(np.subtract(t1, t0))
        cached.append(np.subtract(t2, t1))
    p, c = np.median(plain, axis=0), np.median(cached, axis=0)
    best = np.min(cached, axis=0) / np.min(plain, axis=0)  # least disturbed by other load
    return {"tokens": tokens, "threads": model.threads, "forward_s": float(p[0]),
            "run_with_cache_s": float(c[0]), "ratio": float(c[0] / p[0]),
            "forward_cpu_s": float(p[1]), "run_with_cache_cpu_s": float(c[1]),
            "cpu_ratio": float(c[1] / p[1]), "best_ratio": float(best[0]),
            "best_cpu_ratio": float(best[1])}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cyformer.interp.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    model = random_model(threads=args.threads)
    print(f"GPT-2-small geometry, random weights, threads {model.threads}")
    print("medians of interleaved runs; 'best' compares the fastest run of each")
    print(f"{'tokens':>7} {'forward ms':>11} {'cache-all ms':>13} {'ratio':>6} {'best':>5}   "
          f"{'cpu: forward':>12} {'cache-all':>10} {'ratio':>6} {'best':>5}")
    for T in args.tokens:
        r = cache_overhead(model, T, args.repeats)
        print(f"{T:>7} {r['forward_s'] * 1e3:>11.1f} {r['run_with_cache_s'] * 1e3:>13.1f} "
              f"{r['ratio']:>6.2f} {r['best_ratio']:>5.2f}   {r['forward_cpu_s'] * 1e3:>12.1f} "
              f"{r['run_with_cache_cpu_s'] * 1e3:>10.1f} {r['cpu_ratio']:>6.2f} {r['best_cpu_ratio']:>5.2f}")


if __name__ == "__main__":
    main()
