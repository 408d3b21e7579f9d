"""Old checkout against new: are the numbers bitwise the same, and is it as fast?

    python bench/ab.py --old /path/to/old/checkout --new /path/to/new/checkout
    python bench/ab.py --old ... --new ... --rounds 5 --skip-numerics

Each checkout (built in place) runs in its own fresh process, imported
through PYTHONPATH from a directory outside both.  Numerics: logits of a
prompt, a 32-token greedy generation and the KV cache after the prompt, for
the bundled model and random GPT-2-geometry and Llama-geometry checkpoints
(and the logits of 8 one-token decode steps over that cache),
in every weight format at 1 and 2 threads; compared with np.array_equal.
Speed: decode tokens/s (64 new tokens after a 32-token prompt) and prefill of
512 tokens, float32 and int8, GPT-2 small geometry with random weights,
old/new alternating in fresh processes; median (min-max) of the rounds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("float32", "bfloat16", "int8", "int4")
GPT2_GEOMETRY = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=256)
LLAMA_GEOMETRY = dict(model_type="llama", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True)


def checkpoints(root):
    sys.path.insert(0, HERE)
    from weights import make_checkpoint, make_llama_checkpoint

    gpt2 = os.path.join(root, "gpt2-random")
    llama = os.path.join(root, "llama-random")
    make_checkpoint(gpt2, seed=3, **GPT2_GEOMETRY)
    make_llama_checkpoint(llama, seed=4, **LLAMA_GEOMETRY)
    return {"bundled": None, "gpt2-random": gpt2, "llama-random": llama}


def numerics_worker(spec, out):
    import cyformer

    arrays = {}
    for name, path in spec["models"].items():
        for fmt in FORMATS:
            for threads in (1, 2):
                m = cyformer.load(path, dtype=fmt, threads=threads)
                rng = np.random.default_rng(0)
                ids = rng.integers(0, min(m.config.vocab_size, 500), 40).tolist()
                key = f"{name}/{fmt}/t{threads}"
                arrays[key + "/logits"] = m.forward(ids)
                arrays[key + "/greedy"] = np.asarray(list(m.generate(ids, max_new_tokens=32, temperature=0)))
                kv = m.backend.new_cache(len(ids))
                m.backend.run(ids, kv)
                n = len(ids)
                arrays[key + "/k"] = np.ascontiguousarray(kv.k[..., :n])
                arrays[key + "/v"] = np.ascontiguousarray(kv.v[..., :n, :])
                # decode steps (one token each, the path generation takes) over that cache
                kv = m.backend.new_cache(n + 8)
                m.backend.run(ids, kv)
                arrays[key + "/steps"] = np.stack([np.array(m.backend.run([t], kv)).reshape(-1)
                                                   for t in ids[:8]])
    np.savez(out, **arrays)


def speed_worker(spec, out):
    sys.path.insert(0, HERE)
    from run import CACHE
    from weights import GPT2_SMALL, make_checkpoint

    import cyformer

    path = make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL)
    m = cyformer.load(path, dtype=spec["format"], threads=2)
    rng = np.random.default_rng(1)
    long = rng.integers(0, 50000, 512).tolist()
    short = long[:32]
    m.generate(short, max_new_tokens=4, temperature=0)  # warm-up: pools, workspaces
    m.forward(long)
    t = time.perf_counter()
    m.forward(long)
    prefill = time.perf_counter() - t
    g = m.generate(short, max_new_tokens=64, temperature=0, stop=None)
    with open(out, "w") as f:
        json.dump({"prefill_512_s": prefill, "decode_tok_s": g.stats["decode_tokens_per_s"],
                   "new_tokens": len(g)}, f)


def spawn(checkout, mode, spec, out):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), CYFORMER_ADAPTIVE_THREADS="0")
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, json.dumps(spec), out]
    subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), check=True)


def commit(checkout):
    return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def numerics(old, new, work):
    spec = {"models": checkpoints(work)}
    res = {}
    for side, checkout in (("old", old), ("new", new)):
        res[side] = os.path.join(work, f"numerics-{side}.npz")
        spawn(checkout, "numerics", spec, res[side])
    a, b = np.load(res["old"]), np.load(res["new"])
    rows = {}
    for key in a.files:
        model, fmt, threads, what = key.split("/")
        x, y = a[key], b[key]
        same = x.shape == y.shape and np.array_equal(x, y)
        diff = "" if same or x.shape != y.shape or what == "greedy" else f"{np.abs(x - y).max():.2g}"
        if what == "greedy" and not same:
            n = min(len(x), len(y))
            first = next((i for i in range(n) if x[i] != y[i]), n)
            diff = f"first differs at {first}"
        rows[(model, fmt, threads, what)] = (same, diff)
    print("| model | format | threads | logits (prompt) | KV k | KV v | logits (8 decode steps) | greedy 32 |")
    print("|---|---|---|---|---|---|---|---|")
    for model in spec["models"]:
        for fmt in FORMATS:
            for threads in ("t1", "t2"):
                cells = []
                for what in ("logits", "k", "v", "steps", "greedy"):
                    same, diff = rows[(model, fmt, threads, what)]
                    cells.append("equal" if same else f"differ ({diff})" if diff else "differ")
                print(f"| {model} | {fmt} | {threads[1:]} | " + " | ".join(cells) + " |")


def speed(old, new, work, rounds):
    vals = {}
    for r in range(rounds):
        for fmt in ("float32", "int8"):
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for side, checkout in order:
                out = os.path.join(work, f"speed-{side}-{fmt}-{r}.json")
                spawn(checkout, "speed", {"format": fmt}, out)
                with open(out) as f:
                    got = json.load(f)
                for metric in ("decode_tok_s", "prefill_512_s"):
                    vals.setdefault((fmt, metric, side), []).append(got[metric])
                print(f"round {r} {fmt} {side}: {got}", file=sys.stderr, flush=True)
    print("| format | metric | old median (min-max) | new median (min-max) | new/old (medians) |")
    print("|---|---|---|---|---|")
    for fmt in ("float32", "int8"):
        for metric in ("decode_tok_s", "prefill_512_s"):
            o, n = vals[(fmt, metric, "old")], vals[(fmt, metric, "new")]
            cell = lambda v: f"{np.median(v):.3g} ({min(v):.3g}-{max(v):.3g})"  # noqa: E731
            print(f"| {fmt} | {metric} | {cell(o)} | {cell(n)} | {np.median(n) / np.median(o):.3f} |")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, spec, out = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
        return (numerics_worker if mode == "numerics" else speed_worker)(spec, out)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-numerics", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    a = p.parse_args()
    print(f"old {commit(a.old)}  new {commit(a.new)}")
    with tempfile.TemporaryDirectory() as work:
        if not a.skip_numerics:
            numerics(a.old, a.new, work)
        if not a.skip_speed:
            speed(a.old, a.new, work, a.rounds)


if __name__ == "__main__":
    main()
