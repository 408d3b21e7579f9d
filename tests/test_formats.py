"""Weights in fewer bytes (cyformer.formats): bfloat16, int8, int4, q8_0, q4_0.

Kernels against NumPy on the dequantized weights (float32 arithmetic, so 1e-4
relative), or, where decode multiplies int8 or bfloat16 activations, against
backends/numpy_ref's references of those kernels; the whole model's accuracy against float32 on
held-out standard-library code the bundled model was not trained on (bounds
from the issue, tightened to what was measured: see the constants); bitwise
equality across thread counts and between the fused decode step and the
per-op path; saving and loading back without conversion; bad saved files.
"""

import json
import os

import numpy as np
import pytest

import cyformer
from cyformer.formats import FORMATS, TABLE, Packed, dequantize, quantize
from cyformer.kernels import linalg, mlp

PACKED = ("bfloat16", "int8", "int4")  # q8_0 and q4_0 need inputs in whole blocks of 32: their own tests below
BLOCK = ("q8_0", "q4_0")  # GGUF's records, a row per output
RECORD = {"q8_0": 34, "q4_0": 18}  # bytes per block of 32 inputs


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K, N", [(96, 70), (33, 17), (64, 1), (1, 40)])
def test_quantize_round_trip(rng, fmt, transposed, K, N):
    W = rng.standard_normal((N, K) if transposed else (K, N)).astype(np.float32)
    p = quantize(W, fmt, transposed=transposed)
    assert isinstance(p, Packed) and p.shape == W.shape and not p.data.flags.writeable
    back = p.dequantize()
    # the error each format allows: bf16 keeps 8 bits of mantissa; int8 and
    # int4 are within half a step of their scale
    if fmt == "bfloat16":
        np.testing.assert_allclose(back, W, rtol=2 ** -8)
    else:
        out_axis = 0 if transposed else 1
        amax = np.abs(W).max(axis=1 - out_axis, keepdims=True)
        step = amax / (127 if fmt == "int8" else 7)
        if fmt == "int8":
            assert (np.abs(back - W) <= 0.5 * step * (1 + 1e-6) + 1e-7).all()
        else:  # groups of 32 inputs, each with the scale of least squared error among
            # max|w| / 6 .. 8.5: no worse than max|w| / 7 (half a step everywhere), and no
            # weight further off than half a step of max|w| / 6 or the clip at 7 / 8.5
            x = (W.T if transposed else W).astype(np.float64)              # [K, N]
            err = (back.T if transposed else back) - x
            for g0 in range(0, K, 32):
                wg, eg = x[g0:g0 + 32], err[g0:g0 + 32]
                gmax = np.abs(wg).max(axis=0)
                s7 = (gmax / 7).astype(np.float32).astype(np.float64)
                e7 = np.clip(np.rint(wg / np.where(s7 > 0, s7, 1)), -8, 7) * s7 - wg
                assert ((eg ** 2).sum(axis=0) <= (e7 ** 2).sum(axis=0) * (1 + 1e-6)).all()
                assert (np.abs(eg) <= gmax * max(0.5 / 6, 1 - 7 / 8.5) * (1 + 1e-6)).all()


def test_bfloat16_rounds_to_nearest_even_and_keeps_specials():
    w = np.array([[1.0, -2.5, np.inf, -np.inf, np.nan, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 0.0]], np.float32)
    back = quantize(w, "bfloat16").dequantize()
    assert back[0, 0] == 1.0 and back[0, 1] == -2.5 and back[0, 2] == np.inf and back[0, 3] == -np.inf
    assert np.isnan(back[0, 4])
    assert back[0, 5] == 1.0                      # a tie rounds to the even mantissa
    assert back[0, 6] == np.float32(1 + 2 ** -6)  # a tie rounds up to even
    assert back[0, 7] == 0.0


def _reference(w, fmt, transposed):
    """(data, scale) of int8 / int4 by the formula, on the whole matrix in
    float64: scale = max |w| / qmax (per output, or per output and group of
    32 inputs) in float32, code = rint(w / scale) clipped (w / 1 where the
    scale is 0 or NaN), int4 codes paired along the inputs as nibbles + 8;
    int8 and int4 codes (and int4's scales) a row per output whatever the
    orientation."""
    x = (w.T if transposed else w).astype(np.float64)  # [K, N]: outputs last
    K, N = x.shape
    if fmt == "int8":
        scale = (np.abs(x).max(axis=0) / 127).astype(np.float32)
        div = np.where(scale > 0, scale, 1).astype(np.float64)
        q = np.clip(np.rint(x / div), -127, 127).astype(np.int8)
        return np.ascontiguousarray(q.T), scale                            # a row per output (rows_out)
    ng = -(-K // 32)
    g = np.zeros((ng * 32, N))
    g[:K] = x
    g = g.reshape(ng, 32, N)
    scale, q = _int4_reference(g)
    q = q.reshape(ng * 32, N)[:K + K % 2]
    nib = (q + 8).astype(np.uint8)
    data = nib[0::2] | (nib[1::2] << 4)                                    # [K/2, N]
    return np.ascontiguousarray(data.T), np.ascontiguousarray(scale.T)     # a row per output (rows_out)


def _int4_reference(g):
    """int4 scales [ng, N] and codes [ng, 32, N] of groups g [ng, 32, N]
    (float64), one group at a time: of the scales max|w| / c for c = 6,
    6.25, .. 8.5 (float32), the first whose codes have the least squared
    error."""
    ng, _, N = g.shape
    scale, codes = np.zeros((ng, N), np.float32), np.zeros(g.shape)
    for a in range(ng):
        for n in range(N):
            w = g[a, :, n]
            best = None
            for c in 6 + 0.25 * np.arange(11):
                s = np.float32(np.abs(w).max() / c)
                q = np.clip(np.rint(w / (float(s) if s > 0 else 1.0)), -8, 7)
                err = np.sum((q * float(s) - w) ** 2)
                if best is None or err < best[0]:
                    best = (err, s, q)
            scale[a, n], codes[a, :, n] = best[1], best[2]
    return scale, codes


def _matrix(rng, kind, K, N, fmt):
    """[K, N] float32 (outputs last) of a kind that tests the rounding."""
    w = rng.standard_normal((K, N)).astype(np.float32)
    if kind == "ties" and fmt == "int8":  # w / scale exactly k + 1/2: scale 2^-4 from the max, rint ties to even
        w = ((rng.integers(-127, 127, size=(K, N)) + 0.5) / 16).astype(np.float32)
        w[::K] = 127 / 16  # each output's max
    elif kind == "ties":  # int4: most weights on the grid of 1/16 (so that its scale wins),
        # every eighth half a step off it
        w = rng.integers(-7, 8, size=(K, N)) / 16
        w[1::8] = (rng.integers(-7, 7, size=w[1::8].shape) + 0.5) / 16
        w[::32] = 7 / 16  # each group's max
        w = w.astype(np.float32)
    elif kind == "zeros":  # all-zero outputs, rows and groups; negative zeros
        w[:, ::3] = 0
        w[1::2] = -0.0
    elif kind == "special":  # NaN and infinities where they make whole outputs NaN
        w.flat[rng.integers(0, w.size, size=max(1, w.size // 16))] = np.nan
        w.flat[rng.integers(0, w.size, size=max(1, w.size // 16))] = np.inf
        w.flat[rng.integers(0, w.size, size=max(1, w.size // 16))] = -np.inf
    elif kind == "extremes":  # the largest and the smallest (subnormal) floats
        w *= np.float32(3e37) if N % 2 else np.float32(1e-40)
    return w


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "special", "extremes"])
@pytest.mark.parametrize("K, N", [(1, 1), (1, 40), (33, 17), (31, 5), (64, 3), (65, 9), (97, 130)])
@pytest.mark.parametrize("step", [64, 1 << 17])
def test_quantize_is_the_float64_formula_bitwise(rng, monkeypatch, kind, K, N, step):
    """Converting a step of rows at a time (as few as 64 weights, groups of
    32 rows where rows are int4 inputs) gives the codes and scales of the
    formula on the whole matrix, bit for bit, NaN and Inf included."""
    from cyformer import formats

    monkeypatch.setattr(formats, "STEP", step)
    for fmt in ("int8", "int4"):
        w = _matrix(rng, kind, K, N, fmt)
        for transposed in (False, True):
            W = np.ascontiguousarray(w.T) if transposed else w
            with np.errstate(invalid="ignore"):  # NaN / Inf casts and divisions, as the formula has them
                data, scale = _reference(W, fmt, transposed)
                p = quantize(W, fmt, transposed=transposed)
            assert p.data.dtype == data.dtype and p.scale.dtype == np.float32
            assert p.data.shape == data.shape and p.scale.shape == scale.shape
            assert p.data.tobytes() == data.tobytes(), (fmt, transposed)
            assert p.scale.tobytes() == scale.tobytes(), (fmt, transposed)
        if kind == "ties" and K >= 32:
            amax = np.abs(w).max(axis=0)[None, :] if fmt == "int8" else 7 / 16
            assert (np.abs(w / (amax / (127 if fmt == "int8" else 7))) % 1 == 0.5).any()  # ties were there
            if fmt == "int4":  # ... at the scales chosen
                chosen = np.repeat(quantize(w, "int4").scale.T, 32, axis=0)[:K]
                assert (np.abs(w / chosen) % 1 == 0.5).any()
    bf_step = quantize(W, "bfloat16", transposed=True).data.tobytes()
    monkeypatch.setattr(formats, "STEP", 1 << 30)  # bfloat16 in one step: the same bits
    assert quantize(W, "bfloat16", transposed=True).data.tobytes() == bf_step


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_temporaries_are_a_steps_not_the_matrix(rng, monkeypatch, fmt, transposed):
    """tracemalloc's peak while converting a 4 MB matrix, less the result:
    a few steps' float64 temporaries (8 bytes a weight; int4 steps with
    inputs as rows are at least a group of 32), not the matrix's."""
    import tracemalloc

    from cyformer import formats

    monkeypatch.setattr(formats, "STEP", 1 << 12)
    w = rng.standard_normal((4096, 250)).astype(np.float32)
    tracemalloc.start()
    try:
        p = quantize(w, fmt, transposed=transposed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - p.nbytes < w.nbytes / 8, f"{peak - p.nbytes} bytes of temporaries"


def _write_gpt2(path, rng, dtype, C=64, V=16384):
    """config.json + model.safetensors of a one-layer GPT-2 whose embedding
    (V x C) is far larger than any other tensor."""
    from safetensors.numpy import save_file

    cfg = dict(model_type="gpt2", n_layer=1, n_embd=C, n_head=2, vocab_size=V, n_positions=8, bos_token_id=0,
               eos_token_id=0)
    t = {"wte.weight": rng.standard_normal((V, C)), "wpe.weight": rng.standard_normal((8, C)),
         "ln_f.weight": np.ones(C), "ln_f.bias": np.zeros(C)}
    for n, shape in [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.c_attn.weight", (C, 3 * C)),
                     ("attn.c_attn.bias", (3 * C,)), ("attn.c_proj.weight", (C, C)), ("attn.c_proj.bias", (C,)),
                     ("ln_2.weight", (C,)), ("ln_2.bias", (C,)), ("mlp.c_fc.weight", (C, 4 * C)),
                     ("mlp.c_fc.bias", (4 * C,)), ("mlp.c_proj.weight", (4 * C, C)), ("mlp.c_proj.bias", (C,))]:
        t["h.0." + n] = rng.standard_normal(shape) / 8
    os.makedirs(path, exist_ok=True)
    save_file({k: v.astype(dtype) for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return t


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("src_dtype", [np.float32, np.float16])
def test_load_converts_from_the_file_a_step_at_a_time(tmp_path, rng, monkeypatch, fmt, src_dtype):
    """The loader converts each matrix as it reads it, a step of rows at a
    time: tracemalloc (which sees NumPy's heap, not the arena the weights
    live in) peaks far below the float32 embedding, and the result is what
    quantize gives on the whole float32 matrices."""
    import tracemalloc

    from cyformer import formats
    from cyformer.config import read_config
    from cyformer.weights import load_weights

    monkeypatch.setattr(formats, "STEP", 1 << 12)
    t = _write_gpt2(str(tmp_path), rng, src_dtype)
    cfg = read_config(str(tmp_path / "config.json"))
    tracemalloc.start()
    try:
        w = load_weights(str(tmp_path), cfg, dtype=fmt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    wte32 = t["wte.weight"].astype(src_dtype).astype(np.float32)
    assert peak < wte32.nbytes / 8, f"{peak} bytes traced while loading a {wte32.nbytes}-byte embedding"
    for got, src, transposed in [(w.wte, wte32, True),
                                 (w.blocks[0].c_fc.weight, t["h.0.mlp.c_fc.weight"], False),
                                 (w.blocks[0].mlp_c_proj.weight, t["h.0.mlp.c_proj.weight"], False)]:
        want = quantize(src.astype(src_dtype).astype(np.float32), formats.matrix_format(fmt, transposed),
                        transposed=transposed)
        assert got.data.tobytes() == want.data.tobytes()
        assert (got.scale is None) == (want.scale is None)
        assert got.scale is None or got.scale.tobytes() == want.scale.tobytes()
        assert not got.data.flags.writeable


def _int8_reference(x, p):
    """x [T, K] times an int8 Packed (data a row per output in either
    orientation) as the kernels sum it: decode (T < 4) in 16 lanes a row of
    W (q8_matvec_t), the integer GEMM in row blocks of 64 (q8_matvec)."""
    from cyformer.backends.numpy_ref import q8_matvec, q8_matvec_t
    if len(x) < 4:
        return np.stack([q8_matvec_t(r, p.data, p.scale) for r in x])
    return np.stack([q8_matvec(r, p.data.T, p.scale, 64) for r in x])


def _int4_product_reference(x, p):
    """x [T, K] times an int4 Packed (data and scales a row per output in
    either orientation) as the kernels sum it: decode (T < 4) in 16 lanes
    per 128 inputs (q4_matvec_t), the integer GEMM in row blocks of 64
    (q4_matvec of the transposed codes and scales)."""
    from cyformer.backends.numpy_ref import q4_matvec, q4_matvec_t
    if len(x) < 4:
        return np.stack([q4_matvec_t(r, p.data, p.scale) for r in x])
    return np.stack([q4_matvec(r, p.data.T, p.scale.T, 64) for r in x])


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 30])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_numpy_on_dequantized_weights(rng, fmt, transposed, T, threads):
    K, N = 200, 150
    W = rng.standard_normal((N, K) if transposed else (K, N)).astype(np.float32) / np.sqrt(K)
    p = quantize(W, fmt, transposed=transposed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    Wd = p.dequantize().astype(np.float64)
    ref = x.astype(np.float64) @ (Wd.T if transposed else Wd) + b
    got = linalg.linear_forward(x, p, b, w_transposed=transposed, threads=threads)
    if fmt == "int8":  # int8 activations, either orientation (a row per output)
        ref = _int8_reference(x, p).astype(np.float64) + b
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)  # the bias added (maybe fused) after
    elif fmt == "int4":  # the same, int4's references
        ref = _int4_product_reference(x, p).astype(np.float64) + b
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    elif fmt == "bfloat16" and T < 4 and linalg.select_format_kernels()["avx512_bf16"]:
        # matrix-vector with AVX512-BF16: bf16 activations, vdpbf16ps, a row per output either way
        from cyformer.backends.numpy_ref import bf16dp_dot_t
        ref = np.stack([bf16dp_dot_t(r, p.data) for r in x]).astype(np.float64) + b
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    elif fmt == "bfloat16" and linalg.prefill_gemm(fmt) == "bfloat16":  # its GEMM: bf16 activations too
        from cyformer.backends.numpy_ref import bf16dp_gemm
        ref = bf16dp_gemm(x, p.data, 64, transposed=True).astype(np.float64) + b
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    again = linalg.linear_forward(x, p, b, w_transposed=transposed, threads=3 - threads)
    assert np.array_equal(got, again), "thread counts differ"


@pytest.mark.parametrize("fmt", PACKED)
def test_mlp_and_embedding_take_packed_weights(rng, fmt):
    C, F, V = 64, 96, 50
    x = rng.standard_normal((5, C)).astype(np.float32)
    W_in = quantize(rng.standard_normal((C, 2 * F)).astype(np.float32) / 8, fmt)
    W_out = quantize(rng.standard_normal((F, C)).astype(np.float32) / 10, fmt)
    got = mlp.mlp_forward(x, W_in, None, W_out, None, activation="swiglu")
    if fmt in ("int8", "int4"):  # int8 activations: each product is the q8 reference's
        def prod(a, W):
            return (_int8_reference if fmt == "int8" else _int4_product_reference)(a, W).astype(np.float64)
        h = prod(x, W_in)
        post = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]).astype(np.float32)
        # a hidden value a rounding away from a code's half step may take the
        # neighbouring code: one step of its block (amax / 127) times a weight
        ref = prod(post, W_out)
        atol = 2 * np.abs(post).max() / 127 * np.abs(dequantize(W_out)).max()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol)
    elif linalg.prefill_gemm(fmt) == "bfloat16":  # 5 rows: the bfloat16 GEMM, bf16 activations
        from cyformer.backends.numpy_ref import bf16dp_gemm
        h = bf16dp_gemm(x, W_in.data, 64, transposed=True).astype(np.float64)
        post = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]).astype(np.float32)
        # a hidden value a rounding away from a bf16 tie may take the
        # neighbouring bf16 value: one step (2^-8 of it) times a weight
        ref = bf16dp_gemm(post, W_out.data, 64, transposed=True)
        atol = 2 * 2.0 ** -8 * np.abs(post).max() * np.abs(dequantize(W_out)).max()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=atol)
    else:
        h = x.astype(np.float64) @ dequantize(W_in)
        ref = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]) @ dequantize(W_out)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    wte = quantize(rng.standard_normal((V, C)).astype(np.float32), fmt, transposed=True)
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(linalg.embedding(ids, wte, None), dequantize(wte)[ids])


def test_packed_arguments_are_checked(rng):
    W = quantize(rng.standard_normal((32, 8)).astype(np.float32), "int8")
    x = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match="stored"):
        linalg.linear_forward(x, W, w_transposed=True)
    with pytest.raises(ValueError, match="inputs"):
        linalg.linear_forward(np.ones((2, 31), np.float32), W)
    bad = Packed("int8", W.data, W.scale[:-1].copy(), W.shape, False)
    with pytest.raises(ValueError, match="scale"):
        linalg.linear_forward(x, bad)
    bad = Packed("int4", W.data, W.scale, W.shape, False)
    with pytest.raises(ValueError, match="int4 data"):
        linalg.linear_forward(x, bad)
    bad = Packed("int9", W.data, W.scale, W.shape, False)
    with pytest.raises(ValueError, match="Packed"):
        linalg.linear_forward(x, bad)


# -- whole models -------------------------------------------------------------

def held_out_ids(model, n=3072, exact=True):
    """Token ids of held-out standard-library modules: whole files the bundled
    model never saw in training, read as the corpus pipeline reads them
    (train/heldout.tsv, train/corpus.py).  The files come from this Python's
    standard library; with exact, a test is skipped unless they are the
    texts listed (their sha256), on which the accuracy bounds were measured
    (another Python's modules differ)."""
    import hashlib
    import sys

    from helpers import TRAIN, load_train_module

    corpus = load_train_module("corpus")
    text = ""
    for key, sha, _, _ in corpus.read_heldout_listing(os.path.join(TRAIN, "heldout.tsv")):
        if key.startswith("stdlib/") and len(text) <= 4 * n:
            part = corpus.read_text(corpus.path_of(key, None))
            if exact and hashlib.sha256(part.encode("utf-8")).hexdigest() != sha:
                pytest.skip(f"held-out text: Python {sys.version_info.major}.{sys.version_info.minor}'s {key} "
                            f"is not the text in train/heldout.tsv, on which the bounds were measured")
            text += part
    return np.array(model.encode(text)[:n])


def perplexity_and_top1(model, ids):
    P = model.config.n_positions
    nll, n, top = 0.0, 0, []
    for s in range(0, len(ids) - 1, P - 1):
        w = ids[s:s + P]
        if len(w) < 2:
            break
        lg = model.forward(w).astype(np.float64)
        lp = lg - lg.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        nll -= lp[np.arange(len(w) - 1), w[1:]].sum()
        n += len(w) - 1
        top.append(lg[:-1].argmax(1))
    return float(np.exp(nll / n)), np.concatenate(top)


# relative perplexity change and top-1 agreement with float32 allowed, per
# format: the bounds (bf16 0.3 % / 99.5 %, int8 1 % / 98 %, int4 6 % /
# 90 %), tightened where the bundled model measured better (on these 3072
# tokens: bf16 +0.025 %, 99.87 % with bf16 activations in prefill (AVX512-BF16;
# widened to float32 -0.003 %, 99.80 %); int8 +0.16 %, 98.24 %; int4, its embedding
# in int8 and its group scales searched, +0.97 %, 92.41 %).  int8 and int4
# prefill multiplies int8 activations as decode does (float activations had
# int8 +0.15 %, 98.80 %, int4 +0.99 %, 92.38 %): int8's agreement bound is
# the 98 %.  q8_0 and q4_0 (its embedding in q8_0) likewise, where
# the CPU has the integer GEMM (VNNI): q8_0 +0.21 %, 98.34 %, q4_0 +0.91 %,
# 93.03 % (widening their records to float32: +0.04 %, 99.09 %; +0.88 %,
# 93.16 %), int8's and int4's perplexity bounds, q8_0's agreement the issue's 98 %.
BOUNDS = {"bfloat16": (0.003, 0.995), "int8": (0.003, 0.98), "int4": (0.015, 0.915), "q8_0": (0.003, 0.98),
          "q4_0": (0.015, 0.925)}


@pytest.fixture(scope="module")
def float32_reference():
    m = cyformer.load(threads=2)
    ids = held_out_ids(m)
    return ids, perplexity_and_top1(m, ids)


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
def test_accuracy_on_held_out_code(float32_reference, fmt):
    ids, (ppl32, top32) = float32_reference
    model = cyformer.load(threads=2, dtype=fmt)
    assert model.dtype == fmt
    ppl, top = perplexity_and_top1(model, ids)
    max_rel, min_agree = BOUNDS[fmt]
    assert abs(ppl / ppl32 - 1) <= max_rel, f"{fmt}: perplexity {ppl:.3f} vs float32 {ppl32:.3f}"
    assert (top == top32).mean() >= min_agree


def decode_perplexity_and_top1(model, ids):
    """perplexity_and_top1 through one-token decode steps (the matrix-vector
    kernels: int8 weights there multiply int8 activations)."""
    P, be = model.config.n_positions, model.backend
    nll, n, top = 0.0, 0, []
    for s in range(0, len(ids) - 1, P - 1):
        w = ids[s:s + P]
        if len(w) < 2:
            break
        kv = be.new_cache(P)
        lg = np.stack([np.asarray(be.run(w[t:t + 1], kv, True))[-1] for t in range(len(w) - 1)])
        lg = lg.astype(np.float64)
        lp = lg - lg.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        nll -= lp[np.arange(len(w) - 1), w[1:]].sum()
        n += len(w) - 1
        top.append(lg.argmax(1))
    return float(np.exp(nll / n)), np.concatenate(top)


# The same through decode, where int8 and int4 matrices (the unembedding
# included) take int8 activations: measured int8 +0.16 %, 98.24 % top-1
# agreement (float activations: +0.15 %, 98.80 %; a float unembedding: +0.09 %,
# 98.44 %), int4 +0.97 %, 92.41 % (+0.99 %, 92.38 %; +0.98 %, 92.38 %);
# int8's agreement bound is the issue's 98 %, the rest as in BOUNDS.
# bfloat16 with AVX512-BF16 takes bf16 activations: +0.025 %, 99.87 % (float
# activations, the widening kernels: -0.003 %, 99.80 %).  q8_0 (int8
# activations against its records in every matrix): +0.18 %, 98.24 %, its
# agreement bound the 98 %.  q4_0: +0.90 %, 93.03 %.
DECODE_BOUNDS = {"bfloat16": (0.003, 0.995), "int8": (0.003, 0.98), "int4": (0.015, 0.915),
                 "q8_0": (0.003, 0.98), "q4_0": (0.015, 0.925)}


@pytest.mark.parametrize("fmt", sorted(DECODE_BOUNDS))
def test_decode_accuracy_on_held_out_code(float32_reference, fmt):
    ids, (ppl32, top32) = float32_reference
    model = cyformer.load(threads=2, dtype=fmt)
    ppl, top = decode_perplexity_and_top1(model, ids)
    max_rel, min_agree = DECODE_BOUNDS[fmt]
    assert abs(ppl / ppl32 - 1) <= max_rel, f"{fmt}: decode perplexity {ppl:.3f} vs float32 {ppl32:.3f}"
    assert (top == top32).mean() >= min_agree


@pytest.mark.parametrize("fmt", PACKED + BLOCK)
def test_decode_bitwise_at_any_thread_count_and_equal_to_per_op(fmt):
    outs = []
    for threads in (1, 2, 3):
        m = cyformer.load(threads=threads, dtype=fmt)
        be = m.backend
        kv, ref = be.new_cache(32), be.new_cache(32)
        be.run(np.arange(7), kv)
        be.run(np.arange(7), ref)
        steps = []
        for t in (5, 9, 200, 3):
            fused = be.run(np.array([t]), kv)
            past = ref.length
            resid = be.embed(np.array([t]), past, threads)
            for block in be.blocks:
                block(resid, ref, past, threads)
            ref.length = past + 1
            assert np.array_equal(fused, be.unembed(be.ln_f(resid, threads), threads))
            steps.append(fused)
        outs.append(np.concatenate(steps))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_llama_family_in_every_format(tmp_path, rng):
    from helpers import make_hf_llama

    make_hf_llama(str(tmp_path), "qwen2", seed=3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=120, max_position_embeddings=32,
                  tie_word_embeddings=False)
    ids = rng.integers(0, 120, size=20)
    ref = cyformer.load(tmp_path).forward(ids)
    errs = {}
    for fmt in PACKED + BLOCK:
        m = cyformer.load(tmp_path, dtype=fmt)
        got = m.forward(ids)
        if linalg.prefill_gemm(fmt) == "float32":
            # prefill on the dequantized weights, in float32: what the format computes
            exact = cyformer.Model(m.config, m.float_weights).forward(ids)
        else:  # int8 / bf16 activations in prefill and decode alike: the logits of one-token steps
            be, kv = m.backend, m.backend.new_cache(len(ids))
            exact = np.stack([np.asarray(be.run(ids[t:t + 1], kv, True))[-1] for t in range(len(ids))])
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
        errs[fmt] = float(np.abs(got - ref).max())
        g = m.generate(ids[:4].tolist(), max_new_tokens=6)
        assert len(g) == 6
    assert errs["bfloat16"] < errs["int8"] < errs["int4"] and errs["q8_0"] < errs["int4"]
    assert errs["q8_0"] < errs["q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_and_load_without_conversion(tmp_path, fmt):
    m = cyformer.load(dtype=fmt)
    ids = m.encode("def add(a, b):\n    return a + b\n")
    out = m.save(tmp_path / "saved")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["cyformer_dtype"] == fmt
    again = cyformer.load(out)
    assert again.dtype == fmt
    assert np.array_equal(again.forward(ids), m.forward(ids))
    assert (again.generate("x = ", max_new_tokens=8, temperature=0)
            == m.generate("x = ", max_new_tokens=8, temperature=0))
    if fmt != "float32":
        with pytest.raises(cyformer.ModelLoadError, match="saved as"):
            cyformer.load(out, dtype="float32" if fmt != "float32" else "int8")


def _edit_saved(path, edit):
    p = os.path.join(path, "model.safetensors")
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(p, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_saved_before_rows_out_still_loads(tmp_path, fmt):
    """A file written when int8 or bfloat16 block matrices were stored
    [K, N] (no cyformer.rows_out key) loads as today's a-row-per-output
    arrays, the same model bit for bit."""
    from cyformer.saving import write_safetensors
    from cyformer.weights import SAVED_ROWS_OUT_KEY, TRANSPOSED

    m = cyformer.load(dtype=fmt)
    storage = np.dtype(TABLE[fmt].storage)
    out = m.save(tmp_path / "new")
    p = os.path.join(out, "model.safetensors")
    with open(p, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        body = f.read()
    meta = header.pop("__metadata__")
    assert meta[SAVED_ROWS_OUT_KEY].split(",") == [n for n, f in TABLE.items() if f.rows_out]
    del meta[SAVED_ROWS_OUT_KEY]
    dtypes = {"F32": np.float32, "BF16": np.uint16, "I8": np.int8, "U8": np.uint8}
    tensors = {n: np.frombuffer(body[h["data_offsets"][0]:h["data_offsets"][1]], dtypes[h["dtype"]]).reshape(h["shape"])
               for n, h in header.items()}
    old = {n: (np.ascontiguousarray(a.T) if a.dtype == storage and n not in TRANSPOSED else a)
           for n, a in tensors.items()}
    assert sum(a.dtype == storage and n not in TRANSPOSED for n, a in old.items()) == 4 * m.config.n_layer
    write_safetensors(p, old, meta)
    again = cyformer.load(out)
    w = again.weights.blocks[0].c_fc.weight
    assert w.data.shape == (w.shape[1], w.shape[0]) and w.data.flags.c_contiguous
    ids = np.arange(1, 40)
    assert np.array_equal(again.forward(ids), m.forward(ids))


@pytest.mark.parametrize("key", [None, "int8,q8_0,q4_0"])
def test_int4_saved_before_rows_out_still_loads(tmp_path, key):
    """A file written when int4 block matrices were stored [K, N] (pairs
    [K/2, N], group scales [K/32, N]): without the cyformer.rows_out key,
    or with the key of the files written between int8's switch and int4's,
    it loads as today's a-row-per-output arrays, the same model bit for bit."""
    from safetensors.numpy import load_file

    from cyformer.saving import write_safetensors
    from cyformer.weights import SAVED_ROWS_OUT_KEY, TRANSPOSED

    m = cyformer.load(dtype="int4")
    out = m.save(tmp_path / "new")
    p = os.path.join(out, "model.safetensors")
    with open(p, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    assert "int4" in meta[SAVED_ROWS_OUT_KEY].split(",")
    if key is None:
        del meta[SAVED_ROWS_OUT_KEY]
    else:
        meta[SAVED_ROWS_OUT_KEY] = key
    tensors = load_file(p)

    def block_int4(n):
        base = n[:-len(".scale")] if n.endswith(".scale") else n
        return base not in TRANSPOSED and (tensors[base].dtype == np.uint8)

    old = {n: (np.ascontiguousarray(a.T) if block_int4(n) else a) for n, a in tensors.items()}
    assert sum(block_int4(n) for n in old) == 2 * 4 * m.config.n_layer  # data and scales of 4 matrices a block
    write_safetensors(p, old, meta)
    again = cyformer.load(out)
    w = again.weights.blocks[0].c_fc.weight
    assert w.data.shape == (w.shape[1], -(-w.shape[0] // 2)) and w.data.flags.c_contiguous
    assert w.scale.shape == (w.shape[1], -(-w.shape[0] // 32)) and w.scale.flags.c_contiguous
    ids = np.arange(1, 40)
    assert np.array_equal(again.forward(ids), m.forward(ids))


def test_int4_keeps_the_embedding_in_int8(tmp_path):
    m = cyformer.load(dtype="int4")
    assert m.dtype == "int4" and m.weights.wte.fmt == "int8" and m.weights.wte.transposed
    assert all(b.c_fc.weight.fmt == "int4" for b in m.weights.blocks)
    again = cyformer.load(m.save(tmp_path / "m"))
    assert again.dtype == "int4" and again.weights.wte.fmt == "int8"
    ids = np.arange(1, 40)
    assert np.array_equal(again.forward(ids), m.forward(ids))


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["__metadata__"].update({"cyformer.format": "int3"}), "unknown weight format"),
    (lambda h: h["__metadata__"].update({"cyformer.group": "64"}), "groups of 64"),
    (lambda h: h.pop("blocks.0.attn.c_attn.weight.scale"), "missing tensor 'blocks.0.attn.c_attn.weight.scale'"),
    (lambda h: h["blocks.1.mlp.c_fc.weight.scale"].update(shape=[3, 7]), "c_fc.weight.scale"),
    (lambda h: h["wte"].update(dtype="U8"), "tensor 'wte'"),
])
def test_bad_saved_files_are_refused(tmp_path, edit, match):
    out = cyformer.load(dtype="int4").save(tmp_path / "m")
    _edit_saved(out, edit)
    with pytest.raises(cyformer.ModelLoadError, match=match):
        cyformer.load(out)


@pytest.mark.parametrize("fmt", BLOCK)
def test_block_format_saved_with_a_non_finite_scale_is_refused(tmp_path, fmt):
    out = cyformer.load(dtype=fmt).save(tmp_path / "m")
    p = os.path.join(out, "model.safetensors")
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        begin = json.loads(f.read(n))["blocks.1.mlp.c_fc.weight"]["data_offsets"][0]
    with open(p, "r+b") as f:
        f.seek(8 + n + begin + RECORD[fmt] * 3)
        f.write(b"\x00\x7e")  # a NaN fp16 scale
    with pytest.raises(cyformer.ModelLoadError, match="c_fc.weight.*NaN or Inf block scales"):
        cyformer.load(out)


def test_weight_views_and_hooks_on_packed_weights():
    from cyformer.interp import logit_lens

    m = cyformer.load(dtype="int8")
    head = m.blocks[1].attn.heads[2]
    assert head.W_Q.dtype == np.float32 and head.W_O.shape == (64, 256)
    assert m.unembed[5].dtype == np.float32
    ids = m.encode("import os\n")
    logits, cache = m.run_with_cache(ids)
    assert np.array_equal(logits, m.forward(ids))
    np.testing.assert_allclose(cache["hook_embed"], m.float_weights.wte[ids])
    lens = logit_lens(m, ids, k=2)
    assert np.array_equal(lens.top_ids[-1, :, 0], logits.argmax(-1))


def test_load_refuses_unknown_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        cyformer.load(dtype="fp8")


def test_the_format_table_drives_options_saving_and_info():
    # every format is one record: --dtype's choices, the saved tags and
    # build_info come from formats.TABLE, and each record has its kernels' row
    from cyformer import cli, formats, saving

    import argparse

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    choices = {tuple(a.choices) for p in subs.choices.values() for a in p._actions if a.dest == "dtype"}
    assert formats.FORMATS in choices                                       # load --dtype
    assert any(c[:len(formats.PACKED)] == formats.PACKED for c in choices)  # quantize (+ GGUF's types)
    assert set(saving.TAGS.values()) == {f.tag for f in formats.TABLE.values()}
    info = cyformer.build_info()["formats"]
    assert list(info) == list(formats.FORMATS)
    assert all(info[name]["kernels"] for name in info)
    for name in formats.PACKED:
        f = formats.TABLE[name]
        p = quantize(np.ones((64, 8), np.float32), name)
        assert p.data.dtype == f.storage and p.nbytes <= 64 * 8 * f.bytes_per_weight + 64 * 4


# -- int8 weights times int8 activations (decode): every kernel variant this
# CPU runs, bit for bit against backends/numpy_ref's q8_* references --------

def _int8_variants():
    from cyformer import _runtime
    from cyformer.kernels import LEVEL
    out = [{"avx512_vnni": False, "avx2": False}]
    if _runtime.x86_level() < 3:
        print("int8 AVX2 kernels not tested: this CPU has no AVX2")
    else:
        out.append({"avx512_vnni": False, "avx2": True})
    if not _runtime.cpu_features()["avx512_vnni"]:
        print("int8 AVX512-VNNI kernels not tested: this CPU has no avx512_vnni")
    elif not linalg.select_format_kernels({"avx512_vnni": True})["avx512_vnni"]:
        print(f"int8 AVX512-VNNI kernels not tested: kernel level {LEVEL} has none")
    else:
        out.append({"avx512_vnni": True})
    # AVX-VNNI's kernels (int4 decode, every integer GEMM): on AVX-VNNI, and
    # in AVX512-VNNI's encoding of the same instruction where the CPU has that
    have = linalg._cpu_features()
    if have["avx_vnni"]:
        out.append({"avx2": True, "avx_vnni": True})
    else:
        print("int8 AVX-VNNI kernels not tested on AVX-VNNI: this CPU has none")
    if have["avx_vnni_evex"]:
        out.append({"avx2": True, "avx_vnni_evex": True})
    else:
        print("int8 AVX-VNNI kernels not tested in AVX512-VNNI's encoding: this CPU has no AVX512-VNNI")
    linalg.select_format_kernels()
    return out


def _gemm_variants():
    # the integer GEMM's variants: _int8_variants', and with AVX512-VNNI the
    # AMX tile, on the instructions where the CPU has them (and the OS grants
    # their state), and always on amx.h's C model of them
    out = _int8_variants()
    have = linalg._cpu_features()
    if any(v.get("avx512_vnni") for v in out):
        if have["amx_int8"]:
            out.append({"avx512_vnni": True, "amx_int8": True})
        else:
            print("AMX integer GEMM not tested on AMX: this CPU (or its OS) has no amx_int8; its C model is")
        out.append({"avx512_vnni": True, "amx_model": True})
    else:
        print("AMX integer GEMM not tested: its tile needs the AVX512-VNNI kernels")
    return out


INT8_VARIANTS = _int8_variants()
GEMM_VARIANTS = _gemm_variants()


def _variant_id(v):
    if v.get("amx_int8") or v.get("amx_model"):
        return "amx" if v.get("amx_int8") else "amx-model"
    if v.get("avx_vnni") or v.get("avx_vnni_evex"):
        return "avxvnni" if v.get("avx_vnni") else "avxvnni-evex"
    return "vnni" if v.get("avx512_vnni") else "avx2" if v.get("avx2") else "generic"


@pytest.fixture
def int8_variant(request):
    yield request.param
    linalg.select_format_kernels()  # back to this CPU's best


def test_q8_activation_rule():
    from cyformer.backends.numpy_ref import q8_activations
    x = np.zeros(70, np.float32)
    x[:4] = [127.0, 0.5, -0.5, 1.5]     # d = 1: rint ties to even
    x[32:34] = [np.nan, 1.0]            # a block with a NaN: d NaN, codes 0
    q, d = q8_activations(x)
    assert q.shape == (3, 32) and d.dtype == np.float32
    assert list(q[0, :4]) == [127, 0, 0, 2] and d[0] == 1.0
    assert np.isnan(d[1]) and not q[1].any()
    assert d[2] == 0 and not q[2].any()  # all zeros (and the zero padding past 70)
    # a block whose max|x| is so small that 1 / d overflows float32: its codes
    # are still x / d rounded, and larger blocks' codes are unchanged
    t = np.zeros(64, np.float32)
    t[:4] = [1e-38, 5e-39, -1e-38, 3e-40]
    t[32:36] = [1e-30, 2.5e-31, -7e-31, 0.0]
    q, d = q8_activations(t)
    assert np.isfinite(d).all() and d[0] > 0 and np.isinf(np.float32(1) / d[0])
    assert list(q[0, :4]) == [127, 63, -127, 4] and not q[0, 4:].any()  # 5e-39 / d = 63.4998
    assert list(q[1, :4]) == [127, 32, -89, 0]
    np.testing.assert_allclose(q[0, :4] * d[0].astype(np.float64), t[:4], rtol=0, atol=0.5 * float(d[0]) * 1.01)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True, ids=_variant_id)
@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0"])
def test_tiny_activation_blocks_are_quantized_as_the_reference(rng, int8_variant, fmt):
    # rows whose blocks have max|x| below 3.7e-37 (1 / d overflows float32):
    # decode, the batched rows and prefill give the references' bits, finite
    from cyformer.backends.numpy_ref import q4_matvec_t, q8_0_matvec, q4_0_matvec, q8_matvec_t
    linalg.select_format_kernels(int8_variant)
    K, N = 256, 40
    W = quantize(rng.standard_normal((N, K)).astype(np.float32), fmt, transposed=True)
    x = rng.standard_normal((6, K)).astype(np.float32)
    x[0] *= 1e-38
    x[1, :100] *= 1e-39
    x[2, 32:64] = 2e-45  # the least denormal, a whole block of it
    ref = {"int8": lambda r: q8_matvec_t(r, W.data, W.scale), "int4": lambda r: q4_matvec_t(r, W.data, W.scale),
           "q8_0": lambda r: q8_0_matvec(r, W.data), "q4_0": lambda r: q4_0_matvec(r, W.data)}[fmt]
    want = np.stack([ref(r) for r in x])
    assert np.isfinite(want).all()
    got = linalg.linear_forward(x[:1], W, w_transposed=True)
    np.testing.assert_array_equal(got.view(np.uint32), want[:1].view(np.uint32))
    got = linalg.matvec_rows(x, W, w_transposed=True)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    big = linalg.linear_forward(x, W, w_transposed=True)  # prefill
    assert np.isfinite(big).all()
    exact = x.astype(np.float64) @ W.dequantize().T.astype(np.float64)
    for b, w, e in zip(big, want, exact):
        if linalg.integer_gemm(fmt):  # the same products in another float order: a few ulps of the largest
            np.testing.assert_allclose(b, w, rtol=0, atol=1e-5 * np.abs(w).max())
        else:  # float32 activations: within the int8 activations' error of decode
            np.testing.assert_allclose(b, e, rtol=0, atol=1e-5 * np.abs(e).max())
            np.testing.assert_allclose(w, e, rtol=0, atol=0.05 * np.abs(e).max())


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (33, 17), (64, 64), (96, 70), (200, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int8_matvec_is_the_q8_reference(rng, int8_variant, K, N, threads):
    """A block matrix W [K, N] holds its int8 codes a row per output
    (rows_out), so decode runs the unembedding's kernels on it: each row of
    x against numpy_ref.q8_matvec_t bit for bit."""
    from cyformer.backends.numpy_ref import q8_matvec_t
    linalg.select_format_kernels(int8_variant)
    W = quantize(rng.standard_normal((K, N)).astype(np.float32), "int8")
    assert W.data.shape == (N, K) and W.data.flags.c_contiguous
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3  # blocks of very different scales
    for T in (1, 2, 3):
        got = linalg.linear_forward(x[:T], W, threads=threads)
        for t in range(T):
            want = q8_matvec_t(x[t], W.data, W.scale)
            np.testing.assert_array_equal(got[t].view(np.uint32), want.view(np.uint32))
        # and within the bounds of float arithmetic on the dequantized weights
        np.testing.assert_allclose(got, x[:T] @ W.dequantize(), rtol=0.05, atol=0.05 * np.sqrt(K))


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (33, 17), (64, 64), (95, 70), (200, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int4_matvec_is_the_q8_reference(rng, int8_variant, K, N, threads):
    """A block matrix W [K, N] holds its int4 codes and group scales a row
    per output (rows_out), so decode runs the [N, K] kernels on it: each row
    of x against numpy_ref.q4_matvec_t bit for bit, alone and as the
    batched step's rows."""
    from cyformer.backends.numpy_ref import q4_matvec_t
    linalg.select_format_kernels(int8_variant)
    W = quantize(rng.standard_normal((K, N)).astype(np.float32), "int4")
    assert W.data.shape == (N, -(-K // 2)) and W.scale.shape == (N, -(-K // 32)) and W.data.flags.c_contiguous
    x = rng.standard_normal((7, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3
    want = np.stack([q4_matvec_t(r, W.data, W.scale) for r in x])
    for T in (1, 2, 3):
        got = linalg.linear_forward(x[:T], W, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want[:T].view(np.uint32))
    got = linalg.matvec_rows(x, W, threads=threads)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(want, x @ W.dequantize(), rtol=0.05, atol=0.05 * np.sqrt(K))


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (31, 9), (33, 17), (64, 64), (96, 70), (130, 129), (200, 33), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int8_unembedding_is_the_q8_reference(rng, int8_variant, K, N, threads):
    """W [N, K] stored a row per output (the unembedding): each row of x,
    quantized as for [K, N], against numpy_ref.q8_matvec_t bit for bit."""
    from cyformer.backends.numpy_ref import q8_matvec_t
    linalg.select_format_kernels(int8_variant)
    Wf = rng.standard_normal((N, K)).astype(np.float32)
    Wf[N // 2] = 0  # a zero row
    W = quantize(Wf, "int8", transposed=True)
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3
    for T in (1, 2, 3):
        got = linalg.linear_forward(x[:T], W, w_transposed=True, threads=threads)
        for t in range(T):
            want = q8_matvec_t(x[t], W.data, W.scale)
            np.testing.assert_array_equal(got[t].view(np.uint32), want.view(np.uint32))
        assert not got[:, N // 2].any()
        np.testing.assert_allclose(got, x[:T] @ W.dequantize().T, rtol=0.05, atol=0.05 * np.sqrt(K))


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (31, 9), (33, 17), (64, 64), (95, 70), (127, 10), (130, 129), (200, 33),
                                  (257, 6), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int4_rows_out_matvec_is_the_q4_reference(rng, int8_variant, K, N, threads):
    """int4 W [N, K] stored a row per output: each row of x, quantized as for
    int8, against numpy_ref.q4_matvec_t bit for bit, one row at a time
    (dot_t) and as the batched step's rows (dot_t_rows: 6, 7 and 13 rows
    leave 2, 3 and 1 past the tiles of 4 rows of x)."""
    from cyformer.backends.numpy_ref import q4_matvec_t
    linalg.select_format_kernels(int8_variant)
    Wf = rng.standard_normal((N, K)).astype(np.float32)
    Wf[N // 2] = 0                   # a zero row
    Wf[N - 1, :min(K, 45)] *= 1e-36  # tiny group scales: d * scale below float32's normal range
    W = quantize(Wf, "int4", transposed=True)
    x = rng.standard_normal((13, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3        # blocks of very different scales
    x[4] = 0.0                       # d = 0
    want = np.stack([q4_matvec_t(r, W.data, W.scale) for r in x])
    for T in (1, 2, 3):
        got = linalg.linear_forward(x[:T], W, w_transposed=True, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want[:T].view(np.uint32))
    for B in (6, 7, 13):
        got = linalg.matvec_rows(x[:B], W, w_transposed=True, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want[:B].view(np.uint32))
    assert not want[:, N // 2].any() and not want[4].any()
    # int8 activations: each input within half a code step of its block's max|x| / 127
    np.testing.assert_allclose(want, x.astype(np.float64) @ W.dequantize().T, rtol=0.05, atol=0.05 * np.sqrt(K))


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
def test_int4_rows_out_non_finite_activations_give_nan(int8_variant):
    # a NaN or infinity anywhere (a full chunk of 128 inputs, the last,
    # partial one, an odd K's last input) makes every output NaN
    from cyformer.backends.numpy_ref import q4_matvec_t
    linalg.select_format_kernels(int8_variant)
    W = quantize(np.ones((40, 301), np.float32), "int4", transposed=True)
    for bad, at in ((np.nan, 5), (np.inf, 270), (-np.inf, 300)):
        x = np.ones((6, 301), np.float32)
        x[:, at] = bad
        assert np.isnan(q4_matvec_t(x[0], W.data, W.scale)).all()
        assert np.isnan(linalg.linear_forward(x[:1], W, w_transposed=True)).all()
        assert np.isnan(linalg.matvec_rows(x, W, w_transposed=True)).all()


def test_amx_tiles_are_never_chosen_on_their_model_and_agree_with_every_tile():
    # the C model of AMX runs only when asked for; the AMX tile on it gives
    # the bits of the VNNI tile and of the generic integer loops, and the
    # check leaves this CPU's default kernels in place
    default = linalg.select_format_kernels()
    assert not default["amx_model"]
    before = linalg.format_kernels()
    have = linalg._cpu_features()
    if not (have["avx512_vnni"] and have["amx_model"]):
        pytest.skip("the AMX tile is built with the AVX512-VNNI kernels; this CPU or kernel level has none")
    amx = {"avx512_vnni": True, "amx_model": True}
    assert linalg.integer_tiles_agree(amx)
    # (GGUF's records have no integer GEMM on the generic kernels)
    assert linalg.integer_tiles_agree(amx, reference={"avx512_vnni": False, "avx2": False}, formats=("int8", "int4"))
    assert linalg.format_kernels() == before
    try:
        assert linalg.select_format_kernels(amx)["amx_model"]
        assert "AMX" in linalg.format_kernels()["int8"] and linalg.prefill_gemm("q4_0") == "int8"
    finally:
        linalg.select_format_kernels()
    if have["amx_int8"]:  # the instructions themselves, where they run
        assert linalg.integer_tiles_agree({"avx512_vnni": True, "amx_int8": True})
        assert default["amx_int8"] == linalg._AMX_DEFAULT["amx_int8"], "AMX-INT8: not the default choice"
    # the bfloat16 tile: its model gives numpy_ref.bf16amx_gemm's bits (tdpbf16ps as the hardware sums)
    if have["avx512_bf16"]:
        assert linalg.bf16_tile_matches_reference({"avx512_bf16": True, "amx_model": True})
        assert linalg.bf16_tile_matches_reference({"avx512_bf16": True})
        if have["amx_bf16"]:
            assert linalg.bf16_tile_matches_reference({"avx512_bf16": True, "amx_bf16": True})
            assert default["amx_bf16"], "AMX-BF16 runs here but was not chosen: it failed the check at import"
    assert linalg.format_kernels() == before


def test_tdpbf16ps_model_gives_the_bits_recorded_on_an_amx_cpu():
    # one full-shape tdpbf16ps per case, recorded on an Intel Xeon with AMX
    # (Sapphire Rapids class): normal values, values over a wide range, one
    # pair per output, denormal inputs and sums, cancelling products; c zero
    # and not.  The model is what every machine without AMX tests the
    # bfloat16 tile on, so it must give the hardware's bits (the instruction
    # reference's pseudocode differs in about half of these outputs).
    data = np.load(os.path.join(os.path.dirname(__file__), "data", "tdpbf16ps_sapphire_rapids.npz"))
    assert len(data["out"]) == 8
    for a, b, c, want in zip(data["a"], data["b"], data["c"], data["out"]):
        got = linalg.amx_tdpbf16ps_model(a, b, c)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match=r"needs a \[16, 32\]"):
        linalg.amx_tdpbf16ps_model(data["a"][0][:8], data["b"][0], data["c"][0])


@pytest.mark.parametrize("int8_variant", GEMM_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("K, N", [(1, 5), (33, 17), (64, 64), (95, 70), (200, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_integer_gemm_rows_are_the_matvec_rows(rng, int8_variant, fmt, K, N, threads):
    # prefill (T >= 4 rows: the integer GEMM) sums each row as the q8
    # reference's row blocks do.  int8 and int4 decode a row per output in
    # lanes (q8_matvec_t, q4_matvec_t): the same integer products, the float
    # sums in another order, within a few roundings.
    from cyformer.backends.numpy_ref import q4_matvec, q8_matvec
    linalg.select_format_kernels(int8_variant)
    W = quantize(rng.standard_normal((K, N)).astype(np.float32), fmt)
    x = rng.standard_normal((23, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3  # blocks of very different scales
    x[5] = 0.0                 # d = 0
    if fmt == "int8":
        want = np.stack([q8_matvec(r, W.data.T, W.scale, 64) for r in x])  # linalg's GEMV_ROWS
    else:
        want = np.stack([q4_matvec(r, W.data.T, W.scale.T, 64) for r in x])
    for T in (4, 7, 23):  # tiles of 6 rows (AMX: 16): one part-filled, one full and part-filled, several
        got = linalg.linear_forward(x[:T], W, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want[:T].view(np.uint32))
        for t in (0, T - 1):
            one = linalg.linear_forward(x[t:t + 1], W, threads=threads)
            # float32 sums of up to K terms of either order: a few ulps of the largest
            np.testing.assert_allclose(got[t], one[0], rtol=0, atol=1e-5 * np.abs(one[0]).max() + 1e-30)


@pytest.mark.parametrize("int8_variant", GEMM_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("K, N", [(32, 5), (96, 70), (256, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_records_gemm_is_the_grouped_reference(rng, int8_variant, fmt, K, N, threads):
    # prefill of GGUF's records: with VNNI, AVX-VNNI or AVX2 the integer
    # GEMM, int4's grouped tile over the records' codes and fp16 scales, bit
    # for bit numpy_ref.records_gemm_row; on the generic kernels the float panels
    from cyformer.backends.numpy_ref import records_gemm_row
    linalg.select_format_kernels(int8_variant)
    integer = _variant_id(int8_variant) != "generic"
    assert linalg.integer_gemm(fmt) == integer
    W = quantize(rng.standard_normal((K, N)).astype(np.float32), fmt)
    x = rng.standard_normal((23, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3  # blocks of very different scales
    x[5] = 0.0                 # d = 0
    x[9, 3] = np.nan           # spoils its own row only
    for T in (4, 7, 23):
        got = linalg.linear_forward(x[:T], W, threads=threads)
        if integer:
            want = np.stack([records_gemm_row(r, fmt, W.data, 64) for r in x[:T]])  # linalg's GEMV_ROWS
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        ok = np.isfinite(x[:T]).all(axis=1)
        assert np.isnan(got[~ok]).all()
        exact = x[:T][ok].astype(np.float64) @ W.dequantize()
        if integer:  # int8 activations: each input off by up to half a code step (max|x| / 254)
            np.testing.assert_allclose(got[ok], exact, rtol=0.05, atol=0.05 * np.sqrt(K))
        else:
            np.testing.assert_allclose(got[ok], exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("int8_variant", GEMM_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_gemm_at_the_integer_limits(rng, int8_variant, fmt):
    # weights at their extreme codes (int8 -128 and 127, int4 -8 and 7)
    # against activation codes of +-127 with the same or opposite signs:
    # every 16-bit pair sum (and int4's per-block 16-bit sums in the AVX2
    # tile) at its bound, still exact
    from cyformer.backends.numpy_ref import q4_matvec, q8_matvec
    linalg.select_format_kernels(int8_variant)
    K, N = 96, 70
    hi = rng.random((K, N)) < 0.5
    if fmt == "int8":  # codes a row per output
        W = Packed("int8", np.ascontiguousarray(np.where(hi, 127, -128).astype(np.int8).T),
                   np.full(N, 0.01, np.float32), (K, N), False)
        W.data[:10] = -128
    else:  # nibbles w + 8, pairs and group scales a row per output
        codes = np.where(hi, 15, 0).astype(np.uint8)
        codes[:, :10] = 0
        W = Packed("int4", np.ascontiguousarray((codes[0::2] | (codes[1::2] << 4)).T),
                   np.ascontiguousarray(rng.uniform(0.5, 2, (N, K // 32)).astype(np.float32)), (K, N), False)
    x = np.where(rng.random((9, K)) < 0.5, 1.0, -1.0).astype(np.float32)
    x[0] = 1.0
    x[1] = -1.0
    if fmt == "int8":
        want = np.stack([q8_matvec(r, W.data.T, W.scale, 64) for r in x])
    else:
        want = np.stack([q4_matvec(r, W.data.T, W.scale.T, 64) for r in x])
    got = linalg.linear_forward(x, W)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(got[:2, :10], np.broadcast_to(
        np.array([[1.0], [-1.0]]) * W.dequantize()[:, :10].sum(0), (2, 10)), rtol=1e-5)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
def test_int8_unembedding_non_finite_activations_give_nan(int8_variant):
    from cyformer.backends.numpy_ref import q8_matvec_t
    linalg.select_format_kernels(int8_variant)
    W = quantize(np.ones((40, 100), np.float32), "int8", transposed=True)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((1, 100), np.float32)
        x[0, 70] = bad  # in the last, partial pair of blocks
        got = linalg.linear_forward(x, W, w_transposed=True)
        assert np.isnan(got).all() and np.isnan(q8_matvec_t(x[0], W.data, W.scale)).all()


@pytest.fixture(scope="module")
def ragged_checkpoint(tmp_path_factory):
    """GPT-2 with C = 96 (3 blocks of 32), d_mlp = 195 (an odd K, a partial
    block; 3 full 64-column strips and 3 columns more) and V = 203."""
    from helpers import make_hf_checkpoint
    path = str(tmp_path_factory.mktemp("ragged"))
    make_hf_checkpoint(path, seed=5, n_layer=1, n_embd=96, n_head=3, vocab_size=203, n_positions=32, n_inner=195)
    return path


@pytest.mark.parametrize("int8_variant", GEMM_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("dtype, model", [(d, m) for d in ("int8", "int4") for m in ("bundled", "ragged")]
                         + [(d, "bundled") for d in BLOCK])  # q8_0, q4_0 need whole blocks of 32 inputs
def test_batched_step_every_int8_variant(rng, ragged_checkpoint, int8_variant, dtype, model):
    """The batched decode step (the [K, N] matrices' gemv_block_rows, the
    unembedding's dot_t_rows; q8_0's dot_t_rows everywhere) on every variant
    this CPU runs: each row bitwise its sequence's own step.  6, 7 and 13
    rows leave 2, 3 and 1 rows of x past the tiles of 4."""
    linalg.select_format_kernels(int8_variant)
    be = cyformer.load(None if model == "bundled" else ragged_checkpoint, threads=2, dtype=dtype).backend
    V = be.config.vocab_size
    for n_seq in (6, 7, 13):
        lens = rng.integers(1, 12, size=n_seq)
        alone, together = [], []
        for n in lens:
            prompt = rng.integers(0, V, size=n)
            a, b = be.new_cache(n + 2), be.new_cache(n + 2)
            be.run(prompt, a)
            be.run(prompt, b)
            alone.append(a)
            together.append(b)
        tokens = rng.integers(0, V, size=n_seq)
        want = np.concatenate([be.run(np.array([t]), kv) for t, kv in zip(tokens, alone)])
        got = be.step.batch(tokens, [kv.k for kv in together], [kv.v for kv in together],
                            [kv.length for kv in together], threads=2)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (33, 17), (95, 70), (200, 129)])
@pytest.mark.parametrize("threads", [1, 2])
def test_integer_gemm_of_int8_unembedding(rng, int8_variant, K, N, threads):
    # W [N, K] (a row per output) packs into the same strips: q8_matvec's
    # sums bit for bit; decode's dot_t adds the same integer sums in another
    # order (numpy_ref.q8_matvec_t), so they agree to float rounding
    from cyformer.backends.numpy_ref import q8_matvec, q8_matvec_t
    linalg.select_format_kernels(int8_variant)
    W = quantize(rng.standard_normal((N, K)).astype(np.float32), "int8", transposed=True)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[4, :min(K, 40)] *= 1e-3
    got = linalg.linear_forward(x, W, w_transposed=True, threads=threads)
    want = np.stack([q8_matvec(r, np.ascontiguousarray(W.data.T), W.scale, 64) for r in x])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    one = np.stack([linalg.linear_forward(x[t:t + 1], W, w_transposed=True)[0] for t in range(9)])
    np.testing.assert_array_equal(one, np.stack([q8_matvec_t(r, W.data, W.scale) for r in x]))
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6 * np.abs(one).max())


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(1, 5), (33, 17), (95, 70), (127, 33), (200, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_integer_gemm_of_int4_rows_out(rng, int8_variant, K, N, threads):
    # int4 W [N, K] (a row per output) unpacks into the strips of [K, N]:
    # every row of the product bit for bit q4_matvec's sums of the
    # transposed codes and scales (the grouped tile, as [K, N]); decode's
    # dot_t adds the same integer sums in another order
    # (numpy_ref.q4_matvec_t), so they agree to float rounding
    from cyformer.backends.numpy_ref import q4_matvec, q4_matvec_t
    linalg.select_format_kernels(int8_variant)
    assert linalg.integer_gemm("int4")
    W = quantize(rng.standard_normal((N, K)).astype(np.float32), "int4", transposed=True)
    x = rng.standard_normal((23, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3  # blocks of very different scales
    x[5] = 0.0                 # d = 0
    x[9, K // 2] = np.nan      # spoils its own row only
    data, scale = np.ascontiguousarray(W.data.T), np.ascontiguousarray(W.scale.T)
    want = np.stack([q4_matvec(r, data, scale, 64) for r in x])  # linalg's GEMV_ROWS
    for T in (4, 7, 23):  # tiles of 6 rows (AMX: 16): one part-filled, one full and part-filled, several
        got = linalg.linear_forward(x[:T], W, w_transposed=True, threads=threads)
        np.testing.assert_array_equal(got.view(np.uint32), want[:T].view(np.uint32))
    assert np.isnan(got[9]).all() and np.isfinite(np.delete(got, 9, axis=0)).all()
    one = np.stack([q4_matvec_t(r, W.data, W.scale) for r in x])
    ok = np.isfinite(x).all(axis=1)
    np.testing.assert_allclose(got[ok], one[ok], rtol=1e-5, atol=1e-6 * np.abs(one[ok]).max())


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_gemm_epilogue_and_non_finite_rows(rng, int8_variant, fmt):
    # bias, activation and accumulate as a GEMM of that row alone applies
    # them (decode sums in another order); a NaN or infinity spoils its own
    # row only
    linalg.select_format_kernels(int8_variant)
    K, N = 130, 200
    W = quantize(rng.standard_normal((K, N)).astype(np.float32) / 8, fmt)
    b = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[3, 100] = np.nan
    x[7, 0] = -np.inf
    for kw in ({"activation": "gelu_new"}, {"activation": "gelu"}, {"accumulate": True}):
        base = rng.standard_normal((9, N)).astype(np.float32)
        got = linalg.linear_forward(x, W, b, out=base.copy() if "accumulate" in kw else None, threads=2, **kw)
        for t in range(9):
            one = linalg.linear_forward(np.repeat(x[t:t + 1], 4, axis=0), W, b, threads=2, **kw,  # 4 rows: the GEMM
                                        out=np.repeat(base[t:t + 1], 4, axis=0) if "accumulate" in kw else None)
            np.testing.assert_array_equal(got[t].view(np.uint32), one[0].view(np.uint32))
    assert np.isnan(got[[3, 7]]).all() and np.isfinite(np.delete(got, [3, 7], axis=0)).all()


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
def test_int8_matvec_non_finite_activations_give_nan(int8_variant):
    linalg.select_format_kernels(int8_variant)
    W = quantize(np.ones((64, 40), np.float32), "int8")
    x = np.ones((1, 64), np.float32)
    x[0, 40] = np.inf
    assert np.isnan(linalg.linear_forward(x, W)).all()


# -- bfloat16 weights times bfloat16 activations (decode): with AVX512-BF16,
# vdpbf16ps, bit for bit against backends/numpy_ref's bf16dp_* references;
# without it (or with it turned off), the weights widened to float32 ----------

def _bf16_variants():
    from cyformer import _runtime
    from cyformer.kernels import LEVEL
    out = [{"avx512_bf16": False}]
    if not _runtime.cpu_features()["avx512_bf16"]:
        print("bfloat16 AVX512-BF16 kernels not tested: this CPU has no avx512_bf16")
    elif not linalg.select_format_kernels({"avx512_bf16": True})["avx512_bf16"]:
        print(f"bfloat16 AVX512-BF16 kernels not tested: kernel level {LEVEL} has none")
    else:
        out.append({"avx512_bf16": True})
    linalg.select_format_kernels()
    return out


BF16_VARIANTS = _bf16_variants()


def _bf16_gemm_variants():
    # the bfloat16 GEMM's variants: BF16_VARIANTS, and with AVX512-BF16 the
    # AMX tile, on the instructions where the CPU has them (and the OS grants
    # their state), and always on amx.h's C model of them
    out = list(BF16_VARIANTS)
    have = linalg._cpu_features()
    if not any(v["avx512_bf16"] for v in out):
        print("bfloat16 AMX GEMM not tested: its tile is built with the AVX512-BF16 kernels")
        return out
    if have["amx_bf16"]:
        out.append({"avx512_bf16": True, "amx_bf16": True})
    else:
        print("bfloat16 AMX GEMM not tested on AMX: this CPU (or its OS) has no amx_bf16; its C model is")
    if have["amx_model"]:
        out.append({"avx512_bf16": True, "amx_model": True})
    return out


BF16_GEMM_VARIANTS = _bf16_gemm_variants()


def _bf16_gemm_ref(x, codes):
    # the reference of the bfloat16 GEMM selected now: tdpbf16ps's order on
    # AMX, vdpbf16ps's elsewhere; 64: linalg's GEMV_ROWS
    from cyformer.backends.numpy_ref import bf16amx_gemm, bf16dp_gemm
    amx = "AMX" in linalg.format_kernels()["bfloat16"]
    return (bf16amx_gemm if amx else bf16dp_gemm)(x, codes, 64, transposed=True)


@pytest.fixture
def bf16_variant(request):
    linalg.select_format_kernels(request.param)
    yield request.param["avx512_bf16"]
    linalg.select_format_kernels()  # back to this CPU's best


def _bf16_ids(v):
    if v.get("amx_bf16") or v.get("amx_model"):
        return "amx" if v.get("amx_bf16") else "amx-model"
    return "vdpbf16ps" if v["avx512_bf16"] else "widened"


def _assert_same_bits(got, want):
    """Equal bits, NaNs equal as NaNs (their payloads are the hardware's)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(np.where(nan, 0, got).view(np.uint32), np.where(nan, 0, want).view(np.uint32))


def _bf16_error_bound(bf16_activations, K):
    """|x . w - float64 x . w| <= this times |x| . |w| (w the bf16 weights):
    K float32 roundings of the running sum, plus, with bf16 activations, x's
    rounding to 8 significant bits (relative 2^-8 at most)."""
    return K * 2.0 ** -24 + (2.0 ** -8 if bf16_activations else 0.0)


def _bf16_special_inputs(rng, T, K):
    """T (<= 3) rows of x: normal values; one tiny row (|x| about 2^-124, so
    products and sums cross float32's least normal 2^-126 and are flushed,
    every third input a bf16 denormal, read as zero); one with an infinity."""
    x = rng.standard_normal((T, K)).astype(np.float32)
    if T > 1:
        x[1] *= np.float32(2.0 ** -124)
        x[1, ::3] = np.float32(2.0 ** -130)
    if T > 2:
        x[2, K // 2] = np.inf
    return x


def _bf16_weights(rng, shape, transposed=False):
    """bfloat16 weights, normal but for one input's row of bf16 denormals"""
    w = rng.standard_normal(shape).astype(np.float32)
    if transposed:
        w[:, 0] *= np.float32(2.0 ** -130)
    else:
        w[0] *= np.float32(2.0 ** -130)
    return quantize(w, "bfloat16", transposed=transposed)


def test_bf16dp_reference_rules():
    """vdpbf16ps's rules (Intel's pseudo-code) as the reference states them:
    bf16-denormal inputs count as zero, denormal results are flushed to
    zero, x is rounded to bf16 first, NaN and infinity propagate."""
    from cyformer.backends.numpy_ref import bf16dp_dot_t, bf16dp_matvec
    from cyformer.formats import _bfloat16
    one = _bfloat16(np.ones((1, 1), np.float32))
    tiny = np.float32(2.0 ** -130)  # a float32 and bf16 denormal
    assert bf16dp_matvec(np.array([tiny]), one, 64)[0] == 0
    w = _bfloat16(np.full((1, 1), 2.0 ** -70, np.float32))
    assert bf16dp_matvec(np.array([2.0 ** -70], np.float32), w, 64)[0] == 0  # 2^-140 is denormal: flushed
    assert bf16dp_matvec(np.array([1 + 2.0 ** -9], np.float32), one, 64)[0] == 1  # x rounds to bf16 (tie: even)
    x = np.array([1.0, np.inf, 2.0], np.float32)
    assert np.isinf(bf16dp_dot_t(x, _bfloat16(np.ones((1, 3), np.float32))))[0]
    assert np.isnan(bf16dp_dot_t(np.array([np.nan], np.float32), one))[0]


@pytest.mark.parametrize("bf16_variant", BF16_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("K, N", [(1, 5), (2, 33), (33, 17), (64, 64), (95, 70), (200, 129), (768, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bfloat16_matvec(rng, bf16_variant, K, N, threads):
    """x [T < 4, K] @ W [K, N], its bf16 codes stored a row per output
    (rows_out), so decode runs dot_t: vdpbf16ps bitwise the reference at
    any thread count; either variant within bfloat16's rounding of the
    float64 product."""
    from cyformer.backends.numpy_ref import bf16dp_dot_t
    W = _bf16_weights(rng, (K, N))
    assert W.data.shape == (N, K)
    x = _bf16_special_inputs(rng, 3, K)
    got = linalg.linear_forward(x, W, threads=threads)
    if bf16_variant:
        for t in range(3):
            _assert_same_bits(got[t], bf16dp_dot_t(x[t], W.data))
    ref = x[0].astype(np.float64) @ W.dequantize()
    scale = np.abs(x[0]).astype(np.float64) @ np.abs(W.dequantize())
    assert (np.abs(got[0] - ref) <= _bf16_error_bound(bf16_variant, K) * scale + 1e-6).all()


@pytest.mark.parametrize("bf16_variant", BF16_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("K, N", [(1, 5), (31, 17), (33, 70), (64, 3), (95, 129), (768, 1030)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bfloat16_matvec_transposed(rng, bf16_variant, K, N, threads):
    """x [T < 4, K] @ W.T, W [N, K] (the unembedding's dot_t; N = 1030 spans
    several work items), as test_bfloat16_matvec."""
    from cyformer.backends.numpy_ref import bf16dp_dot_t
    W = _bf16_weights(rng, (N, K), transposed=True)
    x = _bf16_special_inputs(rng, 3, K)
    got = linalg.linear_forward(x, W, w_transposed=True, threads=threads)
    if bf16_variant:
        for t in range(3):
            _assert_same_bits(got[t], bf16dp_dot_t(x[t], W.data))
    ref = W.dequantize().astype(np.float64) @ x[0]
    scale = np.abs(W.dequantize()).astype(np.float64) @ np.abs(x[0])
    assert (np.abs(got[0] - ref) <= _bf16_error_bound(bf16_variant, K) * scale + 1e-6).all()


@pytest.mark.parametrize("bf16_variant", BF16_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("transposed", [False, True])
def test_bfloat16_matvec_nan_input_gives_nan(bf16_variant, transposed):
    W = quantize(np.ones((40, 70), np.float32), "bfloat16", transposed=transposed)
    x = np.ones((1, 70 if transposed else 40), np.float32)
    x[0, 33] = np.nan
    assert np.isnan(linalg.linear_forward(x, W, w_transposed=transposed)).all()


@pytest.mark.parametrize("bf16_variant", BF16_VARIANTS, indirect=True, ids=_bf16_ids)
def test_bfloat16_decode_same_at_every_thread_count_and_batched(bf16_variant):
    """The bundled model in bfloat16 through the fused step: the same logits
    at 1, 2 and 3 threads, and 7 sequences in one batched step (the rows
    kernels, each weight loaded once for all of them) bitwise each alone."""
    outs = []
    for threads in (1, 2, 3):
        be = cyformer.load(threads=threads, dtype="bfloat16").backend
        kv = be.new_cache(32)
        be.run(np.arange(7), kv)
        outs.append(np.concatenate([be.run(np.array([t]), kv) for t in (5, 9, 200, 3)]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    lens = [3, 17, 1, 9, 30, 2, 5]
    caches = [be.new_cache(n + 1) for n in lens]
    for n, kv in enumerate(caches):
        be.run(np.arange(lens[n]) % 200, kv)
    tokens = np.array([5, 9, 200, 3, 7, 1, 0])
    got = be.step.batch(tokens, [kv.k for kv in caches], [kv.v for kv in caches], [kv.length for kv in caches],
                        threads=2)
    for n, kv in enumerate(caches):
        assert np.array_equal(got[n], be.run(tokens[n:n + 1], kv)[0])
# -- the bfloat16 GEMM (prefill, 4 or more rows): with AVX512-BF16, bf16
# activations and vdpbf16ps on pair-interleaved strips (bgemm.h), bit for bit
# backends/numpy_ref's bf16dp_gemm (AMX's tdpbf16ps: bf16amx_gemm); without
# it, float32 panels ----------------------------------------------------------

@pytest.mark.parametrize("bf16_variant", BF16_GEMM_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("T, K, N", [(4, 1, 5), (7, 31, 70), (23, 33, 129), (4, 64, 32), (23, 95, 200),
                                     (19, 99, 45), (7, 768, 300), (600, 95, 161)])
def test_bfloat16_gemm(rng, bf16_variant, transposed, T, K, N):
    """x [T, K] @ W, W [K, N] or [N, K] (K odd, K < 32, N no multiple of a
    strip's 32 outputs): vdpbf16ps bitwise the reference, the same bits at
    1, 2 and 3 threads, and (either variant) within bfloat16's rounding of
    the float64 product with the bf16 weights: |err| <= (K 2^-24 + 2^-8)
    |x| . |w| + 1e-6 (2^-8 bounds x's rounding to bf16; 1e-6 covers the
    flushed tiny row, checked bitwise above), and a normal row allclose to
    x @ W at atol 0.02 sqrt(K), about 10x x's rounding for unit x and w."""
    assert linalg.prefill_gemm("bfloat16", transposed) == ("bfloat16" if bf16_variant else "float32")
    W = _bf16_weights(rng, (N, K) if transposed else (K, N), transposed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[1] *= np.float32(2.0 ** -124)  # products and sums below float32's least normal: flushed
    x[1, ::3] = np.float32(2.0 ** -130)  # bf16 denormals, read as zero
    x[1, 1::5] = np.uint32(0x007FFFFF).view(np.float32)  # a float32 denormal that rounds up to a normal bf16
    got = [linalg.linear_forward(x, W, w_transposed=transposed, threads=n) for n in (1, 2, 3)]
    assert all(np.array_equal(got[0], g) for g in got[1:]), "thread counts differ"
    if bf16_variant:
        _assert_same_bits(got[0], _bf16_gemm_ref(x, W.data))
    Wd = W.dequantize().astype(np.float64)
    Wd = Wd.T if transposed else Wd
    ref = x.astype(np.float64) @ Wd
    scale = np.abs(x).astype(np.float64) @ np.abs(Wd)
    assert (np.abs(got[0] - ref) <= _bf16_error_bound(bf16_variant, K) * scale + 1e-6).all()
    np.testing.assert_allclose(got[0][0], ref[0], rtol=2e-2, atol=2e-2 * np.sqrt(K))


@pytest.mark.parametrize("bf16_variant", BF16_GEMM_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
def test_bfloat16_gemm_rows_are_decode_rows_and_epilogue(rng, bf16_variant, transposed):
    """Each row of the GEMM is the matrix-vector path's row up to the order
    of float32 additions (decode sums 16 lanes a row, the GEMM runs of 64
    inputs); the epilogue (bias, GELU, accumulate) is applied to the
    finished sums as in float32."""
    K, N, T = 130, 97, 9
    W = _bf16_weights(rng, (N, K) if transposed else (K, N), transposed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    got = linalg.linear_forward(x, W, b, w_transposed=transposed)
    rows = np.concatenate([linalg.linear_forward(x[t:t + 1], W, b, w_transposed=transposed) for t in range(T)])
    Wd = np.abs(W.dequantize().astype(np.float64))
    scale = np.abs(x).astype(np.float64) @ (Wd.T if transposed else Wd)
    assert (np.abs(got - rows) <= 2 * K * 2.0 ** -24 * scale + 1e-6).all()
    out = rng.standard_normal((T, N)).astype(np.float32)
    acc = out.copy()
    linalg.linear_forward(x, W, b, out=acc, w_transposed=transposed, accumulate=True)
    assert np.array_equal(acc, out + got)
    gelu = linalg.linear_forward(x, W, b, w_transposed=transposed, activation="gelu_new")
    np.testing.assert_allclose(gelu, 0.5 * got * (1 + np.tanh(0.7978845608 * (got + 0.044715 * got ** 3))),
                               rtol=1e-5, atol=1e-6)
    if bf16_variant:
        _assert_same_bits(got, _bf16_gemm_ref(x, W.data) + b)


@pytest.mark.parametrize("bf16_variant", BF16_GEMM_VARIANTS, indirect=True, ids=_bf16_ids)
@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
def test_bfloat16_gemm_non_finite_row_spoils_only_that_row(rng, bf16_variant, transposed):
    K, N, T = 70, 90, 23
    W = _bf16_weights(rng, (N, K) if transposed else (K, N), transposed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    clean = linalg.linear_forward(x, W, w_transposed=transposed, threads=2)
    x[5, 17], x[16, 40] = np.nan, np.inf
    got = linalg.linear_forward(x, W, w_transposed=transposed, threads=2)
    assert np.isnan(got[5]).all()
    assert not np.isfinite(got[16]).any()
    keep = np.setdiff1d(np.arange(T), [5, 16])
    assert np.array_equal(got[keep], clean[keep])


def test_prefill_gemm_names_what_runs():
    """linalg.prefill_gemm agrees with the format rows' kernels text."""
    kernels = linalg.format_kernels()
    for name in ("float32", "bfloat16", "int8", "int4"):
        what = linalg.prefill_gemm(name)
        assert what in ("int8", "bfloat16", "float32")
        assert (what == "int8") == linalg.integer_gemm(name)
        if what == "bfloat16":
            assert "prefill" in kernels[name] and "vdpbf16ps" in kernels[name]
    assert linalg.prefill_gemm("float32") == "float32"
    with pytest.raises(ValueError, match="float16"):
        linalg.prefill_gemm("float16")


# -- q8_0, q4_0: GGUF's Q8_0 and Q4_0 records as weight formats ------------------

def _q8_0_matrix(rng, K, N, transposed=False):
    W = rng.standard_normal((N, K) if transposed else (K, N)).astype(np.float32)
    (W.T if transposed else W)[:32, 0] = 0           # an all-zero block: d = 0
    (W.T if transposed else W)[32:64, 0] *= 1e-6     # a block of very small weights
    return W


@pytest.mark.parametrize("fmt", BLOCK)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K, N", [(32, 1), (64, 17), (96, 70), (768, 5)])
def test_block_records_are_ggml_s(rng, fmt, transposed, K, N):
    """load(dtype="q8_0" / "q4_0") converts as ggml's quantize_row_q8_0_ref /
    quantize_row_q4_0_ref do (the gguf package's reference): the same
    records, bit for bit, a row per output whatever the orientation, and a
    step of rows at a time."""
    gguf = pytest.importorskip("gguf", reason="the gguf package holds ggml's reference quantizer")
    W = _q8_0_matrix(rng, K, N, transposed)
    W[W.shape[0] // 2, 1 % W.shape[1]] = 0.5  # ties are rounded half away from zero
    (W.T if transposed else W)[64:96, N - 1] = -(W.T if transposed else W)[64:96, N - 1]  # max negative
    p = quantize(W, fmt, transposed=transposed)
    rows_out = np.ascontiguousarray(W if transposed else W.T)          # [N, K]
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    want = gguf.quants.quantize(rows_out, qtype)
    assert p.shape == W.shape and p.data.shape == (N, K // 32 * RECORD[fmt]) and p.scale is None
    np.testing.assert_array_equal(p.data, want)
    back = gguf.quants.dequantize(want, qtype)
    np.testing.assert_array_equal(p.dequantize(), back if transposed else back.T)


def test_four_bit_models_keep_the_vocabulary_one_step_up():
    """int4 and q4_0 models hold the [V, C] embedding / unembedding in int8
    and q8_0 (the rows' vocab), every other matrix in the 4-bit format."""
    from cyformer.formats import matrix_format
    assert [matrix_format(f, True) for f in FORMATS] == ["float32", "bfloat16", "int8", "int8", "q8_0", "q8_0"]
    assert [matrix_format(f, False) for f in FORMATS] == list(FORMATS)
    w = cyformer.load(dtype="q4_0").weights
    assert w.wte.fmt == "q8_0" and w.blocks[0].c_fc.weight.fmt == "q4_0"


@pytest.mark.parametrize("fmt", BLOCK)
def test_block_formats_need_whole_blocks_of_inputs(fmt):
    for shape, transposed in (((33, 8), False), ((8, 40), True)):
        with pytest.raises(ValueError, match=f"{fmt}.*whole blocks of 32"):
            quantize(np.ones(shape, np.float32), fmt, transposed=transposed)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("K, N", [(32, 1), (64, 15), (64, 64), (96, 70), (768, 300), (480, 33), (256, 1000)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fmt", BLOCK)
def test_block_matvec_is_the_reference(rng, int8_variant, K, N, threads, transposed, fmt):
    """Decode (fewer than 4 rows): int8 activations against the records,
    bit for bit numpy_ref.q8_0_matvec / q4_0_matvec, at every thread count,
    whichever orientation the matrix has (the data is a row per output
    either way); 16 blocks at a time in the VNNI kernel, whose last chunk
    may hold 8 or fewer (768: 24 blocks) or more (480: 15)."""
    from cyformer.backends import numpy_ref
    q8_0_matvec = getattr(numpy_ref, f"{fmt}_matvec")
    linalg.select_format_kernels(int8_variant)
    W = _q8_0_matrix(rng, K, N, transposed)
    p = quantize(W, fmt, transposed=transposed)
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[2, :min(K, 40)] *= 1e-3  # blocks of very different scales
    b = rng.standard_normal(N).astype(np.float32)
    for T in (1, 2, 3):
        got = linalg.linear_forward(x[:T], p, w_transposed=transposed, threads=threads)
        for t in range(T):
            want = q8_0_matvec(x[t], p.data)
            np.testing.assert_array_equal(got[t].view(np.uint32), want.view(np.uint32))
        # int8 activations: each block's x within half a step of max|x| / 127
        np.testing.assert_allclose(got, x[:T] @ (p.dequantize().T if transposed else p.dequantize()),
                                   rtol=0.05, atol=0.05 * np.sqrt(K))
    got = linalg.linear_forward(x[:1], p, b, w_transposed=transposed, threads=threads)
    np.testing.assert_allclose(got[0], q8_0_matvec(x[0], p.data) + b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True,
                         ids=_variant_id)
@pytest.mark.parametrize("fmt", BLOCK)
def test_block_matvec_non_finite_activations_give_nan(int8_variant, fmt):
    linalg.select_format_kernels(int8_variant)
    p = quantize(np.ones((64, 40), np.float32), fmt)
    x = np.ones((1, 64), np.float32)
    x[0, 40] = np.inf
    assert np.isnan(linalg.linear_forward(x, p)).all()


@pytest.mark.parametrize("T", [4, 7, 30, 70])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", BLOCK)
def test_block_prefill_mlp_and_embedding(rng, T, threads, fmt):
    """Four rows and more go through the GEMM: with this CPU's integer GEMM
    (linalg.integer_gemm) the records times int8 activations, each row
    numpy_ref.records_gemm_row's bits; otherwise panels of the records
    widened to float32 (d * q), the dequantized matrix's product within
    float32 summation order.  The MLP and the embedding lookup take the
    matrices too (the lookup exactly the dequantized rows)."""
    from cyformer.backends.numpy_ref import records_gemm_row
    C, F, V = 64, 96, 50
    integer = linalg.integer_gemm(fmt)

    def prod(a, W):
        if integer:
            return np.stack([records_gemm_row(r, fmt, W.data, 64) for r in a]).astype(np.float64)
        return a.astype(np.float64) @ dequantize(W)

    W = quantize(rng.standard_normal((C, F)).astype(np.float32) / 8, fmt)
    x = rng.standard_normal((T, C)).astype(np.float32)
    got = linalg.linear_forward(x, W, threads=threads)
    if integer:
        np.testing.assert_array_equal(got, prod(x, W).astype(np.float32))
    else:
        np.testing.assert_allclose(got, prod(x, W), rtol=1e-4, atol=1e-5)
    assert np.array_equal(got, linalg.linear_forward(x, W, threads=3 - threads))
    W_in = quantize(rng.standard_normal((C, 2 * F)).astype(np.float32) / 8, fmt)
    W_out = quantize(rng.standard_normal((F, C)).astype(np.float32) / 10, fmt)
    got = mlp.mlp_forward(x, W_in, None, W_out, None, activation="swiglu", threads=threads)
    h = prod(x, W_in)
    post = (h[:, :F] / (1 + np.exp(-h[:, :F])) * h[:, F:]).astype(np.float32)
    ref = prod(post, W_out)
    # with int8 activations a hidden value a rounding away from a code's half
    # step may take the neighbouring code: one step of its block (amax / 127) times a weight
    atol = 2 * np.abs(post).max() / 127 * np.abs(dequantize(W_out)).max() if integer else 1e-5
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=atol)
    wte = quantize(rng.standard_normal((V, C)).astype(np.float32), fmt, transposed=True)
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(linalg.embedding(ids, wte, None, threads=threads), dequantize(wte)[ids])


@pytest.mark.parametrize("fmt", BLOCK)
def test_block_format_arguments_are_checked(fmt):
    p = quantize(np.ones((64, 8), np.float32), fmt)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ValueError, match="inputs"):
        linalg.linear_forward(np.ones((1, 32), np.float32), p)
    bad = Packed(fmt, p.data[:, :-RECORD[fmt]].copy(), None, p.shape, False)
    with pytest.raises(ValueError, match=f"{fmt} data"):
        linalg.linear_forward(x, bad)
    bad = Packed(fmt, p.data.view(np.int8), None, p.shape, False)
    with pytest.raises(ValueError, match="uint8"):
        linalg.linear_forward(x, bad)


@pytest.mark.parametrize("int8_variant", INT8_VARIANTS, indirect=True, ids=_variant_id)
def test_prepared_activations_fit_the_reserved_scratch(int8_variant):
    """Where a format prepares x once per product (int8, int4, q8_0, q4_0), the
    bytes of a row stay within what linalg and the decode step reserve for
    any format (CYF_PREP_FLOATS), a multiple of 64, at every K."""
    linalg.select_format_kernels(int8_variant)
    seen = set()
    for fmt in PACKED + BLOCK:
        for K in list(range(0, 1100)) + [3072, 8192, 14336]:
            sizes = linalg.prep_bytes(fmt, K)
            if sizes is None:
                break
            seen.add(fmt)
            assert sizes[0] <= sizes[1] and sizes[0] % 64 == 0, (fmt, K, sizes)
    assert "int8" in seen and "int4" in seen
