"""Random GPT-2 checkpoints for benchmarking (no download, no torch needed)."""

import json
import os

import numpy as np

GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)


def make_checkpoint(path, seed=0, **geometry):
    """Write config.json + model.safetensors with random float32 weights.
    Reuses an existing directory written with the same geometry and seed."""
    from safetensors.numpy import save_file

    cfg = dict(model_type="gpt2", activation_function="gelu_new", layer_norm_epsilon=1e-5,
               n_inner=None, bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"],
               _bench_seed=seed, **geometry)
    cfg_path = os.path.join(path, "config.json")
    if os.path.exists(cfg_path) and os.path.exists(os.path.join(path, "model.safetensors")):
        with open(cfg_path) as f:
            if json.load(f) == cfg:
                return path
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    L, C, V, P = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    D = 4 * C

    def rnd(*shape, scale):
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    t = {"wte.weight": rnd(V, C, scale=0.02), "wpe.weight": rnd(P, C, scale=0.01),
         "ln_f.weight": 1 + rnd(C, scale=0.1), "ln_f.bias": rnd(C, scale=0.1)}
    for i in range(L):
        h = f"h.{i}."
        t.update({
            h + "ln_1.weight": 1 + rnd(C, scale=0.1), h + "ln_1.bias": rnd(C, scale=0.1),
            h + "attn.c_attn.weight": rnd(C, 3 * C, scale=C ** -0.5), h + "attn.c_attn.bias": rnd(3 * C, scale=0.1),
            h + "attn.c_proj.weight": rnd(C, C, scale=C ** -0.5 / 4), h + "attn.c_proj.bias": rnd(C, scale=0.1),
            h + "ln_2.weight": 1 + rnd(C, scale=0.1), h + "ln_2.bias": rnd(C, scale=0.1),
            h + "mlp.c_fc.weight": rnd(C, D, scale=C ** -0.5), h + "mlp.c_fc.bias": rnd(D, scale=0.1),
            h + "mlp.c_proj.weight": rnd(D, C, scale=D ** -0.5 / 4), h + "mlp.c_proj.bias": rnd(C, scale=0.1),
        })
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


# Llama-family geometries (transformers config.json keys) of models people run on CPUs.
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True)
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False)


def make_llama_checkpoint(path, seed=0, **config):
    """config.json + model.safetensors of a Llama-family model (Hugging Face
    names, nn.Linear [out, in] weights) with random float32 weights; reused
    when the directory already holds the same config and seed."""
    from safetensors.numpy import save_file

    cfg = dict(architectures=["LlamaForCausalLM" if config["model_type"] == "llama" else "Qwen2ForCausalLM"],
               hidden_act="silu", bos_token_id=0, eos_token_id=0, _bench_seed=seed, **config)
    cfg_path = os.path.join(path, "config.json")
    if os.path.exists(cfg_path) and os.path.exists(os.path.join(path, "model.safetensors")):
        with open(cfg_path) as f:
            if json.load(f) == cfg:
                return path
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    C, F, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = C // H

    def rnd(*shape, scale):
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    t = {"model.embed_tokens.weight": rnd(V, C, scale=0.02), "model.norm.weight": 1 + rnd(C, scale=0.1)}
    qwen = cfg["model_type"] == "qwen2"
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": 1 + rnd(C, scale=0.1),
            p + "self_attn.q_proj.weight": rnd(H * D, C, scale=C ** -0.5),
            p + "self_attn.k_proj.weight": rnd(G * D, C, scale=C ** -0.5),
            p + "self_attn.v_proj.weight": rnd(G * D, C, scale=C ** -0.5),
            p + "self_attn.o_proj.weight": rnd(C, H * D, scale=C ** -0.5 / 4),
            p + "post_attention_layernorm.weight": 1 + rnd(C, scale=0.1),
            p + "mlp.gate_proj.weight": rnd(F, C, scale=C ** -0.5),
            p + "mlp.up_proj.weight": rnd(F, C, scale=C ** -0.5),
            p + "mlp.down_proj.weight": rnd(C, F, scale=F ** -0.5 / 4),
        })
        if qwen:
            for n, m in (("q", H), ("k", G), ("v", G)):
                t[p + f"self_attn.{n}_proj.bias"] = rnd(m * D, scale=0.1)
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path
