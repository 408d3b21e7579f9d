"""The Llama family (Llama, Qwen2, Mistral) against transformers on PyTorch CPU.

Every tensor random, at odd geometries that together cover one key/value
head, as many key/value heads as heads and a ratio of 3; head_dim that is
neither 64 nor hidden / heads; tied and untied unembeddings; rope_theta 1e4
and 1e6; llama3 and linear rope scaling; q/k/v biases (Qwen2).

Tolerance: max |logit difference| <= 1e-4 and the same argmax.
"""

import numpy as np
import pytest

import cyformer
from helpers import compare_logits, hf_greedy, hf_logits, make_hf_llama

TOL = 1e-4

LLAMA_GEOMETRIES = {
    # GQA 3:1, head_dim 20 (not hidden/heads = 10), untied, llama3 scaling
    "llama-gqa3": ("llama", dict(hidden_size=60, intermediate_size=77, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=20,
                                 vocab_size=131, max_position_embeddings=48, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False,
                                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0,
                                                   original_max_position_embeddings=16))),
    # one key/value head, q/k/v biases, tied, rope_theta 1e6
    "qwen2-mqa": ("qwen2", dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=1, vocab_size=97,
                                max_position_embeddings=40, rope_theta=1e6, rms_norm_eps=1e-6,
                                tie_word_embeddings=True, use_sliding_window=False)),
    # as many key/value heads as heads, head_dim 24, linear scaling
    "mistral-mha": ("mistral", dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                    num_attention_heads=3, num_key_value_heads=3, head_dim=24,
                                    vocab_size=113, max_position_embeddings=36, rope_theta=1e4,
                                    sliding_window=None, tie_word_embeddings=False,
                                    rope_scaling=dict(rope_type="linear", factor=2.0))),
    # attention_bias on every projection, GQA 2:1, tied
    "llama-bias": ("llama", dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                 max_position_embeddings=32, attention_bias=True, mlp_bias=True,
                                 tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            model_type, geometry = LLAMA_GEOMETRIES[name]
            path = str(tmp_path_factory.mktemp(name))
            made[name] = (path, make_hf_llama(path, model_type, seed=len(made), **geometry))
        return made[name]

    return get


def compare(model, hf, ids):
    return compare_logits(model, hf, ids, TOL)


@pytest.mark.parametrize("name", sorted(LLAMA_GEOMETRIES))
def test_logits_match_transformers(llama, name, rng):
    path, hf = llama(name)
    m1 = cyformer.load(path, threads=1)
    m2 = cyformer.load(path, threads=2)
    cfg = m1.config
    assert cfg.model_type == LLAMA_GEOMETRIES[name][0]
    for T in (1, 2, 13, cfg.n_positions):
        ids = rng.integers(0, cfg.vocab_size, size=T)
        a = compare(m1, hf, ids)
        assert np.array_equal(a, m2.forward(ids)), "1 and 2 threads differ"
    batch = rng.integers(0, cfg.vocab_size, size=(3, 11))
    got = compare(m2, hf, batch)  # one batched pass: each row bitwise its sequence alone
    assert all(np.array_equal(got[b], m2.forward(batch[b])) for b in range(3))


@pytest.mark.parametrize("name", sorted(LLAMA_GEOMETRIES))
def test_greedy_generate_matches_transformers(llama, name, rng):
    """Token for token, running into the end of the context."""
    path, hf = llama(name)
    model = cyformer.load(path, threads=2)
    P = model.config.n_positions
    prompt = rng.integers(0, model.config.vocab_size, size=5).tolist()
    # the last token comes from the logits at position P - 1
    want = hf_greedy(hf, prompt, P - len(prompt) + 1)
    got = model.generate(prompt, max_new_tokens=P, temperature=0)
    assert got.finish_reason in ("context", "eos")
    assert list(got) == want[:len(got)]
    if got.finish_reason == "context":
        assert len(got) == len(want)


@pytest.mark.parametrize("name", sorted(LLAMA_GEOMETRIES))
def test_backends_agree(llama, name, rng):
    path, _ = llama(name)
    ids = rng.integers(0, 90, size=9)
    ref = cyformer.load(path, backend="cython").forward(ids)
    for backend in ("numpy", "naive"):
        got = cyformer.load(path, backend=backend).forward(ids)
        assert np.abs(got - ref).max() <= TOL, backend


@pytest.mark.parametrize("name", sorted(LLAMA_GEOMETRIES))
def test_decode_steps_equal_prefill(llama, name, rng):
    """The fused decode step gives bitwise the logits of the unfused path."""
    path, _ = llama(name)
    model = cyformer.load(path, threads=2)
    be = model.backend
    ids = rng.integers(0, model.config.vocab_size, size=12)
    kv = be.new_cache(len(ids))
    be.run(ids[:4], kv)
    ref = be.new_cache(len(ids))
    be.run(ids[:4], ref)
    for t in ids[4:]:
        assert np.array_equal(be.run(np.array([t]), kv), _per_op(be, ref, t))


def _per_op(be, kv, token):
    """One token through the per-op kernels (the path prefill takes)."""
    from cyformer.kernels import linalg

    past = kv.length
    resid = be.embed(np.array([token]), past, be.threads)
    ws = linalg.Workspace()
    for block in be.blocks:
        block(resid, kv, past, be.threads, ws)
    kv.length = past + 1
    return be.unembed(be.ln_f(resid, be.threads), be.threads)


# -- loading ---------------------------------------------------------------

def test_sharded_checkpoint(llama, tmp_path, rng):
    path, hf = llama("llama-gqa3")
    shard_dir = tmp_path / "sharded"
    hf.save_pretrained(shard_dir, safe_serialization=True, max_shard_size="20KB")
    assert (shard_dir / "model.safetensors.index.json").exists()
    ids = rng.integers(0, 131, size=10)
    assert np.array_equal(cyformer.load(shard_dir).forward(ids), cyformer.load(path).forward(ids))


def test_sharded_checkpoint_errors(llama, tmp_path):
    import json
    import shutil

    _, hf = llama("llama-gqa3")
    d = tmp_path / "bad"
    hf.save_pretrained(d, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # a tensor in two shards
    dup = tmp_path / "dup"
    shutil.copytree(d, dup)
    from safetensors.numpy import load_file, save_file
    a, b = shards[0], shards[1]
    ta, tb = load_file(dup / a), load_file(dup / b)
    name = next(iter(ta))
    tb[name] = ta[name]
    save_file(tb, dup / b)
    with pytest.raises(cyformer.ModelLoadError, match="also in|ambiguous"):
        cyformer.load(dup)
    # a shard that is missing
    (d / shards[-1]).unlink()
    with pytest.raises(cyformer.ModelLoadError, match="missing"):
        cyformer.load(d)
    # an index whose shard name leads outside the directory
    index["weight_map"][name] = "../elsewhere.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(cyformer.ModelLoadError, match="not a file name"):
        cyformer.load(d)


def test_bfloat16_checkpoint(tmp_path, rng):
    import torch
    from transformers import LlamaForCausalLM

    hf = make_hf_llama(str(tmp_path / "f32"), "llama", seed=5, hidden_size=32, intermediate_size=40,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=50, max_position_embeddings=16)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ids = rng.integers(0, 50, size=7)
    got = cyformer.load(tmp_path / "bf16").forward(ids)
    # the bf16 weights widened to float32 (a fresh model, so its rotary
    # frequencies are float32 as well): what cyformer computes with
    wide = LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    ref = hf_logits(wide, ids)[0]
    assert np.abs(got - ref).max() <= TOL


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 4}, "multiple of the 4 key/value heads"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"use_sliding_window": True, "model_type": "qwen2"}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
])
def test_unsupported_options_are_refused(llama, tmp_path, change, match):
    import json
    import shutil

    path, _ = llama("llama-gqa3")
    d = tmp_path / "m"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(cyformer.ModelLoadError, match=match):
        cyformer.load(d)


def test_sliding_window_bounds_the_context(llama, tmp_path):
    import json
    import shutil

    path, _ = llama("mistral-mha")
    d = tmp_path / "m"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 20
    (d / "config.json").write_text(json.dumps(cfg))
    model = cyformer.load(d)
    assert model.config.n_positions == 20
    with pytest.raises(ValueError, match="context"):
        model.forward(list(range(21)))


def test_missing_and_misshapen_tensors(llama, tmp_path):
    from safetensors.numpy import load_file, save_file
    import shutil

    path, _ = llama("qwen2-mqa")
    d = tmp_path / "m"
    shutil.copytree(path, d)
    t = load_file(d / "model.safetensors")
    t.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(t, d / "model.safetensors")
    with pytest.raises(cyformer.ModelLoadError, match="missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        cyformer.load(d)
    t["model.layers.1.self_attn.k_proj.bias"] = np.zeros(13, dtype=np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(cyformer.ModelLoadError, match="shape"):
        cyformer.load(d)


# -- looking inside ----------------------------------------------------------

def test_hook_names_and_shapes(llama, rng):
    path, _ = llama("llama-gqa3")
    model = cyformer.load(path)
    names = model.hook_names()
    assert "hook_pos_embed" not in names
    for p in ("attn.hook_rot_q", "attn.hook_rot_k", "mlp.hook_pre_linear", "ln1.hook_scale"):
        assert f"blocks.0.{p}" in names
    ids = rng.integers(0, 131, size=7)
    logits, cache = model.run_with_cache(ids)
    assert np.array_equal(logits, model.forward(ids))  # recording changes nothing
    assert cache["blocks.0.attn.hook_q"].shape == (7, 6, 20)
    assert cache["blocks.0.attn.hook_k"].shape == (7, 2, 20)
    assert cache["blocks.0.attn.hook_rot_k"].shape == (7, 2, 20)
    assert cache["blocks.1.attn.hook_pattern"].shape == (6, 7, 7)
    assert cache["blocks.0.mlp.hook_post"].shape == (7, 77)
    # SwiGLU: post = silu(pre) * pre_linear
    pre, lin = (cache[f"blocks.1.mlp.hook_{n}"].astype(np.float64) for n in ("pre", "pre_linear"))
    np.testing.assert_allclose(cache["blocks.1.mlp.hook_post"], pre / (1 + np.exp(-pre)) * lin,
                               rtol=1e-5, atol=1e-6)
    # RMSNorm: normalized = x / scale * gain
    x = cache["blocks.1.hook_resid_pre"]
    scale = cache["blocks.1.ln1.hook_scale"]
    np.testing.assert_allclose(scale[:, 0], np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-5), rtol=1e-6)


def test_head_views_under_gqa(llama):
    path, _ = llama("llama-gqa3")
    model = cyformer.load(path)
    W = model.weights.blocks[0].c_attn.weight  # [C, (6 + 2*2) * 20]
    heads = model.blocks[0].attn.heads
    assert [h.kv_index for h in heads] == [0, 0, 0, 1, 1, 1]
    assert np.array_equal(heads[4].W_K, W[:, (6 + 1) * 20:(6 + 2) * 20])
    assert np.array_equal(heads[4].W_V, W[:, (6 + 2 + 1) * 20:(6 + 2 + 2) * 20])
    assert heads[4].b_Q is None
    assert heads[2].ov_circuit().shape == (60, 60)
    mlp = model.blocks[0].mlp
    assert mlp.W_gate.shape == mlp.W_in.shape == (60, 77)
    n = mlp.neurons[3]
    assert np.array_equal(n.gate, mlp.W_gate[:, 3]) and np.array_equal(n.read, mlp.W_in[:, 3])


def test_logit_lens_and_attribution_with_rmsnorm(llama, rng):
    from cyformer.interp import direct_logit_attribution, logit_lens

    path, _ = llama("qwen2-mqa")
    model = cyformer.load(path)
    ids = rng.integers(0, 97, size=8)
    lens = logit_lens(model, ids, k=3)
    assert np.array_equal(lens.top_ids[-1, :, 0], model.forward(ids).argmax(-1))
    dla = direct_logit_attribution(model, ids, token=5)
    assert dla.pos_embed == 0.0 and dla.ln_final_bias == 0.0
    assert abs(dla.total() - dla.logit) <= 1e-3 * max(1.0, abs(dla.logit))
    assert abs(dla.logit - model.forward(ids)[-1, 5]) <= 1e-4


def test_generate_cache_names(llama, rng):
    path, _ = llama("llama-gqa3")
    model = cyformer.load(path)
    out = model.generate(rng.integers(0, 131, size=4).tolist(), max_new_tokens=5,
                         cache_names=["blocks.1.attn.hook_rot_k", "blocks.0.hook_resid_post"])
    assert out.cache["blocks.1.attn.hook_rot_k"].shape == (9, 2, 20)
