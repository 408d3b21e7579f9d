"""KV memory follows the tokens held: caches grow as they fill, and the
engine keeps its sequences' caches within a budget by queueing and
preempting (recompute later), never by refusing or failing a request."""

import numpy as np
import pytest

import cyformer
from cyformer.engine import Engine
from cyformer.kv_cache import GROW_MIN, KVCache, position_bytes
from helpers import make_hf_llama


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A small Llama whose config declares a 128K context (8 KB per cached position)."""
    path = str(tmp_path_factory.mktemp("llama-128k"))
    make_hf_llama(path, "llama", seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=97,
                  max_position_embeddings=131072, tie_word_embeddings=False)
    return cyformer.load(path)


def test_cache_grows_and_keeps_its_rows():
    m = cyformer.load()
    be = m.backend
    kv = be.new_cache(m.config.n_positions)
    assert kv.capacity == 0 and kv.nbytes < 20 * kv.position_bytes and kv.limit == m.config.n_positions
    whole = KVCache(m.config, m.config.n_positions, capacity=m.config.n_positions)
    ids = np.arange(5, 205)
    a, b = be.run(ids, kv, last_only=True), be.run(ids, whole, last_only=True)
    assert np.array_equal(a, b) and kv.capacity == GROW_MIN
    caps = set()
    for t in range(300):  # through growth: 256 -> 512 positions (the context)
        tok = np.array([int(np.argmax(a[-1]))])
        a, b = be.run(tok, kv), be.run(tok, whole)
        assert np.array_equal(a, b), f"step {t}: a grown cache changed the logits"
        caps.add(kv.capacity)
    assert caps == {256, 512} and kv.length == whole.length == 500
    n = kv.length
    assert np.array_equal(kv.k[..., :n], whole.k[..., :n]) and np.array_equal(kv.v[:, :, :n], whole.v[:, :, :n])
    with pytest.raises(ValueError, match="capacity"):
        be.run(np.arange(20), kv)


def test_batched_steps_grow_their_caches(long_context):
    m = long_context
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 90, n).tolist() for n in (250, 3, 70)]
    alone = [m.generate(p, max_new_tokens=40) for p in prompts]
    assert m.generate(prompts, max_new_tokens=40) == alone


def test_32_long_context_requests_within_64_mb(long_context):
    """The target load: 32 requests without a token limit (up to the 128K
    context) on a 64 MB budget.  Whole contexts would be 32 x 1 GB; the
    budget holds 8K positions, fewer than 16 prompts of 420: requests wait
    and running ones are preempted, none fails, the caches never pass the
    budget, and every request ends by its stop ids, as it would alone."""
    m = long_context
    per = position_bytes(m.config)
    assert per == 8192 and m.config.n_positions == 131072
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 90, 420).tolist() for _ in range(32)]
    with Engine(m, kv_cache_mb=64, max_queue=32) as engine:
        streams = [engine.generate(p, max_new_tokens=m.config.n_positions - len(p), temperature=1.0,
                                   seed=i, stop=[3, 7, 11, 13]) for i, p in enumerate(prompts)]
        outs = [s.result(timeout=300) for s in streams]
        st = engine.stats()
    assert st["finished"] == 32 and st["failed"] == 0
    assert all(o.finish_reason in ("stop", "eos") for o in outs)
    kv = st["kv_cache"]
    assert kv["max_bytes"] == 64 * 2**20 and 0 < kv["peak_bytes"] <= kv["max_bytes"]
    assert st["preempted"] >= 1  # 16 prompts of 420 positions alone need more than 64 MB
    assert kv["bytes"] == 0 and kv["positions"] == 0  # all given back
    # a generation that was never preempted is the one it would be alone
    kept = [i for i, s in enumerate(streams) if s.preemptions == 0][:4]
    assert len(kept) == 4 and sum(s.preemptions for s in streams) == st["preempted"]
    for i in kept:
        assert outs[i] == m.generate(prompts[i], max_new_tokens=m.config.n_positions - 420, temperature=1.0,
                                     seed=i, stop=[3, 7, 11, 13])


def test_alone_over_budget(long_context):
    """A prompt larger than the whole budget is the one refusal (a clear
    error); a sequence that outgrows the budget alone ends as if its
    context were full."""
    m = long_context
    with Engine(m, kv_cache_mb=2) as engine:  # 256 positions, less a row's padding
        with pytest.raises(MemoryError, match="budget"):
            engine.generate(list(range(2, 90)) * 3, max_new_tokens=4).result(timeout=60)
        out = engine.generate([5, 6, 7], max_new_tokens=1000, stop=list(range(97))[-1:]).result(timeout=60)
        assert engine.stats()["kv_cache"]["peak_bytes"] <= 2 * 2**20
    # capacities move in steps of 64 positions: 192 is the last that fits
    assert out.finish_reason == "context" and 3 + len(out) - 1 == 192


def test_kv_cache_mb_is_checked(long_context):
    with pytest.raises(ValueError, match="kv_cache_mb"):
        Engine(long_context, kv_cache_mb=0)
