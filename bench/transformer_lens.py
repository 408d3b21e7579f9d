"""cyformer's TransformerBridge against TransformerLens 4's, torch tensors on both sides.

GPT-2 small geometry with random weights (bench/weights.py, with the bundled
model's tokenizer.json beside them so the bridge boots), both booted from the
one directory with boot_transformers and put in compatibility mode, the same
thread count (torch.set_num_threads and cyformer's threads).  Two tasks:

    run_with_cache   every hook point of one sequence of T tokens
    patching sweep   for each of the 12 heads of one layer and each of T_sweep
                     positions, run_with_hooks with that head's hook_z at that
                     position patched from a clean run's cache (12 x T_sweep passes)

The engines run interleaved after a warm-up, each task repeated; the table
gives medians and the spread (min-max).

    python bench/transformer_lens.py [--threads 2] [--tokens 128] [--sweep-tokens 16] [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

# This file's name is the package's: take bench/ off the path so that
# "import transformer_lens" finds TransformerLens, and load weights.py by path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _bench_weights():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_weights", os.path.join(_HERE, "weights.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_weights = _bench_weights()
GPT2_SMALL, make_checkpoint = _weights.GPT2_SMALL, _weights.make_checkpoint


def boot(path, torch):
    from transformer_lens.model_bridge import TransformerBridge as Theirs

    from cyformer.tl import TransformerBridge as Ours

    theirs = Theirs.boot_transformers(path, device="cpu")
    theirs.enable_compatibility_mode(disable_warnings=True)
    ours = Ours.boot_transformers(path, device="cpu")
    ours.enable_compatibility_mode(disable_warnings=True)
    return ours, theirs


def patching_sweep(model, clean, corrupt, layer, n_heads):
    """Logit difference after patching each head's clean hook_z at each position: [H, T]."""
    _, clean_cache = model.run_with_cache(clean, names_filter=[f"blocks.{layer}.attn.hook_z"])
    out = []
    for head in range(n_heads):
        for pos in range(clean.shape[1]):
            def patch(z, hook):
                z[:, pos, head] = clean_cache[hook.name][:, pos, head]
            logits = model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch)])
            out.append(float(logits[0, -1, 1] - logits[0, -1, 2]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sweep-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cyformer-bench-gpt2-small"))
    args = ap.parse_args()

    import shutil

    import torch

    import cyformer

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    path = make_checkpoint(args.dir, **GPT2_SMALL)
    shutil.copy(os.path.join(cyformer.loader.default_model_path(), "tokenizer.json"), path)
    ours, theirs = boot(path, torch)
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(0, GPT2_SMALL["vocab_size"], size=(1, args.tokens)))
    clean = torch.as_tensor(rng.integers(0, GPT2_SMALL["vocab_size"], size=(1, args.sweep_tokens)))
    corrupt = clean.clone()
    corrupt[0, 3] = (corrupt[0, 3] + 7) % GPT2_SMALL["vocab_size"]
    H = GPT2_SMALL["n_head"]

    engines = {"ours": ours, "theirs": theirs}
    tasks = {
        "run_with_cache": {k: (lambda e=e: e.run_with_cache(ids)) for k, e in engines.items()},
        "patching sweep": {k: (lambda e=e: patching_sweep(e, clean, corrupt, 5, H)) for k, e in engines.items()},
    }

    # warm-up, and the two agree
    (l1, c1), (l2, c2) = tasks["run_with_cache"]["ours"](), tasks["run_with_cache"]["theirs"]()
    common = [n for n in c2.keys() if n in c1 and n not in ("embed.hook_in", "pos_embed.hook_in")]
    worst = max(float((c1[n].float() - c2[n].float()).abs().max()) for n in common)
    s1, s2 = tasks["patching sweep"]["ours"](), tasks["patching sweep"]["theirs"]()
    worst_sweep = float(np.max(np.abs(np.array(s1) - np.array(s2))))
    times = {(t, e): [] for t in tasks for e in engines}
    for _ in range(args.repeats):
        for t in tasks:
            for e in engines:
                t0 = time.perf_counter()
                out = tasks[t][e]()
                times[t, e].append(time.perf_counter() - t0)
                del out
    print(f"GPT-2 small geometry, {args.threads} threads, medians of {args.repeats} interleaved repeats (min-max)")
    print(f"run_with_cache: T={args.tokens}, {len(c1)} names cached by cyformer, {len(c2)} by the bridge, "
          f"largest difference over the {len(common)} shared names {worst:.1e}")
    print(f"patching sweep: {H} heads x {args.sweep_tokens} positions of blocks.5.attn.hook_z = "
          f"{H * args.sweep_tokens} passes, largest logit-difference gap {worst_sweep:.1e}")
    print("| task | cyformer s | TransformerLens 4 bridge s | speedup |")
    print("|---|---|---|---|")
    for t in tasks:
        a, b = times[t, "ours"], times[t, "theirs"]
        print(f"| {t} | {statistics.median(a):.3f} ({min(a):.3f}-{max(a):.3f}) | "
              f"{statistics.median(b):.3f} ({min(b):.3f}-{max(b):.3f}) | "
              f"{statistics.median(b) / statistics.median(a):.2f}x |")


if __name__ == "__main__":
    main()
