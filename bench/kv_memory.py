"""KV memory under load: 32 requests with no token limit on a model whose
config declares a 128K context, through one Engine.

    python bench/kv_memory.py [--budgets 64,default] [--other-tree PATH] [--repeats 3]

Each run is a fresh process (PYTHONPATH set to the tree under test) that
submits 32 prompts of --prompt random ids at once, max_new_tokens up to the
context, seeded sampling that ends on any of 4 stop ids, and reports wall
time, generated tokens/s, the engine's peak KV bytes and preemptions, and
the process's peak RSS.  --other-tree runs the same load on another
checkout (one without a KV budget runs at its defaults), interleaved with
this one, to compare.  Prints a markdown table of medians and ranges.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r'''
import json, resource, sys, time, inspect
import numpy as np
sys.path.insert(0, {tests!r})
import cyformer
from cyformer.engine import Engine
m = cyformer.load({path!r})
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 90, {prompt}).tolist() for _ in range(32)]
kw = {{}}
if {budget!r} != "default" and "kv_cache_mb" in inspect.signature(Engine).parameters:
    kw["kv_cache_mb"] = float({budget!r})
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
with Engine(m, max_queue=32, **kw) as e:
    streams = [e.generate(p, max_new_tokens=m.config.n_positions - len(p), temperature=1.0, seed=i,
                          stop=[3, 7, 11, 13]) for i, p in enumerate(prompts)]
    outs = [s.result(timeout=600) for s in streams]
    st = e.stats()
wall = time.perf_counter() - t
kv = st.get("kv_cache") or {{}}
print(json.dumps({{"wall_s": wall, "tokens": sum(len(o) for o in outs), "peak_kv_mb": kv.get("peak_bytes", 0) / 2**20,
                  "preempted": st.get("preempted", 0), "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_before_mb": rss0 / 1024}}))
'''


def make_model(path):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import make_hf_llama
    make_hf_llama(path, "llama", seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=97,
                  max_position_embeddings=131072, tie_word_embeddings=False)


def run(tree, path, budget, prompt):
    code = CHILD.format(tests=os.path.join(ROOT, "tests"), path=path, budget=budget, prompt=prompt)
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="64,default")
    ap.add_argument("--other-tree", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=420)
    ap.add_argument("--model", default=os.path.join(os.path.expanduser("~"), ".cache", "cyformer-bench", "llama-128k"))
    args = ap.parse_args()
    make_model(args.model)
    cases = [(ROOT, b) for b in args.budgets.split(",")]
    if args.other_tree:
        cases.append((args.other_tree, "default"))
    results = {c: [] for c in cases}
    for _ in range(args.repeats):
        for c in cases:
            results[c].append(run(c[0], args.model, c[1], args.prompt))
    print("| tree | budget MB | wall s (median, range) | tokens/s | peak KV MB | preempted | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for (tree, budget), rs in results.items():
        w = sorted(r["wall_s"] for r in rs)
        med = w[len(w) // 2]
        tps = sorted(r["tokens"] / r["wall_s"] for r in rs)[len(rs) // 2]
        print(f"| {os.path.basename(tree.rstrip('/'))} | {budget} | {med:.2f} ({w[0]:.2f}-{w[-1]:.2f}) | {tps:.0f} | "
              f"{max(r['peak_kv_mb'] for r in rs):.1f} | {max(r['preempted'] for r in rs)} | "
              f"{max(r['rss_mb'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
