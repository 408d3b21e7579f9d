"""The "numpy" and "naive" backends against the compiled "cython" one.

All three compute the same GPT-2, so at the tiny geometries of conftest.py
their logits agree within TOL (max |difference|; float32 arithmetic lands
near 1e-6 here) and greedy generation picks the same tokens.  The naive
backend is pure Python: keep sequences short.
"""

import inspect

import numpy as np
import pytest

import cyformer
from cyformer.backends import BACKENDS
from cyformer.backends.cython import CythonBackend
from cyformer.backends.naive import NaiveBackend
from cyformer.backends.numpy_ref import NumpyBackend
from helpers import hf_logits

TOL = 1e-4
OTHERS = ["numpy", "naive"]  # each compared with "cython"


@pytest.fixture(scope="module")
def models(checkpoint):
    """models(geometry) -> {backend name: Model}, loaded once per module."""
    made = {}

    def get(name):
        if name not in made:
            path, _ = checkpoint(name)
            made[name] = {b: cyformer.load(path, threads=2, backend=b) for b in BACKENDS}
        return made[name]

    return get


def max_diff(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("shape", [(1,), (11,), (2, 6)], ids=["T=1", "T=11", "batch"])
def test_forward_matches_cython(models, rng, backend, shape):
    ms = models("odd")
    ids = rng.integers(0, ms["cython"].config.vocab_size, size=shape)
    ref = ms["cython"].forward(ids)
    got = ms[backend].forward(ids)
    assert got.shape == (*shape, 101)
    diff = max_diff(got, ref)
    assert diff <= TOL, f"{backend}: max |logit diff| {diff:.3g} > {TOL}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("backend", OTHERS)
def test_erf_geometry_matches_cython(models, rng, backend):
    """Exact (erf) GELU, 4 heads, 3 layers."""
    ms = models("erf")
    assert ms["cython"].config.gelu == "gelu"
    ids = rng.integers(0, 257, size=7 if backend == "naive" else 30)
    diff = max_diff(ms[backend].forward(ids), ms["cython"].forward(ids))
    assert diff <= TOL, f"{backend}: max |logit diff| {diff:.3g} > {TOL}"


def test_numpy_matches_hf(checkpoint, models, rng):
    """The reference stands on its own too, not only next to the kernels."""
    for name in ("odd", "erf"):
        _, hf = checkpoint(name)
        m = models(name)["numpy"]
        ids = rng.integers(0, m.config.vocab_size, size=m.config.n_positions)  # the full context
        diff = max_diff(m.forward(ids), hf_logits(hf, ids)[0])
        assert diff <= TOL, f"{name}: max |logit diff| {diff:.3g} > {TOL}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_runs_equal_one_full_run(models, rng, backend):
    """Feeding positions one at a time, or in uneven chunks, through ``run``
    with one cache gives the logits of a single run over all of them."""
    b = models("odd")[backend].backend
    ids = rng.integers(0, 101, size=9)
    full = b.run(ids, b.new_cache(len(ids)))
    for chunks in ([1] * 9, [3, 1, 5]):
        kv = b.new_cache(len(ids))
        parts, start = [], 0
        for n in chunks:
            parts.append(b.run(ids[start:start + n], kv))
            start += n
            assert kv.length == start
        diff = max_diff(np.concatenate(parts), full)
        assert diff <= 1e-5, f"{backend} {chunks}: max |logit diff| {diff:.3g}"
    # last_only: only the last position's logits, same values, cache still advanced
    kv = b.new_cache(len(ids))
    b.run(ids[:4], kv)
    last = b.run(ids[4:], kv, last_only=True)
    assert last.shape == (1, 101) and kv.length == 9
    assert max_diff(last, full[-1:]) <= 1e-5


@pytest.mark.parametrize("backend", OTHERS)
def test_run_past_capacity_raises(models, backend):
    b = models("odd")[backend].backend
    kv = b.new_cache(3)
    b.run(np.array([1, 2], dtype=np.int64), kv)
    with pytest.raises(ValueError, match="capacity"):
        b.run(np.array([3, 4], dtype=np.int64), kv)
    assert kv.length == 2


def test_greedy_generation_equal_across_backends(checkpoint, rng):
    path, _ = checkpoint("odd")
    prompt = rng.integers(0, 101, size=5).tolist()
    outs = {}
    for backend in BACKENDS:
        m = cyformer.load(path, backend=backend)
        object.__setattr__(m.config, "eos_token_id", None)  # these random models may emit it
        outs[backend] = m.generate(prompt, max_new_tokens=8)
        assert len(outs[backend]) == 8 and outs[backend].finish_reason == "length"
    assert outs["numpy"] == outs["cython"] == outs["naive"]
    # streaming goes through the same caches
    m = cyformer.load(path, backend="naive")
    object.__setattr__(m.config, "eos_token_id", None)
    assert list(m.stream(prompt, max_new_tokens=3)) == outs["cython"][:3]


def test_numpy_weights_are_views(models):
    """The per-head W_Q/W_K/W_V/W_O are reshapes of the loaded arrays, not copies."""
    m = models("odd")["numpy"]
    w, attn = m.weights.blocks[0], m.backend.blocks[0].attn
    cfg = m.config
    for mat in (attn.W_Q, attn.W_K, attn.W_V):
        assert mat.shape == (cfg.n_head, cfg.n_embd, cfg.d_head)
        assert np.shares_memory(mat, w.c_attn.weight)
    assert attn.W_O.shape == (cfg.n_head, cfg.d_head, cfg.n_embd)
    assert np.shares_memory(attn.W_O, w.attn_c_proj.weight)
    # head 1's key block is columns C + D .. C + 2D of c_attn
    C, D = cfg.n_embd, cfg.d_head
    np.testing.assert_array_equal(attn.W_K[1], w.c_attn.weight[:, C + D:C + 2 * D])


def _params(cls, method):
    """(name, kind, default) of each parameter; annotations left out, since each
    backend annotates its own cache type."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, method)).parameters.values()]


def test_backends_share_one_interface(models):
    classes = {"cython": CythonBackend, "numpy": NumpyBackend, "naive": NaiveBackend}
    assert set(classes) == set(BACKENDS)
    for method in ("__init__", "new_cache", "run"):
        sigs = {name: _params(cls, method) for name, cls in classes.items()}
        # The shared interface is the numpy backend's; a backend may take more
        # (the cython run's optional hooks=, with supports_hooks), never less
        # and only as optional parameters after the shared ones.
        core = sigs["numpy"]
        for name, sig in sigs.items():
            assert sig[:len(core)] == core, f"{method}: {name} {sig} != {core}"
            extra = sig[len(core):]
            assert all(d is not inspect.Parameter.empty for _, _, d in extra), f"{method}: {name} {extra}"
    from cyformer.backends import Backend

    protocol = {n for n in Backend.__annotations__} | {n for n in vars(Backend) if not n.startswith("_")}
    for name, cls in classes.items():
        # every member of the protocol, the optional capabilities declared on the class itself
        assert protocol <= set(dir(cls)), f"{name} lacks {protocol - set(dir(cls))}"
        assert isinstance(cls.supports_hooks, bool)
        assert cls.exact_chunk is None or (isinstance(cls.exact_chunk, int) and cls.exact_chunk >= 1)
        assert ("hooks" in inspect.signature(cls.run).parameters) == cls.supports_hooks
    for name, cls in classes.items():
        assert cls.name == name
    ms = models("odd")
    public = {b: {n for n in dir(m) if not n.startswith("_") and callable(getattr(m, n))}
              for b, m in ms.items()}
    assert public["cython"] >= {"forward", "generate", "stream", "encode", "decode"}
    assert public["cython"] == public["numpy"] == public["naive"]
    for b, m in ms.items():
        assert isinstance(m.backend, Backend)
        assert m.backend.name == b and f"({b})" in repr(m)
        kv = m.backend.new_cache(4)
        assert kv.length == 0


def test_unknown_backend_names_the_choices(checkpoint):
    path, _ = checkpoint("odd")
    with pytest.raises(ValueError, match="bogus") as e:
        cyformer.load(path, backend="bogus")
    for name in BACKENDS:
        assert name in str(e.value)


def test_forward_hands_out_fresh_logits_and_forgets_earlier_runs(checkpoint, models, rng):
    """The cython backend reuses its activation memory and a plain forward's
    KV cache from call to call: a returned array must never be part of that
    memory, and what a longer run left behind must not reach a shorter one."""
    path, _ = checkpoint("odd")
    m = models("odd")["cython"]
    short, long = rng.integers(0, 101, size=5), rng.integers(0, 101, size=37)
    fresh = cyformer.load(path, threads=2)
    want_short = fresh.forward(short)
    first = m.forward(long)
    kept = first.copy()
    got_short = m.forward(short)
    assert np.array_equal(got_short, want_short)
    assert np.array_equal(first, kept) and not np.shares_memory(first, got_short)
    assert np.array_equal(m.forward(long), kept)


def test_forward_reuses_logits_memory_only_once_nothing_refers_to_it(models, rng):
    """Dropped logits are handed out again (the saving is real memory, so it
    is checked); kept logits, a view of them, or a buffer exported from them
    make the next forward take new memory and leave them as they were."""
    m = models("odd")["cython"]
    ids = rng.integers(0, 101, size=(4, 21))
    want = [m.forward(s).copy() for s in ids]
    address = lambda a: a.__array_interface__["data"][0]  # noqa: E731

    first = m.forward(ids[0])
    freed = address(first)
    del first
    again = m.forward(ids[1])
    assert address(again) == freed and np.array_equal(again, want[1])

    for keep in (lambda a: a, lambda a: a[3:5, 7], lambda a: memoryview(a), lambda a: a.T):
        held = keep(again)
        snapshot = np.array(held, copy=True)
        del again
        again = m.forward(ids[2])
        assert not np.shares_memory(np.asarray(held), again)
        assert np.array_equal(np.asarray(held), snapshot)
        assert np.array_equal(again, want[2])
        del held

    # a shorter run takes the front of the larger buffer once it is free
    del again
    short = m.forward(ids[3][:6])
    assert np.array_equal(short, want[3][:6]) and short.flags.c_contiguous
    assert np.array_equal(m.forward(ids), np.stack(want))
