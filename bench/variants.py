"""A weight format's kernel variants side by side: the kernels chosen with a
CPU feature against those chosen without it (linalg.select_format_kernels).

    python bench/variants.py --format bfloat16 --feature avx512_bf16
    python bench/variants.py --format int8 --feature avx512_vnni --reps 3
    python bench/variants.py --format int8 --feature amx_int8
    python bench/variants.py --format int8 --feature avx_vnni_evex --base avx2

Both variants have the --base features (default: every feature this CPU's
kernels use by default, less --feature).  Kernels: one core, x [1, K] times
GPT-2-small's 768x3072 and 3072x768 [K, N] matrices and the 50257x768
[N, K] unembedding (decode), and x [128, K] times the first two (prefill's
GEMM); min of --calls calls per round (the GEMM and the unembedding a
tenth), the variants interleaved, --rounds rounds.  Model: GPT-2-small
geometry with random weights in the format, each measurement a fresh
process (variants interleaved, --reps repeats): decode tokens/s after a
32-token prompt, a batched decode step of 8 sequences (ms per step, the
rows kernels) and the prefill of a 512-token prompt (ms).  Median
(min-max).  Writes bench/results/<date>-variants-<format>-<feature>-<cpu>.md.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import CACHE, cpu_model, fmt  # noqa: E402
from weights import GPT2_SMALL, make_checkpoint  # noqa: E402

SHAPES = [(768, 3072, False, 1), (3072, 768, False, 1), (768, 50257, True, 1),  # (K, N, W stored [N, K], rows)
          (768, 3072, False, 128), (3072, 768, False, 128)]


def shape_name(K, N, t, T):
    return f"{T}x{K} @ {K}x{N}" + (" [N, K]" if t else "")


def kernel_times(fmt_name, variants, calls, rounds):
    """{(shape, variant): [min us per round]}"""
    from cyformer.formats import quantize
    from cyformer.kernels import linalg
    rng = np.random.default_rng(0)
    out = {}
    for rnd in range(rounds):
        for K, N, t, T in SHAPES:
            W = quantize((rng.standard_normal((N, K) if t else (K, N)) * 0.02).astype(np.float32), fmt_name,
                         transposed=t)
            x = rng.standard_normal((T, K)).astype(np.float32)
            y = np.empty((T, N), np.float32)
            ws = linalg.Workspace()
            n = calls if N < 10000 and T == 1 else max(10, calls // 10)
            for name, feats in variants.items():
                linalg.select_format_kernels(feats)
                for _ in range(3):
                    linalg.linear_forward(x, W, out=y, w_transposed=t, threads=1, workspace=ws)
                best = float("inf")
                for _ in range(n):
                    t0 = time.perf_counter()
                    linalg.linear_forward(x, W, out=y, w_transposed=t, threads=1, workspace=ws)
                    best = min(best, time.perf_counter() - t0)
                out.setdefault((shape_name(K, N, t, T), name), []).append(best * 1e6)
    linalg.select_format_kernels()
    return out


def model_child(fmt_name, feats, threads, n_new):
    """In a fresh process: decode tokens/s and ms per batched step of 8."""
    import cyformer
    from cyformer.kernels import linalg
    linalg.select_format_kernels(feats)
    path = make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL)
    m = cyformer.load(path, threads=threads, dtype=fmt_name)
    object.__setattr__(m.config, "eos_token_id", None)  # always run to the end
    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(0, m.config.vocab_size, size=32)]
    m.generate(ids, max_new_tokens=4, temperature=0)  # warm-up
    tps = m.generate(ids, max_new_tokens=n_new, temperature=0).stats["decode_tokens_per_s"]
    be, steps = m.backend, 16
    caches = []
    for n in (3, 17, 1, 9, 30, 2, 5, 11):
        kv = be.new_cache(n + steps + 1)
        be.run(rng.integers(0, m.config.vocab_size, size=n), kv)
        caches.append(kv)
    tokens = rng.integers(0, m.config.vocab_size, size=len(caches))
    t0 = time.perf_counter()
    for _ in range(steps):
        be.step.batch(tokens, [kv.k for kv in caches], [kv.v for kv in caches], [kv.length for kv in caches],
                      threads=threads)
        for kv in caches:
            kv.length += 1
    batch_ms = (time.perf_counter() - t0) / steps * 1e3
    prompt = rng.integers(0, m.config.vocab_size, size=512)
    prefill = []
    for _ in range(3):
        kv = be.new_cache(512)
        t0 = time.perf_counter()
        be.run(prompt, kv)
        prefill.append(time.perf_counter() - t0)
    print(json.dumps({"tps": tps, "batch_ms": batch_ms, "prefill_ms": min(prefill) * 1e3,
                      "kernels": linalg.format_kernels()[fmt_name]}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="bfloat16")
    ap.add_argument("--feature", default="avx512_bf16", help="the CPU feature the variants differ by")
    ap.add_argument("--base", default=None,
                    help="comma-separated features both variants have (default: this CPU's, less --feature)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        return model_child(a.format, json.loads(a.child), a.threads, a.tokens)
    from cyformer import _runtime
    from cyformer.kernels import linalg
    if not linalg._cpu_features().get(a.feature):
        sys.exit(f"this CPU or kernel level has no {a.feature}: nothing to compare")
    if a.base is None:
        base = {n: on for n, on in linalg.select_format_kernels().items() if on and n != a.feature}
    else:
        base = {n: True for n in a.base.split(",") if n}
    variants = {f"without {a.feature}": dict(base, **{a.feature: False}),
                f"with {a.feature}": dict(base, **{a.feature: True})}
    names = list(variants)
    kern = kernel_times(a.format, variants, a.calls, a.rounds)
    model = {}
    for _ in range(a.reps):
        for name, feats in variants.items():
            r = subprocess.run([sys.executable, __file__, "--format", a.format, "--threads", str(a.threads),
                                "--tokens", str(a.tokens), "--child", json.dumps(feats)],
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            model.setdefault(name, []).append(res)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    flags = ", ".join(n for n, on in _runtime.cpu_features().items() if on) or "none"
    lines = [f"# {a.format} kernels with and without {a.feature}", "",
             f"{cpu_model()} (x86-64-v{_runtime.x86_level()}; {flags}; {os.cpu_count()} cores); "
             f"{datetime.date.today()}; load average at the end {' '.join(load)} "
             f"(shared machine: other processes ran throughout).", "",
             f"Both variants: {', '.join(sorted(base)) or 'no features'}.", "",
             f"Kernels: one core, min of {a.calls} calls (unembedding {max(10, a.calls // 10)}) per round, "
             f"median (min-max) of {a.rounds} rounds' minima, variants interleaved.", "",
             f"| shape | {names[0]} (us) | {names[1]} (us) | ratio |", "|---|---|---|---|"]
    for K, N, t, T in SHAPES:
        key = shape_name(K, N, t, T)
        w, v = kern[(key, names[0])], kern[(key, names[1])]
        lines.append(f"| {key} | {fmt(w)} | {fmt(v)} | {np.median(w) / np.median(v):.2f}x |")
    lines += ["", f"GPT-2-small geometry, random weights in {a.format}, {a.threads} threads, a fresh process per "
              f"measurement, variants interleaved, {a.reps} repeats, median (min-max): decode of {a.tokens} "
              f"tokens after a 32-token prompt; one batched decode step of 8 sequences; the prefill of a "
              f"512-token prompt (min of 3 per process).", "",
              "| variant | kernels | decode tokens/s | batch-8 step (ms) | prefill 512 (ms) |", "|---|---|---|---|---|"]
    for name in names:
        rs = model[name]
        lines.append(f"| {name} | {rs[0]['kernels']} | {fmt([r['tps'] for r in rs])} | "
                     f"{fmt([r['batch_ms'] for r in rs], digits=2)} | {fmt([r['prefill_ms'] for r in rs])} |")
    t0, t1 = (np.median([r["tps"] for r in model[n]]) for n in names)
    b0, b1 = (np.median([r["batch_ms"] for r in model[n]]) for n in names)
    p0, p1 = (np.median([r["prefill_ms"] for r in model[n]]) for n in names)
    lines += ["", f"Decode {t1 / t0:.2f}x, batch-8 step {b0 / b1:.2f}x, prefill {p0 / p1:.2f}x with {a.feature} "
              f"(medians)."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = a.out or os.path.join(HERE, "results", f"{datetime.date.today()}-variants-{a.format}-{a.feature}-"
                                f"{re.sub(r'[^a-z0-9]+', '-', cpu_model().lower()).strip('-')}.md")
    with open(out, "w") as f:
        f.write(text)
    print("wrote", out)


if __name__ == "__main__":
    main()
