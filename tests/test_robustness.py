"""Bad input never crashes cyformer: every way in is guarded.

1. Checkpoints: every malformed directory, config.json or model.safetensors
   gives ModelLoadError naming the file and the tensor or key (the basics are
   in test_loader.py; here: the safetensors header, dtypes, absurd configs).
2. Arguments: every public kernel wrapper x every argument x every kind of
   bad value gives a ValueError that starts with the wrapper's name and names
   the argument (not a NumPy or Cython error); the same for the Model's ids,
   prompts and sampling parameters.
3. Threads: Python threads generating on one shared model get the tokens a
   sequential run gets.
4. Memory: thousands of generated tokens and fifty loads leave RSS flat.
"""

import gc
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import cyformer
from cyformer import Config, CyformerError, ModelLoadError
from cyformer.kernels import activations, attention, decode, linalg, mlp, norm
from cyformer.weights import load_weights

# ---------------------------------------------------------------------------
# Tiny checkpoints written without torch, and raw safetensors surgery.

TINY = dict(n_layer=1, n_embd=4, n_head=2, vocab_size=7, n_positions=5, n_inner=6)


def tiny_tensors(geometry=TINY, seed=0, prefix="transformer."):
    """{name: float32 array} for a random GPT-2 of ``geometry``."""
    rng = np.random.default_rng(seed)
    L, C, V, P = geometry["n_layer"], geometry["n_embd"], geometry["vocab_size"], geometry["n_positions"]
    D = geometry.get("n_inner") or 4 * C

    def r(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"wte.weight": r(V, C), "wpe.weight": r(P, C), "ln_f.weight": 1 + r(C), "ln_f.bias": r(C)}
    for i in range(L):
        h = f"h.{i}."
        t.update({h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C),
                  h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
                  h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
                  h + "ln_2.weight": 1 + r(C), h + "ln_2.bias": r(C),
                  h + "mlp.c_fc.weight": r(C, D), h + "mlp.c_fc.bias": r(D),
                  h + "mlp.c_proj.weight": r(D, C), h + "mlp.c_proj.bias": r(C)})
    return {prefix + k: v for k, v in t.items()}


def safetensors_bytes(tensors, dtypes=None):
    """Serialise {name: array} as safetensors; ``dtypes`` overrides the dtype
    string of some tensors (their bytes are written as given)."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
             np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL", np.dtype(np.uint16): "BF16"}
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        dtype = (dtypes or {}).get(name, names[np.dtype(a.dtype)])
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return join_safetensors(header, b"".join(chunks))


def split_safetensors(blob):
    """-> (header dict, data bytes)."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def join_safetensors(header, data, length=None):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
    n = len(text) if length is None else length
    return n.to_bytes(8, "little", signed=False) + text + data


def write_checkpoint(path, tensors=None, config=None, blob=None):
    os.makedirs(path, exist_ok=True)
    cfg = dict(TINY, model_type="gpt2", bos_token_id=0, eos_token_id=0)
    cfg.update(config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if blob is None:
        blob = safetensors_bytes(tiny_tensors() if tensors is None else tensors)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(blob)
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    return write_checkpoint(tmp_path / "tiny")


def load_tiny_blob(tmp_path, blob):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    return load_weights(str(path), Config(**TINY))


# ---------------------------------------------------------------------------
# 1. Checkpoints

def test_tiny_checkpoint_loads_and_runs(tiny):
    m = cyformer.load(tiny)
    assert m.forward([1, 2, 3]).shape == (3, 7)


def test_path_is_a_file(tiny):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        cyformer.load(os.path.join(tiny, "config.json"))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_checkpoint_file_is_a_directory(tiny, name):
    os.remove(os.path.join(tiny, name))
    os.mkdir(os.path.join(tiny, name))
    with pytest.raises(ModelLoadError, match=re.escape(name) + ".*not a regular file"):
        cyformer.load(tiny)


class _Boom:
    """Unpickling this would create a marker file: proof that a pickle ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_checkpoints_are_never_loaded(tiny, tmp_path):
    marker = tmp_path / "pickle-was-loaded"
    os.remove(os.path.join(tiny, "model.safetensors"))
    with open(os.path.join(tiny, "pytorch_model.bin"), "wb") as f:
        pickle.dump(_Boom(str(marker)), f)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin is a pickle and is never loaded"):
        cyformer.load(tiny)
    assert not marker.exists()


def test_sharded_checkpoint_is_named(tiny):
    os.remove(os.path.join(tiny, "model.safetensors"))
    open(os.path.join(tiny, "model.safetensors.index.json"), "w").write("{}")
    with pytest.raises(ModelLoadError, match="sharded"):
        cyformer.load(tiny)


def _header_len(blob):
    return 8 + int.from_bytes(blob[:8], "little")


@pytest.mark.parametrize("cut,match", [
    (lambda b: 0, "fewer than the 8-byte header length"),
    (lambda b: 7, "fewer than the 8-byte header length"),
    (lambda b: 8, "header length .* points past the end"),
    (lambda b: _header_len(b) // 2, "header length .* points past the end"),
    (lambda b: _header_len(b), r"tensor '.*': data_offsets .* point past the end of the data"),
    (lambda b: len(b) - 1, r"tensor '.*': data_offsets .* point past the end of the data"),
])
def test_truncated_safetensors(tmp_path, cut, match):
    blob = safetensors_bytes(tiny_tensors())
    with pytest.raises(ModelLoadError, match=match):
        load_tiny_blob(tmp_path, blob[:cut(blob)])


def _entry(h, suffix="ln_f.bias"):
    return next(v for k, v in h.items() if k.endswith(suffix))


def _edit(fn):
    """Apply fn to the parsed header and re-serialise it with a correct length;
    fn may instead return a function of the data that builds the whole file."""
    def apply(blob):
        h, data = split_safetensors(blob)
        out = fn(h)
        return out(data) if callable(out) else join_safetensors(h, data)
    return apply


def _text(fn):
    """Apply fn to the raw header text and fix the length prefix."""
    def apply(blob):
        n = int.from_bytes(blob[:8], "little")
        text = fn(blob[8:8 + n])
        return len(text).to_bytes(8, "little") + text + blob[8 + n:]
    return apply


HEADER_EDITS = {
    "length-huge": (lambda b: (2**64 - 1).to_bytes(8, "little") + b[8:], "points past the end"),
    "length-short": (lambda b: (_header_len(b) - 8 - 9).to_bytes(8, "little") + b[8:], "not valid JSON"),
    "length-zero": (lambda b: bytes(8) + b[8:], "not valid JSON"),
    "not-utf8": (lambda b: b[:8] + b"\xff" + b[9:], "not UTF-8"),
    "not-json": (lambda b: b[:8] + b"[" + b[9:], "not valid JSON"),
    "json-array": (_text(lambda t: b"[1, 2]"), "header must be a JSON object, got list"),
    "entry-not-object": (_edit(lambda h: h.update({k: 3 for k in h if k.endswith("ln_f.bias")})),
                         r"ln_f\.bias.*header entry must be an object"),
    "metadata-not-object": (_edit(lambda h: h.update({"__metadata__": [1]})), "__metadata__"),
    "no-dtype": (_edit(lambda h: _entry(h).pop("dtype")), r"ln_f\.bias.*lacks 'dtype'"),
    "no-shape": (_edit(lambda h: _entry(h).pop("shape")), r"ln_f\.bias.*lacks 'shape'"),
    "no-offsets": (_edit(lambda h: _entry(h).pop("data_offsets")), r"ln_f\.bias.*lacks 'data_offsets'"),
    "dtype-number": (_edit(lambda h: _entry(h).update(dtype=32)), r"ln_f\.bias.*dtype must be a string"),
    "shape-negative": (_edit(lambda h: _entry(h).update(shape=[-4])), r"ln_f\.bias.*shape"),
    "shape-bool": (_edit(lambda h: _entry(h).update(shape=[True])), r"ln_f\.bias.*shape"),
    "shape-string": (_edit(lambda h: _entry(h).update(shape="4")), r"ln_f\.bias.*shape"),
    "shape-huge": (_edit(lambda h: _entry(h).update(shape=[2**62] * 1000)), r"ln_f\.bias.*needs"),
    "shape-disagrees-with-bytes": (_edit(lambda h: _entry(h).update(shape=[5])), r"ln_f\.bias.*span 16 bytes"),
    "offsets-reversed": (_edit(lambda h: _entry(h).update(data_offsets=_entry(h)["data_offsets"][::-1])),
                         r"ln_f\.bias.*data_offsets must be \[begin, end\]"),
    "offsets-negative": (_edit(lambda h: _entry(h).update(data_offsets=[-16, 0])), r"ln_f\.bias.*data_offsets"),
    "offsets-float": (_edit(lambda h: _entry(h).update(data_offsets=[0.0, 16.0])), r"ln_f\.bias.*data_offsets"),
    "offsets-three": (_edit(lambda h: _entry(h).update(data_offsets=[0, 8, 16])), r"ln_f\.bias.*data_offsets"),
    "offsets-past-end": (_edit(lambda h: _entry(h).update(data_offsets=[2**40, 2**40 + 16])),
                         r"ln_f\.bias.*point past the end"),
    "offsets-overlap": (_edit(lambda h: _entry(h).update(data_offsets=_entry(h, "ln_f.weight")["data_offsets"])),
                        r"ln_f\.(weight|bias)' and .*ln_f\.(weight|bias)' overlap"),
    "duplicate-key": (_text(lambda t: b'{"__metadata__": {}, ' + t[1:]), "duplicate key '__metadata__'"),
    # A header nested 100,000 deep must not blow the C stack of the JSON parser.
    "deep-nesting": (_text(lambda t: b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    "unknown-dtype": (_edit(lambda h: _entry(h).update(dtype="F5")), r"ln_f\.bias.*has dtype F5"),
    # "ln_f.bias" next to "transformer.ln_f.bias", with bytes of its own
    "same-parameter-twice": (_edit(lambda h: lambda data: join_safetensors(
        dict(h, **{"ln_f.bias": dict(_entry(h), data_offsets=[len(data), len(data) + 16])}), data + bytes(16))),
        r"'transformer\.ln_f\.bias' and 'ln_f\.bias' are the same parameter"),
}


@pytest.mark.parametrize("name", sorted(HEADER_EDITS))
def test_corrupt_safetensors_header(tmp_path, name):
    edit, match = HEADER_EDITS[name]
    blob = edit(safetensors_bytes(tiny_tensors()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModelLoadError, match=match) as err:
            load_tiny_blob(tmp_path, blob)
    assert "model.safetensors" in str(err.value)


def test_extra_bytes_after_the_data_are_refused(tmp_path):
    # as the safetensors package does: the data must end with the last tensor
    with pytest.raises(ModelLoadError, match="13 bytes after the last tensor"):
        load_tiny_blob(tmp_path, safetensors_bytes(tiny_tensors()) + b"\0" * 13)


def _rounded_bf16(a):
    """float32 -> the float32 value of its bfloat16 (round to nearest even), and the raw bf16 bits."""
    import torch

    b = torch.from_numpy(a).to(torch.bfloat16)
    return b.to(torch.float32).numpy(), b.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F64"])
def test_float_dtypes_are_widened_to_float32(tmp_path, dtype):
    tensors = tiny_tensors()
    stored, want = {}, {}
    for k, a in tensors.items():
        if dtype == "F16":
            stored[k] = a.astype(np.float16)
            want[k] = stored[k].astype(np.float32)
        elif dtype == "BF16":
            want[k], stored[k] = _rounded_bf16(a)
        else:
            stored[k], want[k] = a.astype(np.float64), a
    w = load_tiny_blob(tmp_path, safetensors_bytes(stored))
    for got, key in [(w.wte, "wte.weight"), (w.wpe, "wpe.weight"), (w.blocks[0].c_fc.weight, "h.0.mlp.c_fc.weight"),
                     (w.ln_f.bias, "ln_f.bias")]:
        assert got.dtype == np.float32 and got.flags.c_contiguous and not got.flags.writeable
        np.testing.assert_array_equal(got, want["transformer." + key])


def test_bf16_checkpoint_matches_hf_with_the_same_rounding(checkpoint, tmp_path):
    """A real bfloat16 file written by safetensors.torch gives HF's logits
    (for the bf16-rounded weights): the widening is bit-exact."""
    import copy

    import torch
    from safetensors.torch import save_file

    from helpers import hf_logits

    src, hf = checkpoint("odd")
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    d = tmp_path / "bf16"
    d.mkdir()
    (d / "config.json").write_bytes(open(os.path.join(src, "config.json"), "rb").read())
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(d / "model.safetensors"))
    m = cyformer.load(d)
    ids = np.array([1, 5, 99, 0, 42])
    np.testing.assert_allclose(m.forward(ids), hf_logits(hf, ids)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["I8", "U8", "I64", "BOOL", "U32", "F8_E4M3"])
def test_non_float_dtypes_are_refused(tmp_path, dtype):
    tensors = tiny_tensors()
    key = "transformer.h.0.attn.c_proj.bias"  # 4 elements
    itemsize = {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "U32": 4, "I64": 8}[dtype]
    tensors[key] = np.zeros(4 * itemsize, np.uint8)
    blob = safetensors_bytes(tensors, dtypes={key: dtype})
    h, data = split_safetensors(blob)
    h[key]["shape"] = [4]
    with pytest.raises(ModelLoadError, match=rf"h\.0\.attn\.c_proj\.bias' has dtype {dtype}; expected a floating"):
        load_tiny_blob(tmp_path, join_safetensors(h, data))


def test_integer_dtype_on_an_unused_tensor_is_only_warned_about(tmp_path):
    tensors = tiny_tensors()
    tensors["transformer.extra.weight"] = np.zeros(3, np.uint8)
    blob = safetensors_bytes(tensors, dtypes={"transformer.extra.weight": "U8"})
    with pytest.warns(UserWarning, match="unexpected tensor"):
        load_tiny_blob(tmp_path, blob)


@pytest.mark.parametrize("key,shape", [
    ("wte.weight", (4, 7)),                   # transposed
    ("wte.weight", (28,)),                    # flattened
    ("h.0.attn.c_attn.weight", (12, 4)),      # stored [out, in] like nn.Linear
    ("h.0.mlp.c_proj.bias", (1, 4)),          # an extra axis
    ("wpe.weight", (6, 4)),                   # more positions than config.json says
])
def test_misshapen_tensor(tmp_path, key, shape):
    tensors = tiny_tensors()
    full = "transformer." + key
    a = tensors[full]
    tensors[full] = np.resize(a, shape).astype(np.float32)
    with pytest.raises(ModelLoadError, match=re.escape(key) + r"' has shape .* expected"):
        load_tiny_blob(tmp_path, safetensors_bytes(tensors))


def test_untied_lm_head_is_checked(tmp_path):
    tensors = tiny_tensors()
    tensors["lm_head.weight"] = np.ones((7, 5), np.float32)
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight' has shape \(7, 5\)"):
        load_tiny_blob(tmp_path, safetensors_bytes(tensors))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_weights_warn_and_still_run(tmp_path, bad):
    tensors = tiny_tensors()
    tensors["transformer.h.0.mlp.c_fc.weight"][2, 3] = bad
    path = write_checkpoint(tmp_path / "nan", tensors=tensors)
    with pytest.warns(UserWarning, match=r"h\.0\.mlp\.c_fc\.weight' contains NaN or Inf"):
        m = cyformer.load(path)
    m.forward([1, 2, 3])            # NaN logits, but no crash
    m.generate([1, 2], max_new_tokens=3, temperature=1.0, seed=0)


# config.json --------------------------------------------------------------

@pytest.mark.parametrize("text,match", [
    (b"", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"gpt2"', "expected a JSON object, got str"),
    (b"null", "expected a JSON object, got NoneType"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"n_embd": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"n_embd": 4, "n_embd": 8', "not valid JSON"),
])
def test_config_not_a_json_object(tiny, text, match):
    with open(os.path.join(tiny, "config.json"), "wb") as f:
        f.write(text)
    with pytest.raises(ModelLoadError, match=r"config\.json: .*" + match):
        cyformer.load(tiny)


def test_config_json_too_big(tiny):
    with open(os.path.join(tiny, "config.json"), "wb") as f:
        f.write(b" " * (2**24 + 1))
    with pytest.raises(ModelLoadError, match=r"config\.json: over"):
        cyformer.load(tiny)


@pytest.mark.parametrize("key", ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head"])
def test_config_missing_geometry_key(tiny, key):
    p = os.path.join(tiny, "config.json")
    raw = json.load(open(p))
    del raw[key]
    json.dump(raw, open(p, "w"))
    with pytest.raises(ModelLoadError, match=rf"config\.json: missing key '{key}'"):
        cyformer.load(tiny)


def test_config_aliases_count_as_present(tiny):
    p = os.path.join(tiny, "config.json")
    raw = json.load(open(p))
    raw["hidden_size"] = raw.pop("n_embd")
    raw["num_hidden_layers"] = raw.pop("n_layer")
    json.dump(raw, open(p, "w"))
    assert cyformer.load(tiny).config.n_embd == 4


@pytest.mark.parametrize("change,match", [
    ({"n_embd": 0}, "n_embd must be a positive integer, got 0"),
    ({"vocab_size": -7}, "vocab_size must be a positive integer"),
    ({"n_positions": 0}, "n_positions must be a positive integer"),
    ({"n_layer": -1}, "n_layer must be a positive integer"),
    ({"n_inner": 0}, "n_inner must be a positive integer"),
    ({"n_head": 2.0}, "n_head must be a positive integer, got 2.0"),
    ({"n_head": True}, "n_head must be a positive integer, got True"),
    ({"n_embd": None}, "n_embd must be a positive integer, got None"),
    ({"n_embd": [4]}, "n_embd must be a positive integer"),
    ({"n_embd": 6, "n_head": 4}, "divisible"),
    ({"n_positions": 2**40}, "n_positions=1099511627776 is absurdly large"),
    ({"vocab_size": 10**30}, "vocab_size=.* is absurdly large"),
    ({"n_layer": 10**6}, "n_layer=1000000 is absurdly large"),
    ({"n_embd": 2**20, "n_head": 1}, "n_embd=1048576 is absurdly large"),
    ({"n_inner": 2**40}, "n_inner=.* is absurdly large"),
    ({"n_embd": 2**16, "n_head": 1, "n_layer": 4000, "vocab_size": 2**20}, "parameters; refusing"),
    ({"activation_function": ["gelu"]}, "activation_function"),
    ({"activation_function": None}, "activation_function"),
    ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": float("inf")}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon"),
    ({"add_cross_attention": True}, "add_cross_attention"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
])
def test_config_absurd_values(tiny, change, match):
    p = os.path.join(tiny, "config.json")
    raw = json.load(open(p))
    raw.update(change)
    json.dump(raw, open(p, "w"))  # NaN and Infinity go through as JSON extensions, as HF writes them
    with pytest.raises(ModelLoadError, match=r"config\.json: .*" + match):
        cyformer.load(tiny)


def test_config_bad_special_token_ids_only_warn(tiny):
    p = os.path.join(tiny, "config.json")
    raw = json.load(open(p))
    raw.update(eos_token_id=7, bos_token_id="x")
    json.dump(raw, open(p, "w"))
    with pytest.warns(UserWarning) as record:
        m = cyformer.load(tiny)
    messages = " | ".join(str(w.message) for w in record)
    assert "eos_token_id=7" in messages and "bos_token_id='x'" in messages
    assert m.config.eos_token_id is None and m.config.bos_token_id is None


# ---------------------------------------------------------------------------
# 2. Arguments: every kernel wrapper x every argument x every kind of bad value

F32 = np.float32


def a32(*shape, fill=0.25):
    return np.full(shape, fill, F32)


class Wrapper:
    """A kernel wrapper: how to call it with good arguments, and which are
    read-only inputs ("in"), outputs ("out") or both ("inout")."""

    def __init__(self, fn, label, make, roles, any_ndim=(), bad_shapes=None):
        self.fn, self.label, self.make, self.roles = fn, label, make, roles
        self.any_ndim = set(any_ndim)  # arguments that take any number of axes
        self.bad_shapes = bad_shapes or {}  # argument -> a shape that does not fit the others

    def __call__(self, **kw):
        return self.fn(**kw)


T, K, N, H, D, CAP, V, P = 3, 5, 6, 2, 3, 7, 11, 9
WRAPPERS = {
    "linear": Wrapper(
        lambda **kw: linalg.linear_forward(**kw), "linear",
        lambda: dict(x=a32(T, K), W=a32(K, N), b=a32(N), out=a32(T, N)),
        dict(x="in", W="in", b="in", out="out"),
        bad_shapes=dict(x=(T, K + 1), W=(K + 1, N), b=(N + 1,), out=(T, N + 1))),
    "matvec_rows": Wrapper(
        lambda **kw: linalg.matvec_rows(**kw), "matvec_rows",
        lambda: dict(x=a32(T, K), W=a32(K, N)),
        dict(x="in", W="in"),
        bad_shapes=dict(x=(T, K + 1), W=(K + 1, N))),
    "dot": Wrapper(
        lambda **kw: linalg.dot_product(**kw), "dot",
        lambda: dict(a=a32(K), b=a32(K)),
        dict(a="in", b="in"), bad_shapes=dict(b=(K + 1,))),
    "add": Wrapper(
        lambda **kw: linalg.add_into(**kw), "add",
        lambda: dict(out=a32(T, K), x=a32(T, K)),
        dict(out="inout", x="in"), any_ndim=["out"], bad_shapes=dict(x=(T, K + 1))),
    "embedding": Wrapper(
        lambda **kw: linalg.embedding(**kw), "embedding",
        lambda: dict(ids=np.array([1, 0, 10]), wte=a32(V, K), wpe=a32(P, K), pos0=2, out=a32(T, K)),
        dict(wte="in", wpe="in", out="out"),
        bad_shapes=dict(wpe=(P, K + 1), out=(T, K + 1))),
    "layer_norm": Wrapper(
        lambda **kw: norm.layer_norm_forward(**kw), "layer_norm",
        lambda: dict(x=np.arange(T * K, dtype=F32).reshape(T, K), g=a32(K), b=a32(K), eps=1e-5,
                     out=a32(T, K), scale=a32(T)),
        dict(x="in", g="in", b="in", out="out", scale="out"),
        bad_shapes=dict(x=(T, 0), g=(K + 1,), b=(K - 1,), out=(T + 1, K), scale=(T + 1,))),
    "gelu": Wrapper(
        lambda **kw: activations.gelu_inplace(**kw), "gelu",
        lambda: dict(x=a32(T, K)), dict(x="inout"), any_ndim=["x"]),
    "softmax": Wrapper(
        lambda **kw: activations.softmax_inplace(**kw), "softmax",
        lambda: dict(x=a32(T, K)), dict(x="inout"), any_ndim=["x"], bad_shapes=dict(x=(T, 0))),
    "attention": Wrapper(
        lambda **kw: attention.attention_forward(**kw), "attention",
        lambda: dict(qkv=a32(T, 3 * H * D), k_cache=a32(H, D, CAP), v_cache=a32(H, CAP, D), past=2,
                     out=a32(T, H * D), scores=a32(H, T, 2 + T), pattern=a32(H, T, 2 + T)),
        dict(qkv="in", k_cache="inout", v_cache="inout", out="out", scores="out", pattern="out"),
        # k_cache sets H, D and cap: a wrong one is reported on v_cache or qkv
        bad_shapes=dict(qkv=(T, 3 * H * D + 1), v_cache=(H, CAP, D + 1),
                        out=(T, H * D + 1), scores=(H, T, 1 + T), pattern=(H, T + 1, 2 + T))),
    "mlp": Wrapper(
        lambda **kw: mlp.mlp_forward(**kw), "mlp",
        lambda: dict(x=a32(T, K), W_in=a32(K, N), b_in=a32(N), W_out=a32(N, K), b_out=a32(K), out=a32(T, K)),
        dict(x="in", W_in="in", b_in="in", W_out="in", b_out="in", out="out"),
        bad_shapes=dict(x=(T, K + 1), W_in=(K + 1, N), b_in=(N + 1,), W_out=(N, K + 1), b_out=(K + 1,),
                        out=(T + 1, K))),
    "mlp_swiglu": Wrapper(
        lambda **kw: mlp.mlp_forward(activation="swiglu", **kw), "mlp",
        lambda: dict(x=a32(T, K), W_in=a32(K, 2 * N), b_in=a32(2 * N), W_out=a32(N, K), b_out=a32(K),
                     out=a32(T, K)),
        dict(x="in", W_in="in", b_in="in", W_out="in", b_out="in", out="out"),
        bad_shapes=dict(x=(T, K + 1), W_in=(K, 2 * N + 1), b_in=(N,), W_out=(N + 1, K), b_out=(K + 1,),
                        out=(T + 1, K))),
    "rms_norm": Wrapper(
        lambda **kw: norm.rms_norm_forward(**kw), "rms_norm",
        lambda: dict(x=np.arange(T * K, dtype=F32).reshape(T, K), g=a32(K), eps=1e-5,
                     out=a32(T, K), scale=a32(T)),
        dict(x="in", g="in", out="out", scale="out"),
        bad_shapes=dict(x=(T, 0), g=(K + 1,), out=(T + 1, K), scale=(T + 1,))),
    "swiglu": Wrapper(
        lambda **kw: activations.swiglu_forward(**kw), "swiglu",
        lambda: dict(h=a32(T, 2 * K), out=a32(T, K)), dict(h="in", out="out"),
        bad_shapes=dict(h=(T, 2 * K + 1), out=(T, K + 1))),
    "rope": Wrapper(
        lambda **kw: attention.rope_forward(n_head=H, n_kv_head=1, **kw), "rope",
        lambda: dict(qkv=a32(T, (H + 2) * 2 * D), past=1, cos=a32(P, D), sin=a32(P, D)),
        dict(qkv="inout", cos="in", sin="in"),
        bad_shapes=dict(qkv=(T, (H + 2) * 2 * D + 1), cos=(P, D + 1), sin=(P + 1, D))),
    "attention_gqa": Wrapper(
        lambda **kw: attention.attention_forward(n_head=2 * H, **kw), "attention",
        lambda: dict(qkv=a32(T, 4 * H * D), k_cache=a32(H, D, CAP), v_cache=a32(H, CAP, D), past=2,
                     out=a32(T, 2 * H * D), scores=a32(2 * H, T, 2 + T), pattern=a32(2 * H, T, 2 + T)),
        dict(qkv="in", k_cache="inout", v_cache="inout", out="out", scores="out", pattern="out"),
        bad_shapes=dict(qkv=(T, 4 * H * D + 1), v_cache=(H, CAP, D + 1),
                        out=(T, H * D), scores=(H, T, 2 + T), pattern=(2 * H, T + 1, 2 + T))),
    "stream_sum": Wrapper(
        lambda **kw: linalg.stream_sum(**kw), "stream_sum",
        lambda: dict(x=a32(T, K)), dict(x="in"), any_ndim=["x"]),
    # one layer, d_model H * D, d_mlp N; the caches are [layers, H, D, cap] and [layers, H, cap, D]
    "decode_step": Wrapper(
        lambda **kw: _STEP(**kw), "decode step",
        lambda: dict(token=3, k_cache=a32(1, H, D, CAP), v_cache=a32(1, H, CAP, D), past=2),
        dict(k_cache="inout", v_cache="inout"),
        bad_shapes=dict(k_cache=(2, H, D, CAP), v_cache=(1, H, CAP, D + 1))),
}
def _tiny_step():
    """A one-layer GPT-2 of d_model H * D and d_mlp N, weights all 0.25."""
    from cyformer.arch import global_shapes, layer_shapes
    from cyformer.config import Config
    from cyformer.weights import Weights

    cfg = Config(vocab_size=V, n_positions=P, n_embd=H * D, n_layer=1, n_head=H, n_inner=N)
    params = {k: a32(*s) for k, s in global_shapes(cfg).items() if s is not None}
    params.update({f"blocks.0.{k}": a32(*s) for k, s in layer_shapes(cfg).items() if s is not None})
    return decode.DecodeStep(cfg, Weights.from_params(cfg, params))


_STEP = _tiny_step()


def test_every_public_kernel_wrapper_is_covered():
    """A new def in a kernel module must be added to WRAPPERS."""
    public = {f"{m.__name__.rsplit('.', 1)[1]}.{n}" for m in (linalg, norm, activations, attention, mlp, decode)
              for n in dir(m) if not n.startswith("_") and callable(getattr(m, n))
              and getattr(getattr(m, n), "__module__", None) == m.__name__}
    covered = {"linalg.linear_forward", "linalg.dot_product", "linalg.add_into", "linalg.embedding",
               "norm.layer_norm_forward", "activations.gelu_inplace", "activations.softmax_inplace",
               "attention.attention_forward", "mlp.mlp_forward", "linalg.stream_sum",
               "norm.rms_norm_forward", "norm.norm_forward", "activations.swiglu_forward",
               "attention.rope_forward",
               "decode.DecodeStep", "linalg.Workspace", "linalg.aligned_empty",
               "linalg.format_kernels", "linalg.select_format_kernels", "linalg.integer_gemm",
               "linalg.prefill_gemm", "linalg.prep_bytes", "linalg.matvec_rows", "linalg.integer_tiles_agree",
               "linalg.bf16_tile_matches_reference", "linalg.amx_tdpbf16ps_model"}
    assert public <= covered, f"kernel wrappers without robustness cases: {sorted(public - covered)}"


def test_select_format_kernels_refuses_bad_features():
    with pytest.raises(TypeError, match="select_format_kernels: features must be a dict"):
        linalg.select_format_kernels(["avx512_vnni"])
    with pytest.raises(ValueError, match="unknown CPU features"):
        linalg.select_format_kernels({"no_such_feature": True})
    # the CPU's own features are accepted, and the kernels named afterwards are the table's formats
    used = linalg.select_format_kernels()
    assert set(used) and all(isinstance(v, bool) for v in used.values())
    assert set(linalg.format_kernels()) == set(cyformer.formats.TABLE)


def test_amx_tdpbf16ps_model_names_bad_arguments():
    codes, c = np.zeros((16, 32), np.uint16), np.full((16, 16), 1.5, np.float32)
    for a, b, cc in ((codes[:8], codes, c), (codes, codes.ravel(), c), (codes, codes, c[:, :8]), (codes, codes, 1.0)):
        with pytest.raises(ValueError, match=r"amx_tdpbf16ps_model: needs a \[16, 32\]"):
            linalg.amx_tdpbf16ps_model(a, b, cc)
    with pytest.raises(TypeError, match="bfloat16 codes \\(uint16\\), got float32"):
        linalg.amx_tdpbf16ps_model(codes.astype(np.float32), codes, c)
    out = linalg.amx_tdpbf16ps_model(codes, codes + 0x3F80, c)  # 0 * 1.0 added: c comes back
    np.testing.assert_array_equal(out, c)
    assert out is not c and (c == 1.5).all()  # the caller's c is left as it was


def test_integer_tiles_agree_names_bad_arguments():
    before = linalg.format_kernels()
    with pytest.raises(TypeError, match="integer_tiles_agree: features must be a dict"):
        linalg.integer_tiles_agree("avx2")
    with pytest.raises(TypeError, match="integer_tiles_agree: reference must be a dict"):
        linalg.integer_tiles_agree({}, reference=["avx2"])
    with pytest.raises(ValueError, match="unknown CPU features"):
        linalg.integer_tiles_agree({"no_such_feature": True})
    with pytest.raises(ValueError, match="quantize: format must be one of"):
        linalg.integer_tiles_agree({}, formats=("float16",))
    assert linalg.format_kernels() == before  # the CPU's kernels are back after each
    with pytest.raises(TypeError, match="bf16_tile_matches_reference: features must be a dict"):
        linalg.bf16_tile_matches_reference("amx_bf16")
    with pytest.raises(ValueError, match="chosen no bfloat16 GEMM|choose no bfloat16 GEMM"):
        linalg.bf16_tile_matches_reference({"avx512_bf16": False})
    assert linalg.format_kernels() == before


def test_prefill_gemm_and_prep_bytes_name_bad_arguments():
    for bad in ("float16", None, 3):
        with pytest.raises(ValueError, match="prefill_gemm: format must be one of"):
            linalg.prefill_gemm(bad)
        with pytest.raises(ValueError, match="prep_bytes: format must be one of"):
            linalg.prep_bytes(bad, 64)
    with pytest.raises(ValueError, match="K must be >= 0"):
        linalg.prep_bytes("int8", -1)
    with pytest.raises(TypeError):
        linalg.prep_bytes("int8", "64")
    assert linalg.prep_bytes("float32", 64) is None
    assert all(linalg.prefill_gemm(f) in ("int8", "bfloat16", "float32") for f in cyformer.formats.TABLE)


def test_integer_gemm_names_a_bad_format():
    for bad in ("int3", None, 5, b"int8"):
        with pytest.raises(ValueError, match="integer_gemm: format must be one of"):
            linalg.integer_gemm(bad)
    # float formats never take the integer GEMM; the answer is a bool for every format
    assert linalg.integer_gemm("float32") is False and linalg.integer_gemm("bfloat16") is False
    assert all(isinstance(linalg.integer_gemm(f), bool) for f in cyformer.formats.TABLE)


def test_aligned_empty_refuses_bad_sizes():
    for bad in (-1, 2.5, "3", None):
        with pytest.raises(ValueError, match="aligned_empty: n"):
            linalg.aligned_empty(bad)


def test_good_arguments_pass():
    for w in WRAPPERS.values():
        w(**w.make())


def _non_contiguous(a):
    """Same shape and dtype, every other element of a bigger array."""
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype) if a.ndim else np.zeros(2, a.dtype)
    v = big[..., ::2] if a.ndim else big[::2][0:1].reshape(())
    v[...] = a
    return v


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


BAD_KINDS = {
    "float64": lambda a: a.astype(np.float64),
    "float16": lambda a: a.astype(np.float16),
    "int32": lambda a: a.astype(np.int32),
    "non-contiguous": _non_contiguous,
    "fortran-order": lambda a: np.asfortranarray(np.concatenate([a, a], axis=-1))[..., :a.shape[-1]]
    if a.ndim == 2 else _non_contiguous(a),
    "extra-axis": lambda a: a[None],
    "list": lambda a: a.tolist(),
    "scalar": lambda a: 0.5,
}


def _cases():
    for wname, w in WRAPPERS.items():
        good = w.make()
        for arg, role in w.roles.items():
            kinds = ["float64", "float16", "int32", "non-contiguous", "list", "scalar"]
            if good[arg].ndim == 2 and good[arg].shape[0] > 1:
                kinds.append("fortran-order")
            if arg not in w.any_ndim:
                kinds.append("extra-axis")
            if arg in w.bad_shapes:
                kinds.append("wrong-shape")
            if role in ("out", "inout"):
                kinds.append("read-only")
            for kind in kinds:
                yield pytest.param(wname, arg, kind, id=f"{wname}-{arg}-{kind}")


@pytest.mark.parametrize("wname,arg,kind", list(_cases()))
def test_wrapper_rejects_bad_array(wname, arg, kind):
    w = WRAPPERS[wname]
    kw = w.make()
    if kind == "wrong-shape":
        kw[arg] = a32(*w.bad_shapes[arg])
    elif kind == "read-only":
        kw[arg] = _read_only(kw[arg])
    else:
        kw[arg] = BAD_KINDS[kind](kw[arg])
    # The message is cyformer's: it starts with the wrapper's name and names
    # the argument (a wrong shape may be reported on the argument it disagrees with).
    with pytest.raises(ValueError, match=rf"^{w.label}: ") as err:
        w(**kw)
    msg = str(err.value)
    assert re.search(rf"\b{arg}\b", msg), msg


def _overlapping(inp, out_shape):
    """(a copy of inp, an out array of out_shape) sharing exactly one float."""
    base = np.zeros(inp.size + int(np.prod(out_shape)), F32)
    a = base[:inp.size].reshape(inp.shape)
    a[...] = inp
    o = base[inp.size - 1: inp.size - 1 + int(np.prod(out_shape))].reshape(out_shape)
    return a, o



def _overlap_cases():
    for wname, w in WRAPPERS.items():
        for o, role in w.roles.items():
            if role not in ("out", "inout"):
                continue
            for i in w.roles:
                if i == o or (w.roles[i] in ("out", "inout") and i < o):
                    continue  # each pair of outputs once
                yield pytest.param(wname, o, i, id=f"{wname}-{o}-overlaps-{i}")


@pytest.mark.parametrize("wname,out_arg,in_arg", list(_overlap_cases()))
def test_wrapper_rejects_overlapping_output(wname, out_arg, in_arg):
    w = WRAPPERS[wname]
    kw = w.make()
    kw[in_arg], kw[out_arg] = _overlapping(kw[in_arg], kw[out_arg].shape)
    with pytest.raises(ValueError, match=rf"^{w.label}: .*\b{out_arg}\b.*share memory.*\b{in_arg}\b|"
                                         rf"^{w.label}: .*\b{in_arg}\b.*share memory.*\b{out_arg}\b"):
        w(**kw)



SCALAR_CASES = [
    # wrapper, argument, bad value, regex the message must match (after "<wrapper>: ")
    *[(w, "threads", v, "threads") for w in WRAPPERS if w != "dot" for v in (0, -1, 1.5, "2", True)],
    ("linear", "activation", "relu", "activation"),
    ("linear", "activation", None, "activation"),
    ("linear", "activation", ["gelu"], "activation"),
    ("mlp", "activation", "tanh", "activation"),
    ("mlp", "activation", {}, "activation"),
    ("gelu", "kind", "relu", "kind"),
    ("gelu", "kind", None, "kind"),
    ("gelu", "kind", ["gelu"], "kind"),
    ("layer_norm", "eps", -1.0, "eps"),
    ("layer_norm", "eps", float("nan"), "eps"),
    ("layer_norm", "eps", float("inf"), "eps"),
    *[("layer_norm", "eps", v, "eps") for v in ("abc", None, [1e-5])],
    ("attention", "past", -1, "past"),
    ("attention", "past", CAP, "past"),
    ("attention", "past", 1.5, "past"),
    ("attention", "past", None, "past"),
    ("attention", "past", "0", "past"),
    ("embedding", "pos0", -1, "pos0|positions"),
    ("embedding", "pos0", P, "pos0|positions"),
    *[("embedding", "pos0", v, "pos0") for v in (1.5, None, "1")],
    ("embedding", "ids", np.array([1.0, 2.0, 3.0]), "ids"),
    ("embedding", "ids", np.array([True, False, True]), "ids"),
    ("embedding", "ids", np.array([[1, 2, 3]]), "ids"),
    ("embedding", "ids", np.array([1, 2, V]), "ids.*11"),
    ("embedding", "ids", np.array([1, -1, 3]), "ids.*-1"),
    ("embedding", "ids", np.array([1, 2, 2**63 + 5], np.uint64), "ids"),
    ("embedding", "ids", [[1], [2, 3]], "ids"),
    ("embedding", "ids", None, "ids"),
    *[("decode_step", "token", v, "token") for v in (-1, V, 1.5, None, "3", np.int64(2**40))],
    *[("decode_step", "past", v, "past") for v in (-1, CAP, 1.5, None, "0")],
    *[(w, "workspace", v, "workspace") for w in ("linear", "mlp", "attention")
      for v in (np.zeros(64, np.float32), "ws", 1)],
    ("linear", "accumulate", True, "accumulate"),  # needs out: the case drops it
    ("mlp", "accumulate", True, "accumulate"),
]


@pytest.mark.parametrize("wname,arg,value,match", SCALAR_CASES)
def test_wrapper_rejects_bad_scalar(wname, arg, value, match):
    w = WRAPPERS[wname]
    kw = w.make()
    kw[arg] = value
    if arg == "accumulate":
        del kw["out"]
    with pytest.raises(ValueError, match=rf"^{w.label}: .*({match})"):
        w(**kw)


_CHILD = """
import sys, numpy as np
from cyformer.kernels import activations
try:
    activations.gelu_inplace(np.ones(4, np.float32), threads=int(sys.argv[1]))
    print("accepted")
except ValueError as e:
    print("ValueError", e)
"""


def test_absurd_thread_count_is_refused_not_a_crash():
    """Run in a child process: the unguarded case kills the interpreter."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", _CHILD, "100000"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-500:]}"
    assert r.stdout.startswith("ValueError gelu: threads"), r.stdout


# Model-level arguments ------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return cyformer.load(write_checkpoint(tmp_path_factory.mktemp("robust-model")))


@pytest.mark.parametrize("ids,match", [
    ([7], "7"), ([0, 6, 7], "7"), (np.array([-(2**63)]), "-9223372036854775808"),
    (np.array([2**64 - 1], np.uint64), "18446744073709551615"), ([2**80], "integer"),
    (np.array([1, 2], np.float16), "float16"), (np.array([0.0]), "float64"), (np.array([1j]), "complex"),
    (np.zeros((1, 1, 1), int), "1-D"), (np.zeros((2, 2, 2, 2), int), "1-D"),
    (None, "integer"), ("abc", "integer"), (b"\x01", "integer"), ([[1], [1, 2]], "integer"),
    ([1, None], "integer"), (np.zeros((0, 3), int), "at least one"), (np.zeros(6, int), "n_positions"),
    (np.zeros((2, 0), int), "at least one"),
])
def test_forward_rejects_bad_ids(model, ids, match):
    with pytest.raises(ValueError, match=rf"^forward: .*{match}"):
        model.forward(ids)


@pytest.mark.parametrize("prompt,match", [
    (np.array([1.0, 2.0]), "float64"), (np.array([True]), "bool"), (np.zeros((1, 1, 2), int), "1-D"),
    (None, "integer"), (5, "1-D"), (b"\x01", "integer"), ([1, -3], "-3"),
    (np.array([], np.int64), "at least one"),
    # (lists of prompts and 2-D ids are batches: tests/test_engine.py)
])
def test_generate_rejects_bad_prompt(model, prompt, match):
    for call in (model.generate, model.stream):
        with pytest.raises(ValueError, match=rf"prompt.*{match}|{match}.*prompt"):
            call(prompt)


def test_empty_text_prompt(model):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        model.generate("")


@pytest.mark.parametrize("kw", [
    dict(temperature=float("inf")), dict(temperature=-float("inf")), dict(temperature="1"),
    dict(temperature=None), dict(temperature=True), dict(temperature=-1e-300),
    dict(top_k=-1), dict(top_k=1.5), dict(top_k=True), dict(top_k="3"), dict(top_k=float("nan")),
    dict(top_p=-0.1), dict(top_p=1.0001), dict(top_p=float("nan")), dict(top_p=float("inf")),
    dict(top_p="0.5"), dict(top_p=True),
    dict(repetition_penalty=-1.0), dict(repetition_penalty=float("nan")),
    dict(repetition_penalty=float("inf")), dict(repetition_penalty="1.2"), dict(repetition_penalty=True),
    dict(seed=1.5), dict(seed="x"), dict(seed=True), dict(seed=float("nan")),
    dict(max_new_tokens=None), dict(max_new_tokens=True), dict(max_new_tokens="3"),
    dict(max_new_tokens=float("nan")),
    dict(stop=[None]), dict(stop=[1.5]), dict(stop=[""]), dict(stop=[True]),
    dict(stop=3.5), dict(stop=object()),
], ids=lambda kw: "-".join(f"{k}={v!r}" if "0x" not in repr(v) else f"{k}={type(v).__name__}"
                           for k, v in kw.items()))
def test_generate_rejects_bad_parameters(model, kw):
    (name, _), = kw.items()
    for call in (model.generate, model.stream):
        with pytest.raises(ValueError, match=name):
            call([1, 2], **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(threads=0), "threads"), (dict(threads="2"), "threads"), (dict(threads=2.0), "threads"),
    (dict(backend="torch"), "backend"),
    (dict(backend=["cython"]), "backend"),
])
def test_load_rejects_bad_arguments(tiny, kw, match):
    with pytest.raises(ValueError, match=match):
        cyformer.load(tiny, **kw)


@pytest.mark.parametrize("path", [5, 1.5, ["a"]])
def test_load_rejects_non_path(path):
    with pytest.raises((ValueError, CyformerError), match="path"):
        cyformer.load(path)


# ---------------------------------------------------------------------------
# 3. Threads sharing one model

JOBS = [
    ([1, 2, 3], dict(max_new_tokens=20)),
    ([4], dict(max_new_tokens=25, temperature=0.9, seed=1)),
    ([5, 6, 0, 2], dict(max_new_tokens=15, temperature=1.3, top_k=5, seed=2)),
    ([3, 3, 3], dict(max_new_tokens=25, temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=3)),
    ([9, 8, 7, 6, 5], dict(max_new_tokens=20, temperature=1.0, seed=4)),
    ([10], dict(max_new_tokens=30)),
]


def _run_job(m, job, mode):
    prompt, kw = job
    if mode == "stream":
        return list(m.stream(prompt, **kw))
    if mode == "forward":
        return m.forward(prompt).tobytes()
    return list(m.generate(prompt, **kw))


@pytest.mark.parametrize("kernel_threads,modes,rounds", [
    (1, ("generate", "stream", "forward"), 2),
    (2, ("generate",), 1),  # an OpenMP team per Python thread: oversubscribed, so kept short
])
def test_threads_generating_on_one_model_match_sequential(checkpoint, kernel_threads, modes, rounds):
    """6 Python threads, each running every job ``rounds`` times in its own
    order, all on one Model, released together by a barrier."""
    path, _ = checkpoint("erf")
    m = cyformer.load(path, threads=kernel_threads)
    want = {(j, mode): _run_job(m, JOBS[j], mode) for j in range(len(JOBS)) for mode in modes}
    n_threads = 6
    start = threading.Barrier(n_threads)
    got, errors = [], []

    def worker(t):
        try:
            start.wait()
            order = np.random.default_rng(t).permutation(len(JOBS) * len(modes) * rounds)
            for i in order:
                j, mode = (i // len(modes)) % len(JOBS), modes[i % len(modes)]
                got.append(((j, mode), _run_job(m, JOBS[j], mode)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not errors, errors
    assert len(got) == n_threads * rounds * len(JOBS) * len(modes)
    for key, result in got:
        assert result == want[key], f"job {key} differs when run concurrently"


# ---------------------------------------------------------------------------
# 4. Memory

# Big enough that a leak shows: one model is ~0.7 MB of weights and every
# generation allocates a ~1 MB KV cache (n_positions = 1024), so leaking
# either per call would exceed the bound many times over.
LEAK_GEOMETRY = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=1024, n_inner=None)
RSS_BOUND_MB = 20


def _rss_mb():
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


@pytest.fixture(scope="module")
def leak_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("leak")
    return write_checkpoint(path, tensors=tiny_tensors(LEAK_GEOMETRY),
                            config=dict(LEAK_GEOMETRY, bos_token_id=None, eos_token_id=None))


def test_generating_5000_tokens_leaves_rss_flat(leak_ckpt):
    pytest.importorskip("psutil")
    m = cyformer.load(leak_ckpt, threads=1)

    def chunk(i):
        kw = dict(max_new_tokens=25, temperature=0.0 if i % 2 else 0.8, seed=i)
        if i % 3 == 0:
            return len(list(m.stream([i % 97, 3], **kw)))
        return len(m.generate([i % 97, 3], **kw))

    for i in range(20):  # warm-up: allocator pools, first-call caches
        chunk(i)
    before = _rss_mb()
    total = sum(chunk(i) for i in range(200))
    grown = _rss_mb() - before
    assert total == 5000
    assert grown < RSS_BOUND_MB, f"RSS grew by {grown:.1f} MB over {total} generated tokens"


def test_loading_and_dropping_50_models_leaves_rss_flat(leak_ckpt):
    pytest.importorskip("psutil")
    for _ in range(5):  # warm-up
        cyformer.load(leak_ckpt, threads=1).forward([1, 2, 3])
    before = _rss_mb()
    for _ in range(50):
        m = cyformer.load(leak_ckpt, threads=1)
        m.forward([1, 2, 3])
        del m
    grown = _rss_mb() - before
    assert grown < RSS_BOUND_MB, f"RSS grew by {grown:.1f} MB over 50 loads"
