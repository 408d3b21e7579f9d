"""The fused decode step (kernels.decode): one new token through every layer
in one kernel call.  It must give bitwise the logits and cache of the
per-op kernels, match Hugging Face's cached decoding, and refuse bad input."""

import os

import numpy as np
import pytest
import torch

import cyformer
from cyformer.kernels import decode
from cyformer.kv_cache import PAD

TOL = 1e-4  # logits against HF, as in test_model_hf.py


def per_op_step(backend, kv, token, threads):
    """One token through the unfused kernels, as the hooked path runs them."""
    past = kv.length
    resid = backend.embed(np.array([token]), past, threads)
    for block in backend.blocks:
        block(resid, kv, past, threads)
    kv.length = past + 1
    return backend.unembed(backend.ln_f(resid, threads), threads)


@pytest.mark.parametrize("name", ["odd", "erf"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_step_is_bitwise_the_per_op_path(checkpoint, rng, name, threads):
    path, _ = checkpoint(name)
    be = cyformer.load(path, threads=threads).backend
    cfg = be.config
    ids = rng.integers(0, cfg.vocab_size, size=cfg.n_positions)
    fused, ref = be.new_cache(cfg.n_positions), be.new_cache(cfg.n_positions)
    be.run(ids[:5], fused)
    be.run(ids[:5], ref)
    for t in ids[5:]:  # up to a full context
        got = be.run(np.array([t]), fused)
        want = per_op_step(be, ref, t, threads)
        assert np.array_equal(got, want)
    assert np.array_equal(fused.k, ref.k) and np.array_equal(fused.v, ref.v)
    assert fused.length == ref.length == cfg.n_positions


def test_fused_step_bundled_model_same_at_every_thread_count():
    """d_model 256, 4 heads: several 64-row blocks per product and more
    threads than heads."""
    outs = []
    for threads in (1, 2, 3, 5):
        m = cyformer.load(threads=threads)
        be = m.backend
        kv = be.new_cache(32)
        be.run(np.arange(7), kv)
        outs.append(np.concatenate([be.run(np.array([t]), kv) for t in (5, 9, 200, 3)]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("name", ["odd", "erf"])
def test_fused_step_matches_hf_cached_decoding(checkpoint, rng, name):
    path, hf = checkpoint(name)
    be = cyformer.load(path, threads=2).backend
    V = be.config.vocab_size
    prompt = rng.integers(0, V, size=6)
    kv = be.new_cache(be.config.n_positions)
    be.run(prompt, kv)
    with torch.no_grad():
        out = hf(torch.tensor(prompt[None]), use_cache=True)
        past = out.past_key_values
        for t in rng.integers(0, V, size=20):
            out = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            got = be.run(np.array([t]), kv)
            np.testing.assert_allclose(got[0], out.logits[0, -1].numpy(), atol=TOL, rtol=0)


@pytest.fixture
def step_and_cache(checkpoint):
    be = cyformer.load(checkpoint("odd")[0]).backend
    kv = be.new_cache(8)
    kv.reserve(8)  # arrays for 8 positions (a new cache allocates on its first run)
    return be.step, kv


@pytest.mark.parametrize("change,match", [
    (dict(token=-1), "token id -1 is outside the vocabulary"),
    (dict(token=101), "token id 101 is outside the vocabulary"),
    (dict(token=1.5), "token"),
    (dict(token="a"), "token"),
    (dict(past=-1), "past=-1 is outside the cache"),
    (dict(past=8 + PAD), f"past={8 + PAD} is outside the cache"),  # 8 positions + padding
    (dict(threads=0), "threads"),
])
def test_step_refuses_bad_arguments(step_and_cache, change, match):
    step, kv = step_and_cache
    args = dict(token=3, k_cache=kv.k, v_cache=kv.v, past=0, threads=1)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        step(args["token"], args["k_cache"], args["v_cache"], args["past"], threads=args["threads"])


def test_step_refuses_bad_caches(step_and_cache):
    step, kv = step_and_cache
    with pytest.raises(ValueError, match="k_cache"):
        step(3, kv.k[:1], kv.v, 0)
    with pytest.raises(ValueError, match="v_cache"):
        step(3, kv.k, kv.v.transpose(0, 1, 3, 2).copy(), 0)
    with pytest.raises((ValueError, TypeError), match="k_cache"):
        step(3, kv.k.astype(np.float64), kv.v, 0)
    with pytest.raises(ValueError, match="k_cache"):
        step(3, kv.k[..., ::2], kv.v, 0)
    ro = kv.v.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="v_cache"):
        step(3, kv.k, ro, 0)
    with pytest.raises(ValueError, match="share memory|overlap"):
        step(3, kv.k, kv.k.reshape(kv.v.shape), 0)


def test_step_refuses_misshapen_weights(checkpoint):
    import dataclasses

    m = cyformer.load(checkpoint("odd")[0])
    cfg, w = m.config, m.weights
    decode.DecodeStep(cfg, w)  # the good case builds
    b0 = w.blocks[0]

    def with_block(**parts):
        return dataclasses.replace(w, blocks=(dataclasses.replace(b0, **parts),) + w.blocks[1:])

    bad_attn = dataclasses.replace(b0.c_attn, weight=b0.c_attn.weight[:, :-1].copy())
    with pytest.raises(ValueError, match=r"blocks\[0\].attn.c_attn.weight"):
        decode.DecodeStep(cfg, with_block(c_attn=bad_attn))
    no_bias = dataclasses.replace(b0.c_fc, bias=None)
    with pytest.raises(ValueError, match=r"blocks\[0\].mlp.c_fc.bias is missing"):
        decode.DecodeStep(cfg, with_block(c_fc=no_bias))
    with pytest.raises(ValueError, match="n_layer"):
        decode.DecodeStep(cfg, dataclasses.replace(w, blocks=w.blocks[:1]))
    with pytest.raises(ValueError, match="lm_head"):
        decode.DecodeStep(cfg, dataclasses.replace(w, lm_head=w.lm_head[:-1].copy()))
    with pytest.raises(ValueError, match="rope_cos must be None"):
        decode.DecodeStep(cfg, w, np.zeros((cfg.n_positions, cfg.d_head // 2), np.float32))


@pytest.mark.parametrize("model, dtype", [(m, d) for m in ("bundled", "odd")
                                          for d in ("float32", "bfloat16", "int8", "int4")]
                         + [("bundled", "q8_0"), ("bundled", "q4_0")])  # q8_0, q4_0 need whole blocks of 32
@pytest.mark.parametrize("n_seq", [5, 13])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batched_step_is_bitwise_each_sequence_alone(checkpoint, rng, model, n_seq, dtype, threads):
    """Sequences at different positions, with caches of different sizes, in
    one step: every row equals that sequence's own one-token step.  13
    sequences span more than one register tile of rows at every kernel
    level; the odd geometry has ragged column strips."""
    path = None if model == "bundled" else checkpoint(model)[0]
    be = cyformer.load(path, threads=threads, dtype=dtype).backend
    V = be.config.vocab_size
    lens = [3, 17, 1, 9, 30, 2, 5, 11, 4, 7, 1, 6, 8][:n_seq]
    alone, together = [], []
    for n in lens:
        prompt = rng.integers(0, V, size=n)
        a, b = be.new_cache(n + 4), be.new_cache(n + 4)
        be.run(prompt, a)
        be.run(prompt, b)
        alone.append(a)
        together.append(b)
    for _ in range(3):
        tokens = rng.integers(0, V, size=len(lens))
        want = np.concatenate([be.run(np.array([t]), kv) for t, kv in zip(tokens, alone)])
        got = be.step.batch(tokens, [kv.k for kv in together], [kv.v for kv in together],
                            [kv.length for kv in together], threads=threads)
        for kv in together:
            kv.length += 1
        assert np.array_equal(got, want)
    for a, b in zip(alone, together):
        assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


def test_batched_step_refuses_bad_batches():
    be = cyformer.load().backend
    a, b = be.new_cache(8), be.new_cache(8)
    step = be.step.batch
    with pytest.raises(ValueError, match="as long as each other"):
        step([1, 2], [a.k], [a.v, b.v], [0, 0])
    with pytest.raises(ValueError, match="non-empty"):
        step([], [], [], [])
    with pytest.raises(ValueError, match="share memory"):
        step([1, 2], [a.k, a.k], [a.v, b.v], [0, 0])
    with pytest.raises(ValueError, match="is outside the cache"):
        step([1, 2], [a.k, b.k], [a.v, b.v], [0, 9 + PAD])


def test_step_barrier_with_more_threads_than_cpus_beside_another_team(rng):
    """The fused step's team barrier: a team larger than the CPUs (its
    waits go to sleep on the futex almost at once), run from a second
    Python thread while the first one's OpenMP team sits idle, gives the
    one-thread logits and caches at every step."""
    import threading
    be = cyformer.load(threads=2).backend
    V = be.config.vocab_size
    n = min((os.cpu_count() or 1) + 1, 8)
    be.run(rng.integers(0, V, size=5), be.new_cache(8))  # this thread's team of 2, left idle
    lens = [3, 9, 1, 6, 12]
    caches = {}
    for t in (1, n):
        caches[t] = []
        for m in lens:
            kv = be.new_cache(m + 8)
            be.run(np.arange(m) % V, kv)
            caches[t].append(kv)
    out = {1: [], n: []}
    steps = rng.integers(0, V, size=(6, len(lens)))

    def run(t):
        for tokens in steps:
            kvs = caches[t]
            out[t].append(be.step.batch(tokens, [kv.k for kv in kvs], [kv.v for kv in kvs],
                                        [kv.length for kv in kvs], threads=t))
            for kv in kvs:
                kv.length += 1

    run(1)
    worker = threading.Thread(target=run, args=(n,))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert len(out[n]) == len(steps)
    for a, b in zip(out[1], out[n]):
        assert np.array_equal(a, b)
    for a, b in zip(caches[1], caches[n]):
        assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


@pytest.mark.parametrize("T", [4, 13, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_forward_is_bitwise_each_sequence_alone(checkpoint, rng, T, threads):
    for name in ("odd", "erf"):
        m = cyformer.load(checkpoint(name)[0], threads=threads)
        T = min(T, m.config.n_positions)
        ids = rng.integers(0, m.config.vocab_size, size=(3, T))
        got = m.forward(ids)
        for b in range(3):
            assert np.array_equal(got[b], m.forward(ids[b]))
