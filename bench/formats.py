"""Weight formats side by side: cyformer float32, bfloat16, int8 and int4
beside PyTorch float32, in one run; and their accuracy against float32.

    python bench/formats.py              # GPT-2 small and SmolLM2-135M geometries, 3 repeats
    python bench/formats.py --quick      # smoke run
    python bench/formats.py --rss        # peak RSS per format only (a minute)

Speed (random weights, 2 threads by default, contenders interleaved,
median (min-max) of the repeats): decode tokens/s after a 32-token prompt,
prefill of 512 tokens, bytes of weights read per decoded token and the GB/s
that makes, beside a streaming-read probe taken right before each decode;
peak RSS of a fresh process that loads the model and generates 128 tokens.
Accuracy: on the bundled model over held-out standard-library modules
(train/heldout.tsv), perplexity and top-1 agreement with float32; on the
random geometries, max and mean |logit - float32 logit| over 256 tokens.
Writes bench/results/<date>-formats-<cpu>.md.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import Torch  # noqa: E402
from run import CACHE, _timed, cpu_model, fmt, measure, read_bandwidth, settle, stat  # noqa: E402
from weights import GPT2_SMALL, SMOLLM2_135M, make_checkpoint, make_llama_checkpoint  # noqa: E402

import cyformer  # noqa: E402

FORMATS = ("float32", "bfloat16", "int8", "int4")
GEOMETRIES = {
    "GPT-2 small": lambda: make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL),
    "SmolLM2-135M": lambda: make_llama_checkpoint(os.path.join(CACHE, "smollm2-135m-random"), **SMOLLM2_135M),
}


class Cy:
    def __init__(self, path, threads, dtype):
        self.model = cyformer.load(path, threads=threads, dtype=dtype)
        object.__setattr__(self.model.config, "eos_token_id", None)  # always run to the end
        self.name, self.threads, self.blas = f"cyformer {dtype}", threads, threads

    def prefill(self, ids):
        self.model.forward(ids)

    def generate(self, ids, n):
        out = self.model.generate(list(ids), max_new_tokens=n, temperature=0)
        return out.stats["time_to_first_token_s"], out.stats["decode_tokens_per_s"]


def weight_bytes(model):
    """Bytes of every matrix a decode step reads (the unembedding included)."""
    w = model.weights
    mats = [w.lm_head] + [m for b in w.blocks for m in (b.c_attn.weight, b.attn_c_proj.weight,
                                                         b.c_fc.weight, b.mlp_c_proj.weight)]
    return sum(m.nbytes for m in mats)


def peak_rss(path, dtype, threads, n_new=128):
    """VmHWM (MB) of a fresh process that loads the model and generates."""
    code = (f"import cyformer\nm = cyformer.load({path!r}, threads={threads}, dtype={dtype!r})\n"
            f"m.generate(list(range(16)), max_new_tokens={n_new})\n"
            "print(next(int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=HERE)
    return float(out.stdout.split()[-1]) if out.returncode == 0 else None


def torch_rss(path, threads, n_new=128):
    code = (f"import sys; sys.path.insert(0, {HERE!r})\nfrom run import Torch\n"
            f"Torch({path!r}, {threads}).generate(list(range(16)), {n_new})\n"
            "print(next(int(l.split()[1]) / 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=HERE)
    return float(out.stdout.split()[-1]) if out.returncode == 0 else None


def accuracy():
    """Bundled model on held-out code: (perplexity, top-1 agreement) per format."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from test_formats import held_out_ids, perplexity_and_top1

    ref_model = cyformer.load(threads=2)
    ids = held_out_ids(ref_model, exact=False)
    ppl32, top32 = perplexity_and_top1(ref_model, ids)
    out = {"float32": (ppl32, 1.0)}
    for dtype in FORMATS[1:]:
        ppl, top = perplexity_and_top1(cyformer.load(threads=2, dtype=dtype), ids)
        out[dtype] = (ppl, float((top == top32).mean()))
    return out, len(ids)


def logit_errors(path):
    ids = np.random.default_rng(1).integers(0, 1000, size=256)
    ref = cyformer.load(path, threads=2).forward(ids)
    errs = {}
    for dtype in FORMATS[1:]:
        d = np.abs(cyformer.load(path, threads=2, dtype=dtype).forward(ids) - ref)
        errs[dtype] = (float(d.max()), float(d.mean()))
    return errs


def rss_only(threads):
    print(f"Peak RSS (MB) of a fresh process that loads the model and generates 128 tokens, {threads} threads")
    print("| model | " + " | ".join(FORMATS) + " |\n|---|" + "---|" * len(FORMATS))
    for name, make in GEOMETRIES.items():
        rss = {d: peak_rss(make(), d, threads) for d in FORMATS}
        f32 = rss["float32"]
        cells = ["failed" if v is None else f"{v:.0f}" + ("" if d == "float32" or not f32 else f" ({v / f32:.2f}x)")
                 for d, v in rss.items()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: short prompt, few tokens, 1 repeat")
    ap.add_argument("--reps", type=int, default=None, help="repeats (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    ap.add_argument("--rss", action="store_true", help="only the peak RSS of a fresh process per format "
                    "(load, generate 128 tokens) and its ratio to float32's; writes nothing")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.rss:
        return rss_only(args.threads)
    reps = args.reps or (1 if args.quick else 3)
    T, n_new, t = (16, 8, args.threads) if args.quick else (512, 64, args.threads)
    lines = [f"# Weight formats ({cpu_model()}, {t} threads, batch 1)", "",
             f"cyformer {cyformer.__version__} ({cyformer.build_info().get('isa')}); median (min-max) of "
             f"{reps} interleaved repeats; decode: {n_new} tokens after a 32-token prompt; prefill: {T} tokens.",
             ""]
    for name, make in GEOMETRIES.items():
        path = make()
        cs = [Cy(path, t, d) for d in FORMATS]
        if not args.no_torch:
            cs += [Torch(path, t), Torch(path, t, "bfloat16")]
        ids = np.random.default_rng(0).integers(0, 1000, size=T)
        nbytes = {c.name: weight_bytes(c.model) if isinstance(c, Cy)
                  else weight_bytes(cs[0].model) // (2 if "bfloat16" in c.name else 1) for c in cs}

        def prefill(c):
            settle()
            return {"prefill_s": _timed(lambda: c.prefill(ids))}

        def decode(c):
            settle()
            bw = read_bandwidth(t, mb=256, reps=1)
            _, tps = c.generate(ids[:32], n_new)
            return {"decode_tps": tps, "read_gbs": bw}

        print(f"{name}: measuring {len(cs)} contenders x {reps} repeats", flush=True)
        res = measure(cs, {"prefill": prefill, "decode": decode}, reps)
        rss = {} if args.quick else {d: peak_rss(path, d, t) for d in FORMATS}
        if not args.quick and not args.no_torch:
            rss["PyTorch"] = torch_rss(path, t)
        f32 = res["cyformer float32"]
        lines += [f"## {name}", "", "| contender | decode (tokens/s) | x cyformer f32 | prefill (s) | "
                  "x cyformer f32 | MB read per token | GB/s | of read bandwidth | peak RSS (MB) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in cs:
            r = res[c.name]
            gbs = [tps * nbytes[c.name] / 1e9 for tps in r["decode_tps"]]
            share = stat([g / b for g, b in zip(gbs, r["read_gbs"])])[0]
            key = c.name.split()[-1] if isinstance(c, Cy) else "PyTorch" if c.name.count(" ") == 1 else None
            r_rss = rss.get(key)
            lines.append(
                f"| {c.name} | {fmt(r['decode_tps'])} | {stat(r['decode_tps'])[0] / stat(f32['decode_tps'])[0]:.2f}x | "
                f"{fmt(r['prefill_s'], digits=3)} | {stat(f32['prefill_s'])[0] / stat(r['prefill_s'])[0]:.2f}x | "
                f"{nbytes[c.name] / 1e6:.0f} | {fmt(gbs)} | {share:.0%} | "
                f"{'-' if r_rss is None else f'{r_rss:.0f}'} |")
        lines.append(f"\nStreaming read probe beside the decodes: {fmt(f32['read_gbs'])} GB/s.\n")
        if not args.quick:
            errs = logit_errors(path)
            lines += ["| format | max abs logit error | mean abs logit error |", "|---|---|---|"]
            lines += [f"| {d} | {e[0]:.4f} | {e[1]:.5f} |" for d, e in errs.items()]
            lines.append("")
        del cs
    if not args.quick:
        acc, n = accuracy()
        lines += [f"## Accuracy on held-out code (bundled model, {n} tokens of its held-out standard-library modules)", "",
                  "| format | perplexity | vs float32 | top-1 agreement with float32 |", "|---|---|---|---|"]
        p32 = acc["float32"][0]
        lines += [f"| {d} | {p:.3f} | {p / p32 - 1:+.2%} | {a:.2%} |" for d, (p, a) in acc.items()]
    md = "\n".join(lines)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")[:40]
        out = os.path.join(args.out, f"{datetime.date.today()}-formats-{slug}.md")
        with open(out, "w") as f:
            f.write(md + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
