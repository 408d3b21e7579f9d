"""Every kernel against a NumPy reference, at 1 and 2 threads, odd sizes included.

Tolerances: products and sums are compared with a float64 reference using the
classic worst-case bound for a length-K float32 sum,
    |err| <= K * 2^-23 * (|x| @ |W| + |b|)    (elementwise),
which any indexing or masking bug exceeds by orders of magnitude.
Pointwise functions: 1e-6 relative plus 1e-6 absolute.
"""

import math

import numpy as np
import pytest

from cyformer.kernels import activations, attention, linalg, mlp, norm

EPS32 = 2.0 ** -23
THREADS = [1, 2]


def f32(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def assert_sum_close(got, ref, bound_terms, K):
    bound = max(K, 1) * EPS32 * bound_terms + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.max(err / bound)
    assert worst <= 1.0, f"error {err.max():.3g} exceeds the float32 sum bound (ratio {worst:.3g})"


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 768])
def test_dot(rng, n):
    a, b = f32(rng, n), f32(rng, n)
    ref = np.dot(a.astype(np.float64), b.astype(np.float64))
    got = linalg.dot_product(a, b)
    assert abs(got - ref) <= n * EPS32 * np.dot(np.abs(a), np.abs(b))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T,K,N", [(1, 1, 1), (1, 768, 2304), (1, 3072, 768), (2, 33, 17), (3, 64, 65),
                                   (2, 200, 5000), (4, 5, 7), (7, 96, 40), (13, 128, 100), (64, 48, 144)])
@pytest.mark.parametrize("w_t", [False, True])
def test_linear(rng, threads, T, K, N, w_t):
    x, W, b = f32(rng, T, K), f32(rng, K, N), f32(rng, N)
    ref = x.astype(np.float64) @ W + b
    Wk = np.ascontiguousarray(W.T) if w_t else W
    got = linalg.linear_forward(x, Wk, b, w_transposed=w_t, threads=threads)
    assert got.shape == (T, N) and got.dtype == np.float32
    assert_sum_close(got, ref, np.abs(x) @ np.abs(W) + np.abs(b), K)
    # no bias, accumulate into an existing array
    out = f32(rng, T, N)
    ref2 = out.astype(np.float64) + x.astype(np.float64) @ W
    linalg.linear_forward(x, Wk, None, out=out, w_transposed=w_t, accumulate=True, threads=threads)
    assert_sum_close(out, ref2, np.abs(x) @ np.abs(W) + np.abs(ref2), K + 1)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("K,N", [(96, 40), (768, 300), (64, 129), (256, 2100)])
def test_linear_rows_do_not_depend_on_how_many_from_4(rng, threads, K, N):
    """From 4 rows on, a row of x @ W + b is the same bits whatever the number
    of rows: the unpacked path for a few rows (_gemm_direct, whose panels
    widen with N and narrow with the rows to fit its scratch) and the packed
    GEMM give every output the same chain (prefill pieces rely on it)."""
    x, W, b = f32(rng, 80, K), f32(rng, K, N), f32(rng, N)
    whole = linalg.linear_forward(x, W, b, threads=threads)
    for t0, t1 in [(0, 4), (3, 20), (20, 63), (10, 80)]:
        part = linalg.linear_forward(np.ascontiguousarray(x[t0:t1]), W, b, threads=threads)
        assert np.array_equal(part, whole[t0:t1]), (t0, t1)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("K,N", [(1, 40), (33, 70), (200, 129), (130, 2100), (768, 300)])
@pytest.mark.parametrize("w_t", [False, True], ids=["KN", "NK"])
def test_batched_step_rows_are_each_row_alone(rng, threads, K, N, w_t):
    """The batched decode step's float32 product (matvec_rows: from
    GEMV_TILE_ROWS rows on, for W [K, N] tiles walking each 64-row block in
    column pieces; for W [N, K] tiles of 4 rows of W by 4 of x) gives
    every row of x the bits of that row alone, for any number of rows,
    ragged K and N included."""
    x, W = f32(rng, 19, K), f32(rng, K, N)
    x[3] *= 1e-20  # a row far from the others' scale
    Wl = np.ascontiguousarray(W.T) if w_t else W
    alone = np.concatenate([linalg.matvec_rows(x[r:r + 1], Wl, w_transposed=w_t, threads=threads)
                            for r in range(19)])
    for B in (2, 5, 6, 8, 9, 16, 19):
        got = linalg.matvec_rows(x[:B], Wl, w_transposed=w_t, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), alone[:B].view(np.uint32), err_msg=f"B={B}")
    assert_sum_close(alone, x.astype(np.float64) @ W, np.abs(x) @ np.abs(W), K)


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
@pytest.mark.parametrize("T", [1, 9])
def test_linear_fused_gelu(rng, act, T):
    x, W, b = f32(rng, T, 40), f32(rng, 40, 50, scale=0.2), f32(rng, 50)
    pre = x.astype(np.float64) @ W + b
    got = linalg.linear_forward(x, W, b, activation=act)
    np.testing.assert_allclose(got, gelu_ref(pre, act), rtol=1e-5, atol=1e-5)


def gelu_ref(x, kind):
    x = np.asarray(x, dtype=np.float64)
    if kind == "gelu":
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kind", ["gelu_new", "gelu"])
def test_gelu(rng, threads, kind):
    x = f32(rng, 1001, scale=3.0)
    x[:4] = [0.0, -0.0, 30.0, -30.0]
    ref = gelu_ref(x, kind)
    got = activations.gelu_inplace(x.copy(), kind, threads=threads)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    # the limits at +-inf: x and 0
    ends = activations.gelu_inplace(np.array([np.inf, -np.inf, -1e30, 1e30], np.float32), kind)
    np.testing.assert_array_equal(ends, np.array([np.inf, 0.0, 0.0, 1e30], np.float32))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 1000)])
def test_softmax(rng, threads, shape):
    x = f32(rng, *shape, scale=10.0)
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    got = activations.softmax_inplace(x.copy(), threads=threads)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)


def test_softmax_extremes():
    x = np.array([[1e30, -1e30, 0.0], [-np.inf, 0.0, -np.inf], [-np.inf] * 3,
                  [np.inf, 1.0, np.inf]], dtype=np.float32)
    got = activations.softmax_inplace(x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(got, [[1, 0, 0], [0, 1, 0], [1 / 3] * 3, [0.5, 0, 0.5]], atol=1e-7)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("T,C", [(1, 1), (1, 768), (5, 7), (33, 48)])
def test_layer_norm(rng, threads, T, C):
    x, g, b = f32(rng, T, C, scale=3.0) + 2.0, f32(rng, C), f32(rng, C)
    x64 = x.astype(np.float64)
    mu, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(var + 1e-5) * g + b
    scale = np.empty(T, np.float32)
    got = norm.layer_norm_forward(x, g, b, 1e-5, scale=scale, threads=threads)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scale, np.sqrt(var[:, 0] + 1e-5), rtol=1e-6)


def test_layer_norm_constant_row():
    x = np.full((2, 64), 3.25, np.float32)
    got = norm.layer_norm_forward(x, np.ones(64, np.float32), np.full(64, 0.5, np.float32))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, 0.5)


def attention_ref(qkv, k_past, v_past, H):
    """Causal attention in float64 with explicit loops over heads.
    k_past, v_past: [H, P, D] earlier positions.  Returns z [T, C], pattern [H, T, P+T]."""
    T, C3 = qkv.shape
    C = C3 // 3
    D = C // H
    q, k, v = (qkv[:, i * C:(i + 1) * C].astype(np.float64).reshape(T, H, D).transpose(1, 0, 2)
               for i in range(3))
    k = np.concatenate([k_past, k], axis=1)
    v = np.concatenate([v_past, v], axis=1)
    P = k_past.shape[1]
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(D)          # [H, T, P+T]
    mask = np.arange(P + T)[None, :] > (P + np.arange(T))[:, None]
    scores[:, mask] = -np.inf
    pat = np.exp(scores - scores.max(-1, keepdims=True))
    pat /= pat.sum(-1, keepdims=True)
    z = (pat @ v).transpose(1, 0, 2).reshape(T, C)
    return z, pat, scores


@pytest.mark.parametrize("threads", THREADS)
# T >= CYF_MR takes the tiled path (CYF_MR queries per tile: 6, or 12 with
# AVX-512), shorter T the one-query path; d_head 24, 8 and 40 leave partial
# strips of CYF_NR (16 or 32) columns, P + T not a multiple of CYF_NR leaves a
# partial strip of keys.
@pytest.mark.parametrize("H,D,T,P,cap", [(1, 1, 1, 0, 1), (3, 16, 7, 0, 7), (2, 8, 1, 5, 9),
                                         (4, 64, 13, 3, 20), (12, 64, 1, 30, 31),
                                         (2, 24, 11, 5, 20), (1, 8, 6, 0, 6), (3, 40, 37, 20, 64),
                                         (2, 64, 30, 0, 30), (2, 24, 25, 9, 50)])
def test_attention(rng, threads, H, D, T, P, cap):
    C = H * D
    qkv = f32(rng, T, 3 * C)
    k_past, v_past = f32(rng, H, P, D), f32(rng, H, P, D)
    k_cache = np.zeros((H, D, cap), np.float32)
    v_cache = np.zeros((H, cap, D), np.float32)
    k_cache[:, :, :P] = k_past.transpose(0, 2, 1)
    v_cache[:, :P] = v_past
    scores = np.empty((H, T, P + T), np.float32)
    pattern = np.empty((H, T, P + T), np.float32)
    z = attention.attention_forward(qkv, k_cache, v_cache, P, scores=scores, pattern=pattern,
                                    threads=threads)
    z_ref, pat_ref, scores_ref = attention_ref(qkv, k_past, v_past, H)
    np.testing.assert_allclose(z, z_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pattern, pat_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, scores_ref, rtol=1e-5, atol=1e-5)
    # the new keys and values landed in the cache at P..P+T-1
    k_new = qkv[:, C:2 * C].reshape(T, H, D).transpose(1, 2, 0)
    np.testing.assert_array_equal(k_cache[:, :, P:P + T], k_new)
    np.testing.assert_array_equal(v_cache[:, P:P + T], qkv[:, 2 * C:].reshape(T, H, D).transpose(1, 0, 2))


def test_attention_incremental_equals_full(rng):
    """Prefill of T positions == feeding them one at a time through the cache."""
    H, D, T = 3, 8, 6
    qkv = f32(rng, T, 3 * H * D)
    kf, vf = np.zeros((H, D, T), np.float32), np.zeros((H, T, D), np.float32)
    full = attention.attention_forward(qkv, kf, vf, 0)
    ki, vi = np.zeros_like(kf), np.zeros_like(vf)
    steps = np.concatenate([attention.attention_forward(qkv[t:t + 1], ki, vi, t) for t in range(T)])
    np.testing.assert_allclose(steps, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
@pytest.mark.parametrize("T,C,D", [(1, 8, 32), (5, 48, 77), (17, 64, 256)])
def test_mlp(rng, threads, act, T, C, D):
    x = f32(rng, T, C)
    W_fc, b_fc = f32(rng, C, D, scale=C ** -0.5), f32(rng, D)
    W_proj, b_proj = f32(rng, D, C, scale=D ** -0.5), f32(rng, C)
    h = gelu_ref(x.astype(np.float64) @ W_fc + b_fc, act)
    ref = h @ W_proj + b_proj
    got = mlp.mlp_forward(x, W_fc, b_fc, W_proj, b_proj, activation=act, threads=threads)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    resid = f32(rng, T, C)
    want = resid.astype(np.float64) + ref
    mlp.mlp_forward(x, W_fc, b_fc, W_proj, b_proj, out=resid, activation=act, accumulate=True,
                    threads=threads)
    np.testing.assert_allclose(resid, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", THREADS)
def test_add_and_embedding(rng, threads):
    out, x = f32(rng, 5, 9), f32(rng, 5, 9)
    want = out + x
    linalg.add_into(out, x, threads=threads)
    np.testing.assert_array_equal(out, want)
    wte, wpe = f32(rng, 11, 6), f32(rng, 8, 6)
    ids = np.array([3, 0, 10, 3])
    got = linalg.embedding(ids, wte, wpe, pos0=2, threads=threads)
    np.testing.assert_array_equal(got, wte[ids] + wpe[2:6])


def test_kernels_bitwise_equal_across_threads(rng):
    # both paths: T >= 4 (packed GEMM) and T < 4 (matrix-vector, where K = 200
    # is summed in blocks of 64 rows and 37 columns leave some threads idle)
    for T, N in ((37, 301), (1, 301), (3, 37)):
        x, W, b = f32(rng, T, 200), f32(rng, 200, N), f32(rng, N)
        one = linalg.linear_forward(x, W, b, threads=1)
        for n in (2, 3, 5, 16):
            assert np.array_equal(one, linalg.linear_forward(x, W, b, threads=n))
        Wt = np.ascontiguousarray(W.T)
        one = linalg.linear_forward(x, Wt, b, w_transposed=True, threads=1)
        for n in (2, 3, 5, 16):
            assert np.array_equal(one, linalg.linear_forward(x, Wt, b, w_transposed=True, threads=n))
    qkv = f32(rng, 9, 3 * 4 * 8)
    outs = []
    for n in (1, 2, 3):
        k, v = np.zeros((4, 8, 9), np.float32), np.zeros((4, 9, 8), np.float32)
        outs.append(attention.attention_forward(qkv, k, v, 0, threads=n))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stream_sum_probe_reads_every_element(rng, n, threads):
    """The benchmark's read-bandwidth probe must really read the whole array."""
    x = rng.integers(-8, 9, size=n).astype(np.float32)  # small integers: every order sums exactly
    assert linalg.stream_sum(x, threads=threads) == float(x.sum(dtype=np.float64))
    assert linalg.stream_sum(x.reshape(-1, 1), threads=threads) == float(x.sum(dtype=np.float64))
    with pytest.raises(ValueError, match="stream_sum"):
        linalg.stream_sum(x[::2] if n > 2 else x.astype(np.float64))


def test_workspace_arrays():
    """A name gives the same memory again; a larger request a new zeroed buffer."""
    ws = linalg.Workspace()
    a = ws.array("a", (3, 4))
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.c_contiguous and not a.any()
    a[:] = 7
    b = ws.array("a", (2, 5))  # fits: the same memory, holding what was written
    assert np.shares_memory(a, b) and (b == 7).all()
    c = ws.array("a", (10, 10))  # does not fit: a new buffer
    assert not np.shares_memory(a, c) and not c.any()
    d = ws.array("b", (3, 4))
    assert not np.shares_memory(c, d)
    assert ws.nbytes == 4 * (100 + 12)
    assert ws.array("e", (0, 5)).shape == (0, 5)
    with pytest.raises(ValueError, match="negative"):
        ws.array("a", (-1, 2))
    for bad in (5, (1.5,), ("2",), None):
        with pytest.raises(ValueError, match="Workspace.array: shape"):
            ws.array("a", bad)


@pytest.mark.parametrize("n", [1, 15, 1000, 300_001, 2_000_000])
def test_workspace_buffers_start_on_a_cache_line(n):
    """The GEMM packs its panels in Workspace scratch and loads them 64 bytes
    at a time; NumPy alone starts large arrays 16 bytes past a page."""
    ws = linalg.Workspace()
    for a in (ws.array("a", (n,)), ws.array("b", (1, n)), linalg.aligned_empty(n)):
        assert a.ctypes.data % 64 == 0 and a.size == n and a.dtype == np.float32 and a.flags.c_contiguous
    assert not ws.array("c", (n,)).any()


def test_kernels_in_a_reused_workspace_are_bitwise_the_same(rng):
    """Scratch left over from earlier calls (of other sizes, smaller and
    larger) changes nothing: every kernel writes scratch before reading it."""
    ws = linalg.Workspace()
    for T, K, N in ((37, 64, 300), (3, 200, 33), (50, 96, 130), (1, 8, 8), (20, 33, 70)):
        x, W, b = f32(rng, T, K), f32(rng, K, N), f32(rng, N)
        assert np.array_equal(linalg.linear_forward(x, W, b, workspace=ws, threads=2),
                              linalg.linear_forward(x, W, b, threads=2))
        Wt = np.ascontiguousarray(W.T)
        assert np.array_equal(linalg.linear_forward(x, Wt, None, w_transposed=True, workspace=ws),
                              linalg.linear_forward(x, Wt, None, w_transposed=True))
        W2, b2 = f32(rng, N, K), f32(rng, K)
        assert np.array_equal(mlp.mlp_forward(x, W, b, W2, b2, workspace=ws, threads=2),
                              mlp.mlp_forward(x, W, b, W2, b2, threads=2))
        H, D = 2, 8
        qkv = f32(rng, T, 3 * H * D)
        zs = []
        for w in (ws, None):
            k, v = np.zeros((H, D, T + 3), np.float32), np.zeros((H, T + 3, D), np.float32)
            zs.append(attention.attention_forward(qkv, k, v, 0, workspace=w, threads=2))
        assert np.array_equal(*zs)


# -- the Llama family's kernels ------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("C", [1, 7, 64, 203])
def test_rms_norm(rng, threads, C):
    x, g = f32(rng, 9, C, scale=3.0), f32(rng, C)
    scale = np.empty(9, dtype=np.float32)
    got = norm.rms_norm_forward(x, g, 1e-6, scale=scale, threads=threads)
    ref_scale = np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-6)
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-6)
    np.testing.assert_allclose(got, x / ref_scale[:, None] * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("F", [1, 15, 16, 100])
def test_swiglu(rng, F):
    h = f32(rng, 5, 2 * F, scale=4.0)
    h[0, :3] = [-np.inf, -200.0, 90.0] if F >= 3 else h[0, :3]
    got = activations.swiglu_forward(h, threads=2)
    gate, up = h[:, :F].astype(np.float64), h[:, F:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = np.where(gate == -np.inf, 0.0, gate / (1 + np.exp(-gate))) * up
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("H, G, D", [(4, 1, 8), (6, 2, 10), (3, 3, 16)])
def test_rope(rng, H, G, D):
    T, past, P = 5, 3, 16
    qkv = f32(rng, T, (H + 2 * G) * D)
    angles = np.arange(P)[:, None] * (10000.0 ** (-np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ref = qkv.astype(np.float64).copy()
    half = D // 2
    for t in range(T):
        c, s = cos[past + t], sin[past + t]
        for h in range(H + G):  # query and key heads turn; value heads do not
            v = ref[t, h * D:(h + 1) * D].copy()
            ref[t, h * D:h * D + half] = v[:half] * c - v[half:] * s
            ref[t, h * D + half:(h + 1) * D] = v[half:] * c + v[:half] * s
    got = attention.rope_forward(qkv.copy(), H, G, past, cos, sin, threads=2)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(got[:, (H + G) * D:], qkv[:, (H + G) * D:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("H, G, T, past", [(6, 2, 1, 5), (6, 2, 29, 0), (4, 1, 13, 3), (3, 3, 20, 0)])
def test_grouped_query_attention(rng, threads, H, G, T, past):
    D, cap = 12, 48
    qkv_all = f32(rng, past + T, (H + 2 * G) * D)
    k_cache = np.zeros((G, D, cap), dtype=np.float32)
    v_cache = np.zeros((G, cap, D), dtype=np.float32)
    if past:
        attention.attention_forward(qkv_all[:past], k_cache, v_cache, 0, n_head=H)
    pattern = np.empty((H, T, past + T), dtype=np.float32)
    got = attention.attention_forward(qkv_all[past:], k_cache, v_cache, past, n_head=H,
                                      pattern=pattern, threads=threads)
    x = qkv_all.astype(np.float64)
    q = x[:, :H * D].reshape(-1, H, D)
    k = x[:, H * D:(H + G) * D].reshape(-1, G, D)
    v = x[:, (H + G) * D:].reshape(-1, G, D)
    for h in range(H):
        g = h // (H // G)
        s = q[past:, h] @ k[:, g].T / math.sqrt(D)
        s = np.where(np.arange(past + T)[None, :] > np.arange(past, past + T)[:, None], -np.inf, s)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        np.testing.assert_allclose(pattern[h], p, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got[:, h * D:(h + 1) * D], p @ v[:, g], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [1, 2, 9])
def test_swiglu_mlp(rng, T):
    C, F = 24, 40
    x, W_in, W_out = f32(rng, T, C), f32(rng, C, 2 * F, scale=C ** -0.5), f32(rng, F, C, scale=F ** -0.5)
    got = mlp.mlp_forward(x, W_in, None, W_out, None, activation="swiglu", threads=2)
    h = x.astype(np.float64) @ W_in
    ref = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]) @ W_out
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
