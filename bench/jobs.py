"""Tokens/s of cyformer.jobs score and collect on GPT-2-small geometry.

In one run: in-process at 1 and 2 threads, and on a local Ray cluster with
1 worker x 2 threads and 2 workers x 1 thread.  Random weights (bench/weights.py)
with the bundled model's tokenizer (its ids fit GPT-2's vocabulary).

Two figures per run: end to end (Ray's cluster start excluded, its actors'
start and model load included), and steady state: the tokens of every
shard but the first over the time from the first shard to the last.

    python bench/jobs.py [--docs 24] [--doc-tokens 256] [--reps 1]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weights import GPT2_SMALL, make_checkpoint  # noqa: E402

HOOK = "blocks.6.hook_resid_post"


def corpus(path, model, docs, doc_tokens):
    """docs documents of about doc_tokens tokens of Python-like text."""
    lines = [f"def f{i}(x, y):\n    return x * {i} + y - {i % 13}\n" for i in range(4000)]
    text, rows, i = "", [], 0
    while len(rows) < docs:
        text += lines[i % len(lines)]
        i += 1
        if len(model.encode(text)) >= doc_tokens:
            rows.append(json.dumps({"text": text}))
            text = ""
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")
    return path


def run(kind, corpus_path, out, model, engine, workers, threads):
    from cyformer import jobs

    stamps = []
    t0 = time.perf_counter()
    common = dict(shard_rows=2, progress=False, overwrite=True, on_shard=lambda r: stamps.append(
        (time.perf_counter(), r["tokens"])))
    if engine == "local":
        import cyformer
        m = cyformer.load(model, threads=threads)
        t0 = time.perf_counter()
        args = dict(model=m, **common)
    else:
        args = dict(model=model, engine="ray", workers=workers, threads=threads, **common)
    if kind == "score":
        s = jobs.score(corpus_path, out, **args)
    else:
        s = jobs.collect(corpus_path, out, hooks=[HOOK], **args)
    total = time.perf_counter() - t0
    steady = sum(t for _, t in stamps[1:]) / (stamps[-1][0] - stamps[0][0])
    return s.tokens / total, steady


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cyformer-bench-jobs"))
    a = ap.parse_args()

    import cyformer
    import ray

    model = make_checkpoint(os.path.join(a.dir, "gpt2-small"), **GPT2_SMALL)
    bundled = cyformer.load()
    shutil.copy(os.path.join(bundled.path, "tokenizer.json"), model)
    path = corpus(os.path.join(a.dir, "corpus.jsonl"), bundled, a.docs, a.doc_tokens)
    from cyformer.jobs.ray_engine import init_local_ray

    init_local_ray(num_cpus=2)
    configs = [("in-process, 1 thread", "local", 1, 1), ("in-process, 2 threads", "local", 1, 2),
               ("Ray, 1 worker x 2 threads", "ray", 1, 2), ("Ray, 2 workers x 1 thread", "ray", 2, 1)]
    results = {}
    for rep in range(a.reps):
        for name, engine, workers, threads in configs:
            for kind in ("score", "collect"):
                out = os.path.join(a.dir, "out", kind)
                r = run(kind, path, out, model, engine, workers, threads)
                results.setdefault((name, kind), []).append(r)
                print(f"  rep {rep} {name:28s} {kind:8s} end-to-end {r[0]:7.1f} tok/s, steady {r[1]:7.1f} tok/s",
                      file=sys.stderr, flush=True)
    ray.shutdown()

    def best(name, kind, i):
        return max(r[i] for r in results[(name, kind)])

    print(f"\n{a.docs} documents of ~{a.doc_tokens} tokens, GPT-2-small geometry, {cyformer.build_info()['isa']}"
          f" kernels, best of {a.reps}; collect stores {HOOK} as float32\n")
    print("| configuration | score tok/s (steady) | score end-to-end | collect tok/s (steady) "
          "| collect end-to-end | collect / score time |")
    print("|---|---|---|---|---|---|")
    for name, *_ in configs:
        s, c = best(name, "score", 1), best(name, "collect", 1)
        print(f"| {name} | {s:.0f} | {best(name, 'score', 0):.0f} | {c:.0f} | {best(name, 'collect', 0):.0f} "
              f"| {s / c:.2f}x |")
    ref = {k: best("in-process, 2 threads", k, 1) for k in ("score", "collect")}
    for name in ("Ray, 1 worker x 2 threads", "Ray, 2 workers x 1 thread"):
        print(f"\n{name} / in-process 2 threads (steady): score {best(name, 'score', 1) / ref['score']:.2f}x, "
              f"collect {best(name, 'collect', 1) / ref['collect']:.2f}x", end="")
    print()


if __name__ == "__main__":
    main()
