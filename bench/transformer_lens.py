"""run_with_cache with every hook point: cyformer against TransformerLens.

GPT-2 small geometry with random weights (bench/weights.py), one sequence of
T tokens, the same thread count for both (torch.set_num_threads and
cyformer's threads).  Every point is cached on both sides with the optional
ones switched on (use_attn_result, use_split_qkv_input, use_hook_mlp_in).
The two run interleaved after a warm-up; the table gives medians.

    python bench/transformer_lens.py [--threads 2] [--tokens 128] [--repeats 7]
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


def lens_model(path, torch):
    """A HookedTransformer with the checkpoint's weights (TransformerLens's GPT-2 layout)."""
    from safetensors.numpy import load_file
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    g = GPT2_SMALL
    L, C, H = g["n_layer"], g["n_embd"], g["n_head"]
    D = C // H
    cfg = HookedTransformerConfig(n_layers=L, d_model=C, n_heads=H, d_head=D, d_mlp=4 * C,
                                  n_ctx=g["n_positions"], d_vocab=g["vocab_size"], act_fn="gelu_new",
                                  normalization_type="LN", positional_embedding_type="standard",
                                  original_architecture="GPT2LMHeadModel", use_attn_result=True,
                                  use_split_qkv_input=True, use_hook_mlp_in=True)
    t = load_file(os.path.join(path, "model.safetensors"))
    sd = {"embed.W_E": t["wte.weight"], "pos_embed.W_pos": t["wpe.weight"],
          "ln_final.w": t["ln_f.weight"], "ln_final.b": t["ln_f.bias"],
          "unembed.W_U": t["wte.weight"].T.copy(), "unembed.b_U": np.zeros(g["vocab_size"], np.float32)}
    for i in range(L):
        h, b = f"h.{i}.", f"blocks.{i}."
        W, bias = t[h + "attn.c_attn.weight"], t[h + "attn.c_attn.bias"]
        for j, n in enumerate("QKV"):
            sd[b + f"attn.W_{n}"] = W[:, j * C:(j + 1) * C].reshape(C, H, D).transpose(1, 0, 2).copy()
            sd[b + f"attn.b_{n}"] = bias[j * C:(j + 1) * C].reshape(H, D).copy()
        sd.update({b + "attn.W_O": t[h + "attn.c_proj.weight"].reshape(H, D, C),
                   b + "attn.b_O": t[h + "attn.c_proj.bias"],
                   b + "ln1.w": t[h + "ln_1.weight"], b + "ln1.b": t[h + "ln_1.bias"],
                   b + "ln2.w": t[h + "ln_2.weight"], b + "ln2.b": t[h + "ln_2.bias"],
                   b + "mlp.W_in": t[h + "mlp.c_fc.weight"], b + "mlp.b_in": t[h + "mlp.c_fc.bias"],
                   b + "mlp.W_out": t[h + "mlp.c_proj.weight"], b + "mlp.b_out": t[h + "mlp.c_proj.bias"]})
    model = HookedTransformer(cfg)
    model.load_state_dict({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=False)
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cyformer-bench-gpt2-small"))
    args = ap.parse_args()

    import torch

    import cyformer

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    path = make_checkpoint(args.dir, **GPT2_SMALL)
    ours = cyformer.load(path, threads=args.threads)
    ours.set_use_split_qkv_input(True)
    ours.set_use_hook_mlp_in(True)
    ours.set_ln_normalized("before_gain")  # what TransformerLens 3.x records
    lens = lens_model(path, torch)
    ids = np.random.default_rng(0).integers(0, GPT2_SMALL["vocab_size"], size=(1, args.tokens))
    tokens = torch.as_tensor(ids)

    def run_ours():
        return ours.run_with_cache(ids)

    def run_lens():
        return lens.run_with_cache(tokens)

    (l1, c1), (l2, c2) = run_ours(), run_lens()  # warm-up, and the two agree
    assert list(c1.keys()) == list(c2.keys()), "the caches name different points"
    # ln1 points differ in shape with split inputs (TransformerLens: one per head)
    worst = max(float(np.nanmax(np.abs(np.nan_to_num(c1[n]) - np.nan_to_num(c2[n].numpy()))))
                for n in c1.keys() if ".ln1." not in n)
    times = {"cyformer": [], "TransformerLens": []}
    for _ in range(args.repeats):
        for name, fn in (("cyformer", run_ours), ("TransformerLens", run_lens)):
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            del out
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"run_with_cache, every hook point ({len(c1)} arrays), GPT-2 small geometry, T={args.tokens}, "
          f"{args.threads} threads, median of {args.repeats} (interleaved); largest difference {worst:.2e}")
    print("| engine | seconds | vs TransformerLens |")
    print("|---|---|---|")
    for k in ("cyformer", "TransformerLens"):
        print(f"| {k} | {med[k]:.3f} | {med['TransformerLens'] / med[k]:.2f}x |")


if __name__ == "__main__":
    main()
