"""GPT-2 small and two Llama-family geometries, cyformer beside transformers
on PyTorch, in one run.

    python bench/families.py                 # 2 threads, 3 repeats
    python bench/families.py --quick         # smoke run: tiny prompt, 1 repeat

Random float32 weights of GPT-2 small, SmolLM2-135M (30 layers, d_model 576,
9 heads, 3 key/value heads, MLP 1536, vocab 49152, tied) and Qwen2.5-0.5B
(24 layers, 896, 14 heads, 2 key/value heads, MLP 4864, vocab 151936, tied,
q/k/v biases).  Per geometry, the contenders are interleaved and repeated;
tables give the median and the min-max.  Decode is also put beside the
streaming read bandwidth measured in the same repeats (bytes of weights read
per token / seconds per token).  Writes bench/results/<date>-families-<cpu>.md.
"""

import argparse
import datetime
import os
import re
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import (CACHE, Cyformer, Torch, blas_threads, cpu_model, fmt, measure, read_bandwidth,  # noqa: E402
                 settle, stat)
from weights import GPT2_SMALL, QWEN25_05B, SMOLLM2_135M, make_checkpoint, make_llama_checkpoint  # noqa: E402

import cyformer  # noqa: E402

GEOMETRIES = {
    "GPT-2 small": lambda: make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL),
    "SmolLM2-135M": lambda: make_llama_checkpoint(os.path.join(CACHE, "smollm2-135m-random"), **SMOLLM2_135M),
    "Qwen2.5-0.5B": lambda: make_llama_checkpoint(os.path.join(CACHE, "qwen2.5-0.5b-random"), **QWEN25_05B),
}


def weight_bytes(model):
    """float32 bytes of every matrix a decode step reads (the unembedding included)."""
    w = model.weights
    n = w.lm_head.size
    for b in w.blocks:
        n += b.c_attn.weight.size + b.attn_c_proj.weight.size + b.c_fc.weight.size + b.mlp_c_proj.weight.size
    return 4 * n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: short prompt, few tokens, 1 repeat")
    ap.add_argument("--reps", type=int, default=None, help="repeats (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every contender (default 2)")
    ap.add_argument("--geometries", default=",".join(GEOMETRIES),
                    help=f"comma-separated subset of: {', '.join(GEOMETRIES)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the .md")
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    T = 16 if args.quick else 512
    n_new = 8 if args.quick else 64
    t = args.threads
    rows = {}
    for name in args.geometries.split(","):
        path = GEOMETRIES[name]()
        contenders = [Cyformer(path, t), Torch(path, t)]
        ids = np.random.default_rng(0).integers(0, contenders[0].model.config.vocab_size, size=T)
        prompt = ids[:32]
        nbytes = weight_bytes(contenders[0].model)

        def prefill(c):
            settle()
            from run import _timed
            return {"prefill_s": _timed(lambda: c.prefill(ids))}

        def decode(c):
            settle()
            with blas_threads(t):
                before = read_bandwidth(t, mb=256, reps=1)
            ttft, tps = c.generate(prompt, n_new)
            return {"decode_tps": tps, "ttft_s": ttft, "read_gbs": before}

        print(f"{name}: {nbytes / 1e6:.0f} MB of weights; {reps} repeats", flush=True)
        rows[name] = (measure(contenders, {"prefill": prefill, "decode": decode}, reps), nbytes,
                      [c.name for c in contenders])
        del contenders
    md = render(rows, t, T, n_new, reps)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")[:40]
        out = os.path.join(args.out, f"{datetime.date.today()}-families-{slug}.md")
        with open(out, "w") as f:
            f.write(md + "\n")
        print(f"wrote {out}")


def render(rows, t, T, n_new, reps):
    lines = [f"# cyformer and PyTorch across model families ({cpu_model()}, {t} threads, float32, batch 1)",
             "", f"cyformer {cyformer.__version__} ({cyformer.build_info().get('isa')}); prefill of {T} tokens; "
             f"decode: {n_new} new tokens after a 32-token prompt; median (min-max) of {reps} interleaved repeats.",
             "", "| geometry | contender | prefill (s) | decode (tokens/s) | time to first token (ms) | "
             "decode GB/s of weights | of the read bandwidth |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for name, (res, nbytes, names) in rows.items():
        cy, pt = (res[n] for n in names)
        for cname in names:
            r = res[cname]
            gbs = [tps * nbytes / 1e9 for tps in r["decode_tps"]]
            share = [g / b for g, b in zip(gbs, r["read_gbs"])]
            lines.append(f"| {name} | {cname} | {fmt(r['prefill_s'], digits=3)} | {fmt(r['decode_tps'])} | "
                         f"{fmt([x * 1e3 for x in r['ttft_s']], digits=0)} | {fmt(gbs)} | "
                         f"{stat(share)[0]:.0%} |")
        ratios.append(f"| {name} | {stat(pt['prefill_s'])[0] / stat(cy['prefill_s'])[0]:.2f}x | "
                      f"{stat(cy['decode_tps'])[0] / stat(pt['decode_tps'])[0]:.2f}x | "
                      f"{nbytes / 1e6:.0f} MB |")
    lines += ["", "Ratios of medians (cyformer against PyTorch; above 1 means cyformer is faster):", "",
              "| geometry | prefill | decode | weights read per token |", "|---|---|---|---|"] + ratios
    return "\n".join(lines)


if __name__ == "__main__":
    main()
