"""Many concurrent streams through the engine, beside transformers' batched generate.

    python bench/serve.py            # GPT-2 small geometry, 1..32 streams (several minutes)
    python bench/serve.py --quick    # a tiny model, smoke run

For each concurrency c, c requests (random prompts of --prompt tokens,
--new greedy tokens each) are submitted to one Engine at once; each token's
time is taken where the scheduler hands it over.  Reported: aggregate
tokens/s (all tokens / wall time from submission to the last token), time to
first token and inter-token latency (p50, p99 over every stream).  Beside
them, in the same run: transformers' GPT2LMHeadModel.generate on the same
weights with the batch of c prompts (left padding, attention mask), greedy,
aggregate tokens/s and time to first token (a generate of one token).

Also: time to first token of a request whose prompt shares a --prefix-token
prefix with an earlier one, with and without the prefix cache.

With --structured [MODEL_DIR]: instead, the cost of constrained decoding
(cyformer.structured): at 1 and 8 streams, rounds of text prompts with and
without a JSON schema (an array of at least 200 integers, which the model goes on
writing), interleaved and repeated, on a model with a tokenizer (default:
the bundled one); reported: decode tokens/s (streams / ITL p50) of each and
their ratio.  Writes bench/results/<date>-serve-structured.md.

Writes bench/results/<date>-serve.md and a PNG (throughput and latency
against concurrency), and prints the table.  Timings on a shared machine
are only comparable within one run.
"""

import argparse
import datetime
import json
import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from weights import GPT2_SMALL, TINY, make_checkpoint  # noqa: E402

import cyformer  # noqa: E402
from cyformer.engine import Engine  # noqa: E402

CACHE = os.environ.get("CYFORMER_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cyformer-bench"))


def engine_round(model, prompts, new_tokens, prefix_cache_mb=0, **generation):
    """Submit every prompt at once; per-stream token times -> metrics."""
    times = [[] for _ in prompts]
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def sink(i):
        def on_event(ev):
            if ev is None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            elif ev.token is not None:
                times[i].append(time.perf_counter())
        return on_event

    with Engine(model, max_batch=max(len(prompts), 1), max_queue=len(prompts) + 1,
                prefix_cache_mb=prefix_cache_mb) as engine:
        gens = []
        from cyformer.generate import Generation
        from cyformer.request import GenerationRequest
        # random weights: ignore_eos gives always the full number of tokens
        request = GenerationRequest(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, **generation)
        for p in prompts:
            gens.append(Generation(model, p, request))
        t0 = time.perf_counter()
        engine.submit(gens, [sink(i) for i in range(len(prompts))])
        done.wait()
        t_end = time.perf_counter()
    n = sum(len(t) for t in times)
    ttft = [t[0] - t0 for t in times if t]
    itl = np.concatenate([np.diff(t) for t in times if len(t) > 1] or [np.zeros(0)])
    return {"tokens_per_s": n / (t_end - t0), "tokens": n,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "itl_p50": float(np.percentile(itl, 50)) if itl.size else float("nan"),
            "itl_p99": float(np.percentile(itl, 99)) if itl.size else float("nan")}


def hf_round(hf, prompts, new_tokens):
    import torch

    batch = len(prompts)
    ids = torch.as_tensor(np.array(prompts), dtype=torch.long)
    mask = torch.ones_like(ids)  # same lengths: left padding adds nothing
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    n = (out.shape[1] - ids.shape[1]) * batch
    return {"tokens_per_s": n / (t2 - t1), "ttft": t1 - t0,
            "itl_mean": (t2 - t1 - (t1 - t0)) / max(new_tokens - 1, 1)}


def prefix_ttft(model, prefix, suffix_len, rng, cache_mb):
    """TTFT of a second request that shares ``prefix`` with the first."""
    vocab = model.config.vocab_size
    first = prefix + rng.integers(1, vocab, suffix_len).tolist()
    second = prefix + rng.integers(1, vocab, suffix_len).tolist()
    with Engine(model, prefix_cache_mb=cache_mb) as engine:
        engine.generate(first, max_new_tokens=1).result()
        s = engine.generate(second, max_new_tokens=1)
        s.result()
        return s.stats["time_to_first_token_s"]


ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": 200}  # never complete within --new
STRUCTURED_PROMPTS = ["primes = ", "data = ", "x = ", "values = ", "ids = ", "sizes = ", "rows = ", "n = "]


def structured_overhead(args):
    from cyformer.loader import default_model_path

    model = cyformer.load(args.structured or default_model_path(), threads=args.threads)
    res = {}
    engine_round(model, STRUCTURED_PROMPTS[:1], 8, json_schema=ARRAY)  # warm up (the tokenizer's mask tables)
    for _ in range(args.repeats):
        for c in (1, 8):
            prompts = STRUCTURED_PROMPTS[:c]
            for kind, kw in (("free", {"token_healing": False}), ("json", {"json_schema": ARRAY})):
                e = engine_round(model, prompts, args.new, **kw)
                res.setdefault((c, kind), []).append(c / e["itl_p50"])
    lines = [f"# Constrained decoding overhead, {datetime.date.today()}", "",
             f"- model {os.path.basename(model.path)} ({model.config.vocab_size} tokens), {model.threads} threads; "
             f"text prompts, {args.new} greedy tokens per stream, schema {json.dumps(ARRAY)} "
             "(llguidance masks); free rounds without healing, so both start the same way",
             f"- decode tok/s = streams / ITL p50; median (range) of {args.repeats} interleaved rounds",
             "- the machine may be shared: compare within this run only", "",
             "| streams | free decode tok/s | json_schema decode tok/s | overhead |", "|---|---|---|---|"]
    for c in (1, 8):
        f, j = sorted(res[(c, "free")]), sorted(res[(c, "json")])
        fm, jm = float(np.median(f)), float(np.median(j))
        lines.append(f"| {c} | {fm:.0f} ({f[0]:.0f}-{f[-1]:.0f}) | {jm:.0f} ({j[0]:.0f}-{j[-1]:.0f}) | "
                     f"{(1 - jm / fm) * 100:.1f} % |")
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{datetime.date.today()}-serve-structured.md"), "w") as f:
        f.write(report)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, concurrency 1 and 4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--new", type=int, default=24, help="new tokens per stream")
    ap.add_argument("--concurrency", type=str, default="1,4,8,16,32")
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--structured", nargs="?", const="", default=None, metavar="MODEL_DIR",
                    help="measure constrained decoding's cost instead (default model: the bundled one)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per case with --structured")
    args = ap.parse_args()
    if args.structured is not None:
        return structured_overhead(args)
    geometry, label = (TINY, "tiny") if args.quick else (GPT2_SMALL, "GPT-2 small")
    levels = [1, 4] if args.quick else [int(c) for c in args.concurrency.split(",")]
    if args.quick:
        args.new, args.prefix_tokens = min(args.new, 8), min(args.prefix_tokens, 64)
    path = make_checkpoint(os.path.join(CACHE, "gpt2-small" if not args.quick else "tiny"), **geometry)
    model = cyformer.load(path, threads=args.threads)
    threads = model.threads
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    hf = None
    if not args.no_hf:
        try:
            import torch
            from transformers import GPT2LMHeadModel
            torch.set_num_threads(threads)
            hf = GPT2LMHeadModel.from_pretrained(path).eval()
        except ImportError:
            print("transformers/torch not installed: engine only", file=sys.stderr)

    # warm up both
    engine_round(model, [rng.integers(1, vocab, args.prompt).tolist()], 4)
    if hf is not None:
        hf_round(hf, [rng.integers(1, vocab, args.prompt).tolist()], 2)

    rows = []
    t_start = time.perf_counter()
    for c in levels:
        prompts = [rng.integers(1, vocab, args.prompt).tolist() for _ in range(c)]
        e = engine_round(model, prompts, args.new)
        h = hf_round(hf, prompts, args.new) if hf is not None else None
        rows.append((c, e, h))
        print(f"c={c}: engine {e['tokens_per_s']:.1f} tok/s, ttft p50 {e['ttft_p50'] * 1e3:.0f} ms, "
              f"itl p50 {e['itl_p50'] * 1e3:.1f} p99 {e['itl_p99'] * 1e3:.1f} ms"
              + (f"; transformers {h['tokens_per_s']:.1f} tok/s" if h else ""), file=sys.stderr)
    prefix = rng.integers(1, vocab, args.prefix_tokens).tolist()
    colds, warms = [], []
    for _ in range(3):  # interleaved, median of three
        colds.append(prefix_ttft(model, prefix, 16, rng, 0))
        warms.append(prefix_ttft(model, prefix, 16, rng, 256))
    cold, warm = float(np.median(colds)), float(np.median(warms))
    elapsed = time.perf_counter() - t_start

    base = rows[0][1]["tokens_per_s"]
    lines = [f"# cyformer serving benchmark, {datetime.date.today()}", "",
             f"- {label} geometry, random float32 weights; {threads} threads; prompt {args.prompt} tokens, "
             f"{args.new} greedy new tokens per stream; all streams submitted at once",
             "- engine: continuous batching over `backend.step_batch` (`DecodeStep.batch`: one pass over "
             "the weights per step for every active sequence)",
             "- engine tok/s counts every generated token over the whole round (prefill included); decode "
             "tok/s is streams / ITL p50, the steady rate once every stream is decoding",
             "- the machine may be shared: compare ratios within this run only",
             f"- run time {elapsed:.0f} s", "",
             "| streams | engine tok/s | x one stream | decode tok/s | x one stream | TTFT p50 (ms) | TTFT p99 (ms) "
             "| ITL p50 (ms) | ITL p99 (ms) | transformers tok/s | engine / transformers | transformers TTFT (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_decode = 1 / rows[0][1]["itl_p50"]
    for c, e, h in rows:
        hf_cols = (f"{h['tokens_per_s']:.1f} | {e['tokens_per_s'] / h['tokens_per_s']:.2f} | {h['ttft'] * 1e3:.0f}"
                   if h else "- | - | -")
        decode = c / e["itl_p50"]
        lines.append(f"| {c} | {e['tokens_per_s']:.1f} | {e['tokens_per_s'] / base:.2f} | {decode:.1f} | "
                     f"{decode / base_decode:.2f} | {e['ttft_p50'] * 1e3:.0f} | "
                     f"{e['ttft_p99'] * 1e3:.0f} | {e['itl_p50'] * 1e3:.1f} | {e['itl_p99'] * 1e3:.1f} | {hf_cols} |")
    lines += ["", f"Prefix cache: a request sharing a {args.prefix_tokens}-token prefix with the one before it "
                  f"(16 tokens of its own): time to first token {cold * 1e3:.0f} ms without the cache, "
                  f"{warm * 1e3:.0f} ms with it ({cold / warm:.1f}x shorter; medians of 3 interleaved)."]
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{datetime.date.today()}-serve{'-quick' if args.quick else ''}")
    with open(stem + ".md", "w") as f:
        f.write(report)
    plot(rows, stem + ".png", label, threads)


def plot(rows, path, label, threads):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart", file=sys.stderr)
        return
    cs = [r[0] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(cs, [r[1]["tokens_per_s"] for r in rows], "o-", label="cyformer engine")
    if all(r[2] for r in rows):
        a.plot(cs, [r[2]["tokens_per_s"] for r in rows], "s--", label="transformers batched generate")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent streams")
    a.set_ylabel("aggregate tokens/s")
    a.set_title(f"throughput ({label}, {threads} threads)")
    a.legend()
    b.plot(cs, [r[1]["itl_p50"] * 1e3 for r in rows], "o-", label="inter-token p50")
    b.plot(cs, [r[1]["itl_p99"] * 1e3 for r in rows], "o--", label="inter-token p99")
    b.plot(cs, [r[1]["ttft_p50"] * 1e3 for r in rows], "^-", label="first token p50")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("concurrent streams")
    b.set_ylabel("ms")
    b.set_title("cyformer engine latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
