"""GGUF files for the tests, made here from random-weight checkpoints: no downloads.

``gguf_from`` writes a loaded cyformer model with cyformer's writer;
``rewrite`` copies a GGUF file changing its metadata, tensors or types (the
``gguf`` package's writer), for the k-quants (``q4_k_blocks``: a plain
Q4_K quantizer, since the package has none) and for broken files.
"""

import numpy as np

TOKENIZER_TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "   leading spaces,\ttabs\t\tand   runs    of  spaces\n\n\n\nnewlines\r\n",
    "digits 0 12 345 6789 1234567890 3.14159e-10 0x1F",
    "unicode: naïve café Ω≈ç√∫ 日本語のテキスト 🙂🚀 Ελληνικά русский عربى",
    "I'm sure they'll've done it; WE'RE DONE. it's ok 'quoted' \"double\"",
    "<|endoftext|>special in text<|endoftext|> and after",
    "",
    " ",
    "x" * 300,
    "e\u0301 composed vs \u00e9 precomposed; Å vs A\u030a",
]


def gguf_from(model, path, dtype="f32"):
    return model.save(str(path), format="gguf", dtype=dtype)


def rewrite(src, dst, *, drop_keys=(), set_keys=None, tensors=None, drop_tensors=()):
    """Copy the GGUF file src to dst with metadata keys dropped or set
    ({key: (value, GGUFValueType)}) and tensors replaced ({name: (data,
    GGMLQuantizationType)}, data as the writer takes it)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for key, (value, vtype) in set_keys.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType.STRING)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if tensors and t.name in tensors:
            data, qtype = tensors[t.name]
        else:
            data, qtype = np.asarray(t.data), t.tensor_type
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.ascontiguousarray(data))
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def float_tensor(path, name):
    """A tensor of a GGUF file dequantized to float32 (numpy shape)."""
    import gguf

    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


def q4_k_blocks(w):
    """float32 rows [N, K] (K a multiple of 256) -> Q4_K blocks [N, K/256 * 144].

    A plain quantizer (not llama.cpp's search): each sub-block of 32 gets
    scale (max - min) / 15 and min -min (min <= 0), both 6-bit multiples of
    the super-block's fp16 d and dmin; codes round to nearest in [0, 15].
    Layout as ggml's block_q4_K: d, dmin, 12 bytes of packed 6-bit scales
    and mins, 128 bytes of codes (per 64 weights: 32 bytes, the first 32 in
    the low nibbles, the next 32 in the high)."""
    N, K = w.shape
    x = w.astype(np.float32).reshape(N, K // 256, 8, 32)
    lo = np.minimum(x.min(axis=3), 0)                       # [N, S, 8]
    hi = x.max(axis=3)
    scale = (hi - lo) / 15
    mins = -lo
    d = (scale.max(axis=2) / 63).astype(np.float16)          # [N, S]
    dmin = (mins.max(axis=2) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, 15)
    q = q.astype(np.uint8)                                   # [N, S, 8, 32]
    packed = np.zeros((N, K // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    pairs = q.reshape(N, K // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(N, K // 256, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(N, -1, 2), dmin.view(np.uint8).reshape(N, -1, 2),
                             packed, qs], axis=2)
    return blocks.reshape(N, -1)


def random_blocks(rng, qtype, N, K, rms):
    """Random bytes as [N, K] weights of a k-quant type (every bit pattern is
    a valid block), their fp16 scales set so the weights' RMS is about rms."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    # fp16 scale fields: d (and dmin) at the start of Q4_K/Q5_K, d at the end of Q6_K
    fields = [slice(size - 2, size)] if qtype == gguf.GGMLQuantizationType.Q6_K else [slice(0, 2), slice(2, 4)]
    for f in fields:
        raw[:, :, f] = np.full(raw.shape[:2], 1.0, dtype=np.float16)[..., None].view(np.uint8)
    now = np.sqrt(np.mean(gguf.quants.dequantize(raw.reshape(N, -1), qtype) ** 2))
    for f in fields:
        raw[:, :, f] = np.full(raw.shape[:2], rms / now, dtype=np.float16)[..., None].view(np.uint8)
    return raw.reshape(N, -1)
