"""Bounded fuzzing, part of every CI run: Hypothesis properties of every
kernel, and corrupted checkpoints thrown at the loader.

Kernels (test_kernel_*): random shapes (1 and odd sizes included), thread
counts 1-3 and magnitudes from 1e-3 up to float32's limit, against float64
NumPy references at the tolerances of test_kernels.py.  Extremes: softmax
over +-1e30, +-3.4e38 and -inf stays finite and sums to 1; layer norm of a
constant row is exactly the bias.

Loader (test_loader_fuzz_*): byte flips, truncations and structured header
edits of a valid small model.safetensors, and edits and byte flips of
config.json.  Each case runs in this process, so a crash would kill pytest:
that is the point.  Only ModelLoadError may escape (naming the file); a
file that still loads must give a model that runs.

Every run is derandomized (the same cases each time, reproducible) and
bounded; CYFORMER_FUZZ_SCALE=10 runs ten times as many cases.  The number of
cases run is printed at the end of the module and, with
CYFORMER_FUZZ_REPORT=path, written there as JSON.
"""

import collections
import json
import math
import os
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cyformer
from cyformer import Config, ModelLoadError
from cyformer.kernels import activations, attention, linalg, mlp, norm
from cyformer.weights import ITEMSIZE, load_weights
from test_robustness import TINY, join_safetensors, safetensors_bytes, split_safetensors, tiny_tensors

SCALE = float(os.environ.get("CYFORMER_FUZZ_SCALE", "1"))
COUNTS = collections.Counter()
EPS32 = 2.0 ** -23


def fuzz(n):
    """Hypothesis settings for n cases (times CYFORMER_FUZZ_SCALE)."""
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def report_counts(request):
    t0 = time.perf_counter()
    yield
    elapsed = time.perf_counter() - t0
    total = sum(COUNTS.values())
    parts = ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
    line = f"fuzz: {total} cases in {elapsed:.1f} s ({parts})"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # past pytest's output capture
            reporter.write_line("")
            reporter.write_line(line)
    path = os.environ.get("CYFORMER_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"total": total, "seconds": round(elapsed, 2), "cases": dict(COUNTS)}, f, indent=1)


def count(name):
    COUNTS[name] += 1


# ---------------------------------------------------------------------------
# Kernels

SEEDS = st.integers(0, 2**32 - 1)
THREADS = st.integers(1, 3)
MAGNITUDES = st.sampled_from([1e-3, 1.0, 30.0])


def randn(seed, *shape, scale=1.0):
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf, on purpose
        return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def gelu_ref(x, kind):
    x = np.asarray(x, dtype=np.float64)
    if kind == "gelu":
        return 0.5 * x * (1 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2)))
    with np.errstate(over="ignore"):  # x**3 of a huge x: tanh(inf) = 1 is still right
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def assert_sum_close(got, ref, bound_terms, K):
    """|err| <= K * 2^-23 * (|x| @ |W| + |b|): the worst case of a length-K float32 sum."""
    bound = max(K, 1) * EPS32 * bound_terms + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= bound), f"error {err.max():.3g} exceeds the float32 sum bound"


@fuzz(400)
@given(T=st.integers(1, 9), K=st.integers(0, 40), N=st.integers(1, 40), w_t=st.booleans(), bias=st.booleans(),
       accumulate=st.booleans(), threads=THREADS, scale=MAGNITUDES, seed=SEEDS)
def test_kernel_linear_matches_numpy(T, K, N, w_t, bias, accumulate, threads, scale, seed):
    count("kernel_linear")
    x, W = randn(seed, T, K, scale=scale), randn(seed + 1, K, N)
    b = randn(seed + 2, N) if bias else None
    out = randn(seed + 3, T, N) if accumulate else None
    ref = x.astype(np.float64) @ W + (0 if b is None else b) + (0 if out is None else out)
    terms = np.abs(x) @ np.abs(W) + (0 if b is None else np.abs(b)) + (0 if out is None else np.abs(ref))
    Wk = np.ascontiguousarray(W.T) if w_t else W
    one = linalg.linear_forward(x, Wk, b, None if out is None else out.copy(), w_transposed=w_t,
                                accumulate=accumulate, threads=1)
    got = linalg.linear_forward(x, Wk, b, out, w_transposed=w_t, accumulate=accumulate, threads=threads)
    assert got.shape == (T, N)
    assert_sum_close(got, ref, terms, K + accumulate)
    np.testing.assert_array_equal(got, one)  # the thread count never changes a bit


@fuzz(200)
@given(n=st.integers(0, 300), scale=MAGNITUDES, seed=SEEDS)
def test_kernel_dot_matches_numpy(n, scale, seed):
    count("kernel_dot")
    a, b = randn(seed, n, scale=scale), randn(seed + 1, n)
    ref = np.dot(a.astype(np.float64), b)
    assert abs(linalg.dot_product(a, b) - ref) <= n * EPS32 * np.dot(np.abs(a), np.abs(b)) + 1e-30


@fuzz(200)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), threads=THREADS,
       scale=st.sampled_from([1.0, 1e30, 3e38]), seed=SEEDS)
def test_kernel_add_into_is_float32_addition(shape, threads, scale, seed):
    count("kernel_add")
    out, x = randn(seed, *shape, scale=scale), randn(seed + 1, *shape, scale=scale)
    with np.errstate(over="ignore", invalid="ignore"):
        want = out + x
    np.testing.assert_array_equal(linalg.add_into(out, x, threads=threads), want)


@fuzz(200)
@given(V=st.integers(1, 20), C=st.integers(1, 9), P=st.integers(1, 12), data=st.data(), threads=THREADS, seed=SEEDS)
def test_kernel_embedding_is_a_lookup(V, C, P, data, threads, seed):
    count("kernel_embedding")
    T = data.draw(st.integers(1, P))
    pos0 = data.draw(st.integers(0, P - T))
    ids = np.random.default_rng(seed).integers(0, V, T)
    wte, wpe = randn(seed, V, C), randn(seed + 1, P, C)
    got = linalg.embedding(ids, wte, wpe, pos0=pos0, threads=threads)
    np.testing.assert_array_equal(got, wte[ids] + wpe[pos0:pos0 + T])


@fuzz(300)
@given(T=st.integers(1, 6), C=st.integers(1, 70), eps=st.sampled_from([1e-5, 1e-6, 0.1]),
       scale=st.sampled_from([1e-3, 1.0, 1e3, 1e15, 1e30]), offset=st.floats(-5, 5), threads=THREADS, seed=SEEDS)
def test_kernel_layer_norm_matches_numpy(T, C, eps, scale, offset, threads, seed):
    count("kernel_layer_norm")
    x = (randn(seed, T, C, scale=scale) + np.float32(offset * scale)).astype(np.float32)
    g, b = randn(seed + 1, C), randn(seed + 2, C)
    x64 = x.astype(np.float64)
    mu, var = x64.mean(-1, keepdims=True), x64.var(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(var + eps) * g + b
    scale_out = np.empty(T, np.float32)
    got = norm.layer_norm_forward(x, g, b, eps, scale=scale_out, threads=threads)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scale_out, np.sqrt(var[:, 0] + eps), rtol=1e-5)


@fuzz(200)
@given(T=st.integers(1, 3), C=st.integers(1, 70),
       value=st.floats(width=32, allow_nan=False, allow_infinity=False), threads=THREADS, seed=SEEDS)
def test_kernel_layer_norm_of_a_constant_row_is_the_bias(T, C, value, threads, seed):
    count("kernel_layer_norm_constant")
    x = np.full((T, C), value, np.float32)
    g, b = randn(seed, C, scale=3.0), randn(seed + 1, C)
    got = norm.layer_norm_forward(x, g, b, threads=threads)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.broadcast_to(b, (T, C)))


@fuzz(300)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), kind=st.sampled_from(["gelu_new", "gelu"]),
       scale=st.sampled_from([1e-3, 1.0, 3.0, 30.0, 1e15, 1e30, 3e38]), threads=THREADS, seed=SEEDS)
def test_kernel_gelu_matches_numpy(shape, kind, scale, threads, seed):
    count("kernel_gelu")
    with np.errstate(over="ignore"):
        x = np.clip(randn(seed, *shape, scale=1.0) * np.float32(scale), -3.4e38, 3.4e38).astype(np.float32)
    ref = gelu_ref(x, kind)
    got = activations.gelu_inplace(x.copy(), kind, threads=threads)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


SPECIALS = np.array([1e30, -1e30, 3.4e38, -3.4e38, -np.inf, np.inf, 0.0], np.float32)


def softmax_ref(x):
    """float64 softmax over the last axis with the kernel's conventions:
    +inf entries share all the mass; an all -inf row is uniform."""
    x = x.astype(np.float64).reshape(-1, x.shape[-1])
    out = np.empty_like(x)
    for r, row in enumerate(x):
        if np.isposinf(row).any():
            p = np.isposinf(row).astype(np.float64)
        elif np.isneginf(row).all():
            p = np.ones_like(row)
        else:
            p = np.exp(row - row.max())
        out[r] = p / p.sum()
    return out


@fuzz(400)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), p_special=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       allow_posinf=st.booleans(), scale=st.sampled_from([1.0, 10.0, 1e30]), threads=THREADS, seed=SEEDS)
def test_kernel_softmax_is_finite_and_sums_to_one(shape, p_special, allow_posinf, scale, threads, seed):
    count("kernel_softmax")
    rng = np.random.default_rng(seed)
    x = randn(seed, *shape, scale=scale)
    specials = SPECIALS if allow_posinf else SPECIALS[SPECIALS != np.inf]
    mask = rng.random(shape) < p_special
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    got = activations.softmax_inplace(x.copy(), threads=threads)
    assert np.isfinite(got).all() and (got >= 0).all()
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got.reshape(-1, shape[-1]), softmax_ref(x), rtol=1e-5, atol=1e-6)


def attention_ref(qkv, k_past, v_past, H):
    """Causal attention in float64: z [T, C] and the pattern [H, T, P+T]."""
    T, C = qkv.shape[0], qkv.shape[1] // 3
    D = C // H
    q, k, v = (qkv[:, i * C:(i + 1) * C].astype(np.float64).reshape(T, H, D).transpose(1, 0, 2) for i in range(3))
    k, v = np.concatenate([k_past, k], 1), np.concatenate([v_past, v], 1)
    P = k_past.shape[1]
    s = q @ k.transpose(0, 2, 1) / math.sqrt(D)
    s[:, np.arange(P + T)[None, :] > (P + np.arange(T))[:, None]] = -np.inf
    pat = np.exp(s - s.max(-1, keepdims=True))
    pat /= pat.sum(-1, keepdims=True)
    return (pat @ v).transpose(1, 0, 2).reshape(T, C), pat


@fuzz(300)
@given(H=st.integers(1, 3), D=st.integers(1, 6), T=st.integers(1, 5), past=st.integers(0, 4),
       spare=st.integers(0, 3), scale=st.sampled_from([1e-3, 1.0, 3.0, 1e8]), threads=THREADS, seed=SEEDS)
def test_kernel_attention_matches_numpy(H, D, T, past, spare, scale, threads, seed):
    count("kernel_attention")
    C, cap = H * D, past + T + spare
    qkv = randn(seed, T, 3 * C, scale=scale)
    k_past, v_past = randn(seed + 1, H, past, D, scale=scale), randn(seed + 2, H, past, D, scale=scale)
    k_cache, v_cache = np.zeros((H, D, cap), np.float32), np.zeros((H, cap, D), np.float32)
    k_cache[:, :, :past] = k_past.transpose(0, 2, 1)
    v_cache[:, :past] = v_past
    pattern = np.empty((H, T, past + T), np.float32)
    z = attention.attention_forward(qkv, k_cache, v_cache, past, pattern=pattern, threads=threads)
    assert np.isfinite(z).all() and np.isfinite(pattern).all()
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    if scale <= 3.0:  # at 1e8 the scores are ~1e16: a one-ulp change flips the winner, so only finiteness
        z_ref, pat_ref = attention_ref(qkv, k_past, v_past, H)
        np.testing.assert_allclose(z, z_ref, rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(pattern, pat_ref, rtol=1e-4, atol=1e-6)


@fuzz(200)
@given(T=st.integers(1, 5), C=st.integers(1, 20), D=st.integers(1, 30), act=st.sampled_from(["gelu_new", "gelu"]),
       accumulate=st.booleans(), threads=THREADS, seed=SEEDS)
def test_kernel_mlp_matches_numpy(T, C, D, act, accumulate, threads, seed):
    count("kernel_mlp")
    x = randn(seed, T, C)
    W_fc, b_fc = randn(seed + 1, C, D, scale=C ** -0.5), randn(seed + 2, D)
    W_proj, b_proj = randn(seed + 3, D, C, scale=D ** -0.5), randn(seed + 4, C)
    ref = gelu_ref(x.astype(np.float64) @ W_fc + b_fc, act) @ W_proj + b_proj
    out = randn(seed + 5, T, C) if accumulate else None
    if accumulate:
        ref = ref + out
    got = mlp.mlp_forward(x, W_fc, b_fc, W_proj, b_proj, out=out, activation=act, accumulate=accumulate,
                          threads=threads)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Loader

CFG = Config(**TINY)
BLOB = safetensors_bytes(tiny_tensors())
HEADER, DATA = split_safetensors(BLOB)
HEADER_END = 8 + int.from_bytes(BLOB[:8], "little")
CONFIG = dict(TINY, model_type="gpt2", activation_function="gelu_new", layer_norm_epsilon=1e-5,
              bos_token_id=0, eos_token_id=0)
CONFIG_TEXT = json.dumps(CONFIG, indent=1).encode()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A checkpoint directory the loader cases overwrite in turn."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "config.json").write_bytes(CONFIG_TEXT)
    (d / "model.safetensors").write_bytes(BLOB)
    return d


def must_load_or_refuse(call, path):
    """Run call(); a ModelLoadError naming ``path`` is fine, and so is
    success, after which the model must run.  Anything else escapes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NaN weights, odd special tokens: warned, not refused
        try:
            result = call()
        except ModelLoadError as e:
            assert str(path) in str(e), f"error does not name the file: {e}"
            return "refused"
        model = result if isinstance(result, cyformer.Model) else cyformer.Model(CFG, result, threads=1)
        model.forward([0, 1, 2])
        model.generate([1], max_new_tokens=2, temperature=1.0, seed=0)
        return "loaded"


def fuzz_weights(scratch, blob, name):
    path = scratch / "model.safetensors"
    path.write_bytes(blob)
    COUNTS[f"{name} ({must_load_or_refuse(lambda: load_weights(str(path), CFG), path)})"] += 1


@fuzz(1200)
@given(flips=st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(1, 255)), min_size=1, max_size=8),
       header_only=st.booleans())
def test_loader_fuzz_byte_flips(scratch, flips, header_only):
    blob = bytearray(BLOB)
    for pos, xor in flips:
        blob[pos % HEADER_END if header_only else pos] ^= xor
    fuzz_weights(scratch, bytes(blob), "loader_byte_flips")


@fuzz(500)
@given(cut=st.integers(0, len(BLOB)), tail=st.one_of(st.just(b""), st.binary(max_size=24)))
def test_loader_fuzz_truncations(scratch, cut, tail):
    fuzz_weights(scratch, BLOB[:cut] + tail, "loader_truncations")


JSON_LEAVES = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
               | st.text(max_size=6))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                           max_size=3), max_leaves=6)
NEAR_INTS = st.one_of(st.integers(-3, 1000), st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, 10**30]))
DTYPE_NAMES = st.sampled_from(sorted(ITEMSIZE) + ["F4", "F6_E2M3", "", "f32", "F32 ", "float32", "BF16\x00"])
EDITS = ["dtype", "shape", "shape_dim", "offsets", "offset_one", "offsets_of_other", "field_any", "del_field",
         "del_entry", "entry_any", "rename", "new_entry"]


@st.composite
def edited_headers(draw):
    """A header with 1-3 structural edits, serialised with an exact or a wrong length."""
    h = json.loads(json.dumps(HEADER))
    for _ in range(draw(st.integers(1, 3))):
        names = sorted(h)
        if not names:
            break
        name = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(EDITS))
        e = h[name]
        if kind == "del_entry":
            del h[name]
        elif kind == "entry_any":
            h[name] = draw(JSON_VALUES)
        elif kind == "rename":
            h[draw(st.text(max_size=30))] = h.pop(name)
        elif kind == "new_entry":
            h[draw(st.text(max_size=30))] = {"dtype": draw(DTYPE_NAMES), "shape": draw(st.lists(NEAR_INTS, max_size=3)),
                                             "data_offsets": draw(st.lists(NEAR_INTS, min_size=2, max_size=2))}
        elif not isinstance(e, dict):
            continue
        elif kind == "dtype":
            e["dtype"] = draw(DTYPE_NAMES)
        elif kind == "shape":
            e["shape"] = draw(st.lists(NEAR_INTS, max_size=4))
        elif kind == "shape_dim" and e.get("shape"):
            e["shape"][draw(st.integers(0, len(e["shape"]) - 1))] = draw(NEAR_INTS)
        elif kind == "offsets":
            e["data_offsets"] = draw(st.lists(NEAR_INTS, max_size=3))
        elif kind == "offset_one" and isinstance(e.get("data_offsets"), list) and e["data_offsets"]:
            i = draw(st.integers(0, len(e["data_offsets"]) - 1))
            e["data_offsets"][i] = draw(st.one_of(NEAR_INTS, st.integers(-8, 8).map(
                lambda d, v=e["data_offsets"][i]: v + d if isinstance(v, int) else d)))
        elif kind == "offsets_of_other":
            other = h[draw(st.sampled_from(names))]
            if isinstance(other, dict) and "data_offsets" in other:
                e["data_offsets"] = other["data_offsets"]
        elif kind == "field_any":
            e[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(JSON_VALUES)
        elif kind == "del_field":
            e.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
    text_len = len(json.dumps(h).encode())
    text_len += -text_len % 8
    length = draw(st.one_of(st.just(None), st.just(None), st.just(None),
                            st.integers(-16, 16).map(lambda d: max(0, text_len + d)),
                            st.integers(0, 2**64 - 1)))
    return join_safetensors(h, DATA, length)


@fuzz(1200)
@given(blob=edited_headers())
def test_loader_fuzz_header_edits(scratch, blob):
    fuzz_weights(scratch, blob, "loader_header_edits")


CONFIG_KEYS = ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
               "layer_norm_epsilon", "bos_token_id", "eos_token_id", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings", "scale_attn_by_inverse_layer_idx",
               "scale_attn_weights", "add_cross_attention", "tie_word_embeddings"]
CONFIG_VALUES = st.one_of(NEAR_INTS, st.sampled_from([0, 1, 2, 4, 5, 6, 7, 8, 2**17 + 1, 2**24 + 1, 1e-5, 0.5, -1e-5]),
                          st.sampled_from(["gelu", "gelu_new", "relu", "", "4"]), JSON_VALUES)


def fuzz_config(scratch, text, name):
    (scratch / "model.safetensors").write_bytes(BLOB)
    path = scratch / "config.json"
    path.write_bytes(text)
    # the error may be about either file (a config that disagrees with the tensors)
    COUNTS[f"{name} ({must_load_or_refuse(lambda: cyformer.load(scratch, threads=1), scratch)})"] += 1


@fuzz(600)
@given(edits=st.dictionaries(st.sampled_from(CONFIG_KEYS + ["junk"]), CONFIG_VALUES, max_size=4),
       deleted=st.lists(st.sampled_from(CONFIG_KEYS), max_size=2))
def test_loader_fuzz_config_edits(scratch, edits, deleted):
    raw = dict(CONFIG)
    for k in deleted:
        raw.pop(k, None)
    raw.update(edits)
    fuzz_config(scratch, json.dumps(raw).encode(), "loader_config_edits")


@fuzz(400)
@given(flips=st.lists(st.tuples(st.integers(0, len(CONFIG_TEXT) - 1), st.integers(1, 255)), max_size=4),
       cut=st.integers(0, len(CONFIG_TEXT)), insert=st.binary(max_size=8))
def test_loader_fuzz_config_bytes(scratch, flips, cut, insert):
    text = bytearray(CONFIG_TEXT)
    for pos, xor in flips:
        text[pos] ^= xor
    text = bytes(text[:cut]) + insert + bytes(text[cut:]) if insert else bytes(text[:max(cut, 1)])
    fuzz_config(scratch, text, "loader_config_bytes")
