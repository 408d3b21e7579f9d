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
from helpers import hf_greedy, hf_logits, make_hf_llama

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
    got = model.forward(ids)
    ref = hf_logits(hf, ids)
    ref = ref if np.ndim(ids) == 2 else ref[0]
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = float(np.abs(got - ref).max())
    assert diff <= TOL, f"max |logit diff| {diff:.3g} > {TOL}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    return got


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
    compare(m2, hf, rng.integers(0, cfg.vocab_size, size=(3, 11)))


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
        fused = be.run(np.array([t]), kv)
        per_op = be.blocks and _per_op(be, ref, t)
        assert np.array_equal(fused, per_op)


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
