"""Weights in fewer bytes: bfloat16, int8, int4, q8_0 and q4_0 matrices, one table row each.

Decode reads every weight once per token, so at a fixed memory bandwidth the
bytes per weight set the speed.  A ``Packed`` matrix holds one weight matrix
in a smaller format; the kernels multiply in the weights' precision where
the CPU can (int8-quantized activations against the integer formats with
AVX512-VNNI or AVX2, bf16 pairs with AVX512-BF16) and widen the weights to
float32 elsewhere; activations between products, norms, biases and the KV
cache stay float32.

Every format is one ``Format`` record in ``TABLE``: its name, stored dtype
and safetensors tag, bytes per weight, scale layout, converter and
dequantizer.  ``--dtype``, the loader, ``Model.save`` and ``cyformer info``
read the table; the kernels find the format's row of the C table
(``src_pyx/formats.h``) by the record's ``code``.

int8 keeps one scale per output (a dot product is scaled once); int4 needs a
scale per group of 32 inputs (16 levels for 768 inputs are too few), each
group's scale searched among max|w| / 6 .. 8.5 for the least squared error.
An int4 model keeps the [V, C] embedding and unembedding in int8, a q4_0
model in q8_0 (``matrix_format``, from the row's ``vocab``): they carry most of int4's error, and llama.cpp's 4-bit
types likewise keep the output matrix at a higher precision.

q8_0 is GGUF's Q8_0 exactly: per output, blocks of 32 inputs, each a
34-byte record of an fp16 scale d and 32 int8 codes (w = d * q), so a GGUF
file's Q8_0 tensors run from the file's own bytes, memory-mapped.  q4_0 is
GGUF's Q4_0 likewise: 18-byte records of an fp16 d and 16 bytes, byte j
holding code j in its low nibble and code j + 16 in its high one
(w = d * (nibble - 8)).

Orientation: block matrices are [K, N] (inputs, outputs) like the float32
kernel layout; the embedding / unembedding [V, C] is as is, a row per token
(``transposed``): its rows are what the embedding looks up and what the
unembedding's outputs read.  Groups and pairs always run along the input
dimension.  A format with ``rows_out`` (bfloat16, int8, int4, q8_0, q4_0) stores its data a
row per output whatever the matrix (GGUF's layout); ``Packed.shape`` and
``transposed`` still describe the float matrix, so callers never see the
difference, and the kernels read it as [N, K].  Decode streams such a
matrix a row at a time, each row one contiguous integer dot product
(measured on Zen 4, 2 threads, from DRAM: int8 [K, N] 13-15 GB/s, [N, K]
18-20 GB/s before the work split was evened out; int4 [K, N] 7-9 GB/s,
[N, K] 12-17 on a shared machine).
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

GROUP = 32  # int4 inputs per scale (simd.h's CYF_GROUP)


@dataclass(frozen=True, eq=False)
class Packed:
    """A weight matrix in a smaller format.

    shape: the float matrix's shape, [K, N], or [N, K] when ``transposed``
    (a row per output).  data: uint16 (bfloat16) or int8, [N, K] (a row per
    output whatever the orientation), or uint8 [N, ceil(K/2)] holding two
    int4 weights a byte, paired along the input dimension, a row per output
    whatever the orientation; q8_0: uint8 [N, K/32 * 34], a row of 34-byte
    block records per output whatever the orientation.  scale: float32 [N]
    (int8) or [N, ceil(K/32)], per output and group (int4); None for
    bfloat16 and q8_0 (its scales are inside the records).
    """

    fmt: str
    data: np.ndarray
    scale: Optional[np.ndarray]
    shape: Tuple[int, int]
    transposed: bool

    ndim = 2

    @property
    def nbytes(self):
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def __repr__(self):
        return f"<Packed {self.fmt} {self.shape[0]}x{self.shape[1]}{' (rows are outputs)' if self.transposed else ''}>"

    def dequantize(self):
        """The float32 matrix these weights stand for (a new array)."""
        return dequantize(self)

    def rows(self, idx):
        """Rows ``idx`` of a transposed matrix as float32 (the embedding lookup)."""
        if not self.transposed:
            raise ValueError("rows: only for a matrix stored a row per output")
        idx = np.asarray(idx)
        data = self.data[idx]
        scale = None if self.scale is None else self.scale[idx]
        return dequantize(Packed(self.fmt, data, scale, (len(idx), self.shape[1]), True))


# Weights per conversion step.  The codes are computed in float64, as
# rint(w / scale) always has been (a float32 quotient could round onto a
# half and tie the other way), so a step's temporaries are 8 bytes a weight:
# about 1 MB each here, not 300 MB for GPT-2's embedding converted whole.
STEP = 1 << 17


def matrix_format(dtype, transposed):
    """The format a model loaded as dtype stores one matrix in: dtype, except
    that the [V, C] embedding and unembedding (transposed) go one step up
    where the format's row says so (Format.vocab: int4 -> int8, q4_0 -> q8_0)."""
    f = TABLE.get(dtype)
    return f.vocab if transposed and f is not None and f.vocab else dtype


def packed_layout(fmt, shape, transposed=False):
    """(data shape, data dtype, scale shape or None) of a [rows, cols] float
    matrix converted to fmt (see Packed)."""
    f = format_of("packed_layout", fmt)
    if f.layout is None:
        raise ValueError(f"packed_layout: format must be one of {', '.join(PACKED)}, got {fmt!r}")
    rows, cols = shape
    K, N = (cols, rows) if transposed else (rows, cols)
    data, scale = f.layout(K, N, transposed)
    return tuple(data), f.storage, scale


def _bf16_layout(K, N, transposed):
    # a row per output in either orientation (rows_out)
    return (N, K), None


def _int8_layout(K, N, transposed):
    # a row per output in either orientation (rows_out)
    return (N, K), (N,)


def _int4_layout(K, N, transposed):
    # a row per output in either orientation (rows_out)
    return (N, -(-K // 2)), (N, -(-K // GROUP))


Q8_0_BLOCK = 32        # inputs per Q8_0 record
Q8_0_RECORD = 34       # bytes per record: fp16 d, then 32 int8 codes


def _q8_0_layout(K, N, transposed):
    # a row of records per output in either orientation (rows_out)
    if K % Q8_0_BLOCK:
        raise ValueError(f"q8_0: a matrix's inputs must be whole blocks of {Q8_0_BLOCK} (GGUF's Q8_0), "
                         f"got {K} inputs")
    return (N, K // Q8_0_BLOCK * Q8_0_RECORD), None


Q4_0_BLOCK = 32        # inputs per Q4_0 record
Q4_0_RECORD = 18       # bytes per record: fp16 d, then 16 bytes of two 4-bit codes


def _q4_0_layout(K, N, transposed):
    # a row of records per output in either orientation (rows_out)
    if K % Q4_0_BLOCK:
        raise ValueError(f"q4_0: a matrix's inputs must be whole blocks of {Q4_0_BLOCK} (GGUF's Q4_0), "
                         f"got {K} inputs")
    return (N, K // Q4_0_BLOCK * Q4_0_RECORD), None


def empty(fmt, shape, transposed=False):
    """A writable Packed to convert a [rows, cols] matrix into."""
    data_shape, data_dtype, scale_shape = packed_layout(fmt, shape, transposed)
    scale = None if scale_shape is None else np.empty(scale_shape, dtype=np.float32)
    return Packed(fmt, np.empty(data_shape, dtype=data_dtype), scale, tuple(shape), transposed)


def row_steps(p):
    """(first, end) rows of the steps that convert into p: about STEP weights
    each, whole groups of 32 when rows are inputs of an int4 matrix."""
    rows, cols = p.shape
    step = max(1, STEP // max(cols, 1))
    if not p.transposed:  # rows are inputs: whole blocks of the format's scales (or records)
        block = TABLE[p.fmt].block
        step = -(-step // block) * block
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def quantize(w, fmt, transposed=False):
    """float32 matrix -> Packed (or w itself for "float32"), converted a step
    of rows at a time (see ``convert``)."""
    if format_of("quantize", fmt).convert_step is None:
        return w
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a matrix, got shape {w.shape}")
    return convert(lambda first, end: w[first:end], fmt, w.shape, transposed)


def convert(rows, fmt, shape, transposed=False, out=None):
    """A [rows, cols] float32 matrix, read a step of rows at a time, -> Packed.

    rows(first, end): float32 [end - first, cols], C-contiguous, for each
    step of row_steps in order (the loader reads them from the checkpoint,
    so the float32 matrix never exists whole); an int8 matrix with outputs
    as columns asks for every step twice, its scales needing every row
    first.  Temporaries are a step's.  out: a writable Packed of fmt, shape
    and transposed to convert into (the loader's arena); ``empty`` by default.
    """
    if out is None:
        out = empty(fmt, shape, transposed)
    elif (not isinstance(out, Packed) or (out.fmt, out.shape, out.transposed) != (fmt, tuple(shape), transposed)
          or not out.data.flags.writeable):
        raise ValueError(f"convert: out must be a writable Packed {fmt} {tuple(shape)} "
                         f"(transposed={transposed}), got {out!r}")
    steps = row_steps(out)
    f = TABLE[fmt]
    if f.column_scales is not None and not transposed:  # scales over every row first
        f.column_scales(out, rows, steps)
    for first, end in steps:
        f.convert_step(out, rows(first, end), first)
    return _frozen(out)


# Each format's convert_step(p, x, first): rows first .. first + len(x)
# (float32 x) into the Packed p.  Where rows are int4 inputs, first starts a
# group of 32 (row_steps); where they are int8 inputs, p.scale is already
# set (column_scales).

def _bfloat16_step(p, x, first):
    if p.transposed:  # rows are outputs
        p.data[first:first + x.shape[0]] = _bfloat16(x)
    else:  # rows are inputs first .. first + len(x): those columns of every output's row
        p.data[:, first:first + x.shape[0]] = _bfloat16(x).T


def _int8_column_scales(p, rows, steps):
    """int8 with outputs as columns: a scale per column, the maximum over every row."""
    amax = np.zeros(p.shape[1], dtype=np.float32)
    for first, end in steps:
        np.maximum(amax, np.abs(rows(first, end)).max(axis=0), out=amax)
    p.scale[...] = _scale(amax, 127)


def _int8_step(p, x, first):
    r = x.shape[0]
    if p.transposed:  # rows are outputs: a scale per row
        scale = _scale(np.abs(x).max(axis=1), 127)
        p.scale[first:first + r] = scale
        p.data[first:first + r] = _codes(x, _divisor(scale)[:, None], -127, 127).astype(np.int8)
    else:  # rows are inputs first .. first + r: those columns of every output's row
        p.data[:, first:first + r] = _codes(x, _divisor(p.scale)[None, :], -127, 127).astype(np.int8).T


def _int4_step(p, x, first):
    r = x.shape[0]
    if p.transposed:  # rows are outputs: groups and pairs along each row
        K = x.shape[1]
        ng = -(-K // GROUP)
        g = np.zeros((r, ng, GROUP))                                   # the row padded to whole groups
        g.reshape(r, ng * GROUP)[:, :K] = x
        scale = _int4_scale(g, axis=2)                                 # [r, ng]
        q = _codes(g, _divisor(scale)[:, :, None], -8, 7, out=g).reshape(r, ng * GROUP)
        p.scale[first:first + r] = scale
        p.data[first:first + r] = _nibble_pairs(q[:, :2 * p.data.shape[1]], axis=1)
    else:  # rows are inputs first .. first + r (whole groups): those pairs and groups of every output's row
        N = x.shape[1]
        ng = -(-r // GROUP)
        g = np.zeros((ng, GROUP, N))
        g.reshape(ng * GROUP, N)[:r] = x
        scale = _int4_scale(g, axis=1)                                 # [ng, N]
        q = _codes(g, _divisor(scale)[:, None, :], -8, 7, out=g).reshape(ng * GROUP, N)
        g0 = first // GROUP
        p.scale[:, g0:g0 + ng] = scale.T
        p.data[:, first // 2:first // 2 + -(-r // 2)] = _nibble_pairs(q[:r + r % 2], axis=0).T


def _q8_0_step(p, x, first):
    r = x.shape[0]
    if p.transposed:  # rows are outputs: whole rows of records
        p.data[first:first + r] = q8_0_records(x)
    else:  # rows are inputs first .. first + r (whole blocks): those records of every output
        c0 = first // Q8_0_BLOCK * Q8_0_RECORD
        p.data[:, c0:c0 + r // Q8_0_BLOCK * Q8_0_RECORD] = q8_0_records(np.ascontiguousarray(x.T))


def q8_0_records(x):
    """float32 [n, K] (K a multiple of 32) -> uint8 [n, K/32 * 34] Q8_0
    records, ggml's quantize_row_q8_0_ref bit for bit: d = max|w| / 127 and
    q = roundf(w * (1 / d)) (halves away from zero) in float32, d stored as
    fp16 (to nearest even); an all-zero block gets d = 0 and q = 0."""
    x = np.asarray(x, dtype=np.float32)
    n, K = x.shape
    b = x.reshape(n, K // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        v = b * inv
        a = np.abs(v)
        fl = np.floor(a)
        q = np.sign(v) * (fl + np.floor(2 * (a - fl)))          # roundf, as gguf.quants' np_roundf
        q = np.where(np.isfinite(q), q, 0).astype(np.int8)
    out = np.empty((n, K // Q8_0_BLOCK, Q8_0_RECORD), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(n, -1)


def q8_0_split(data):
    """uint8 records [n, K/32 * 34] -> (codes int8 [n, K/32, 32], d float32 [n, K/32]) (views where possible)."""
    rec = np.asarray(data).reshape(data.shape[0], -1, Q8_0_RECORD)
    d = np.ascontiguousarray(rec[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
    return rec[:, :, 2:].view(np.int8), d


def q8_0_finite(data):
    """True when every record's fp16 scale in data (uint8 [n, K/32 * 34]) is
    finite (block_scales_finite)."""
    return block_scales_finite("q8_0", data)


def _q4_0_step(p, x, first):
    r = x.shape[0]
    if p.transposed:  # rows are outputs: whole rows of records
        p.data[first:first + r] = q4_0_records(x)
    else:  # rows are inputs first .. first + r (whole blocks): those records of every output
        c0 = first // Q4_0_BLOCK * Q4_0_RECORD
        p.data[:, c0:c0 + r // Q4_0_BLOCK * Q4_0_RECORD] = q4_0_records(np.ascontiguousarray(x.T))


def q4_0_records(x):
    """float32 [n, K] (K a multiple of 32) -> uint8 [n, K/32 * 18] Q4_0
    records, ggml's quantize_row_q4_0_ref bit for bit: max the block's value
    of largest magnitude (the first), d = max / -8, id = 1 / d and
    q = min(15, trunc(w * id + 8.5)) in float32, d stored as fp16 (to nearest
    even); byte j holds code j in its low nibble, code j + 16 in its high
    nibble; an all-zero block gets d = 0 and codes 8 (w = 0)."""
    x = np.asarray(x, dtype=np.float32)
    n, K = x.shape
    b = x.reshape(n, K // Q4_0_BLOCK, Q4_0_BLOCK)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=2)[:, :, None], axis=2)
    d = (mx / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        v = np.trunc(b * inv + np.float32(8.5))
        q = np.where(np.isfinite(v), np.clip(v, 0, 15), 8).astype(np.uint8)
    out = np.empty((n, K // Q4_0_BLOCK, Q4_0_RECORD), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8)
    out[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))
    return out.reshape(n, -1)


def q4_0_split(data):
    """uint8 records [n, K/32 * 18] -> (codes int8 [n, K/32, 32] in [-8, 7], d float32 [n, K/32])."""
    rec = np.asarray(data).reshape(data.shape[0], -1, Q4_0_RECORD)
    d = np.ascontiguousarray(rec[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
    nib = rec[:, :, 2:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.int8) - np.int8(8)
    return q, d


def block_scales_finite(fmt, data):
    """True when every record's fp16 scale in data (uint8 [n, records]) of a
    block format (q8_0, q4_0) is finite: its exponent bits (0x7C of the high
    byte) not all ones."""
    size = TABLE[fmt].record
    hi = np.asarray(data).reshape(data.shape[0], -1, size)[:, :, 1]
    return not ((hi & 0x7C) == 0x7C).any()


def _bfloat16(x):
    """float32 -> the top half, rounded to nearest, ties to even; NaN stays NaN (quiet)."""
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def _scale(amax, qmax):
    """float32 scales amax / qmax (amax: the largest |w| each scale covers)."""
    return (amax.astype(np.float64) / qmax).astype(np.float32)


# int4 scales tried per group, max|w| / c; 11 steps measured as well as 21
# on the bundled model and better than 6.
INT4_DIVISORS = tuple(6 + 0.25 * i for i in range(11))


def _int4_scale(g, axis):
    """Per group of g (float64, groups along axis): the float32 scale
    max|w| / c, c in INT4_DIVISORS, whose codes rint(w / scale) clipped to
    [-8, 7] have the least squared error; the first such c on a tie (and
    for NaN or infinite groups, whose errors do not compare)."""
    amax = np.abs(g).max(axis=axis)
    best = err = None
    q = np.empty_like(g)  # one buffer for every candidate's codes and errors
    for c in INT4_DIVISORS:
        scale = _scale(amax, c)
        np.copyto(q, g)
        _codes(q, np.expand_dims(_divisor(scale), axis), -8, 7, out=q)
        np.multiply(q, np.expand_dims(scale.astype(np.float64), axis), out=q)
        np.subtract(q, g, out=q)
        e = np.square(q, out=q).sum(axis=axis)
        if best is None:
            best, err = scale, e
        else:
            better = e < err
            best[better], err[better] = scale[better], e[better]
    return best


def _divisor(scale):
    """The scales as float64 divisors; 1 where a scale is 0 (all-zero weights) or NaN."""
    return np.where(scale > 0, scale, 1).astype(np.float64)


def _codes(x, divisor, lo, hi, out=None):
    """rint(x / divisor) clipped to [lo, hi], in float64 (ties to even);
    out: a float64 array that holds x, overwritten."""
    q = x.astype(np.float64) if out is None else out
    np.divide(q, divisor, out=q)
    np.rint(q, out=q)
    return np.clip(q, lo, hi, out=q)


def _nibble_pairs(q, axis):
    """int4 codes (float64, an even count along axis) -> bytes holding two:
    code 2m in the low nibble, 2m + 1 in the high (nibble = code + 8)."""
    nib = (q + 8).astype(np.uint8)
    if axis == 0:
        return nib[0::2] | (nib[1::2] << 4)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def dequantize(p):
    """Packed -> float32 matrix of p.shape."""
    if not isinstance(p, Packed):
        return p
    w = TABLE[p.fmt].dequantize(p)                                     # [K, N]
    return np.ascontiguousarray(w.T if p.transposed else w, dtype=np.float32)


def _bfloat16_dequantize(p):
    return (p.data.T.astype(np.uint32) << 16).view(np.float32)          # [K, N] from rows_out's [N, K]


def _int8_dequantize(p):
    return p.data.T.astype(np.float32) * p.scale[None, :]                # [K, N] from rows_out's [N, K]


def _int4_dequantize(p):
    packed = p.data.T                                                  # [K/2, N] from rows_out's [N, K/2]
    K = p.shape[1] if p.transposed else p.shape[0]
    q = np.empty((packed.shape[0] * 2, packed.shape[1]), dtype=np.float32)
    q[0::2] = (packed & 15).astype(np.float32) - 8
    q[1::2] = (packed >> 4).astype(np.float32) - 8
    return q[:K] * np.repeat(p.scale.T, GROUP, axis=0)[:K]            # scales [ng, N]


def _q8_0_dequantize(p):
    q, d = q8_0_split(p.data)                                          # [N, K/32, 32], [N, K/32]
    w = (q.astype(np.float32) * d[:, :, None]).reshape(p.data.shape[0], -1)  # [N, K]
    return w.T                                                         # [K, N]


def _q4_0_dequantize(p):
    q, d = q4_0_split(p.data)                                          # [N, K/32, 32], [N, K/32]
    w = (q.astype(np.float32) * d[:, :, None]).reshape(p.data.shape[0], -1)  # [N, K]
    return w.T                                                         # [K, N]


def _frozen(p):
    p.data.flags.writeable = False
    if p.scale is not None:
        p.scale.flags.writeable = False
    return p


@dataclass(frozen=True)
class Format:
    """One weight format: everything outside the kernels that depends on it.

    code: the row of the C table (src_pyx/formats.h's cyf_formats[]);
    storage / tag: the stored data's NumPy dtype and safetensors tag;
    block: inputs per scale where a scale covers a block of inputs (1: none);
    scale: where the float32 scales sit, in words; layout(K, N, transposed)
    -> (data shape, scale shape or None); column_scales(p, rows, steps):
    a pass over every row first when scales span them (int8 [K, N]);
    convert_step / dequantize: see convert and dequantize.  float32 has no
    converter: its matrices stay plain arrays.  rows_out: the data is a row
    per output whatever the matrix's orientation (the kernels read [N, K]).
    vocab: the format of the [V, C] embedding and unembedding of a model
    loaded as this one, where it is a step up (they carry most of a 4-bit
    format's error; llama.cpp keeps the output matrix higher too).
    record: bytes per block record where the scales sit inside the data
    (GGUF's blocks), 0 otherwise.
    """

    name: str
    code: int
    storage: type
    tag: str
    bytes_per_weight: float
    block: int
    scale: str
    layout: Optional[Callable] = None
    column_scales: Optional[Callable] = None
    convert_step: Optional[Callable] = None
    dequantize: Optional[Callable] = None
    rows_out: bool = False
    vocab: Optional[str] = None
    record: int = 0


TABLE = {f.name: f for f in (
    Format("float32", 0, np.float32, "F32", 4.0, 1, "none"),
    Format("bfloat16", 1, np.uint16, "BF16", 2.0, 1, "none (the top half of the float32, rounded to nearest even)",
           _bf16_layout, None, _bfloat16_step, _bfloat16_dequantize, rows_out=True),
    Format("int8", 2, np.int8, "I8", 1.0, 1, "float32 per output: w = q * scale, q in [-127, 127]",
           _int8_layout, _int8_column_scales, _int8_step, _int8_dequantize, rows_out=True),
    Format("int4", 3, np.uint8, "U8", 0.5, GROUP,
           f"float32 per output and group of {GROUP} inputs: w = q * scale, q in [-8, 7], two a byte "
           "(nibble = q + 8)", _int4_layout, None, _int4_step, _int4_dequantize, rows_out=True, vocab="int8"),
    Format("q8_0", 4, np.uint8, "U8", Q8_0_RECORD / Q8_0_BLOCK, Q8_0_BLOCK,
           f"fp16 per output and block of {Q8_0_BLOCK} inputs, inside {Q8_0_RECORD}-byte records (GGUF's Q8_0: "
           "d, then 32 int8 codes; w = d * q), a row of records per output",
           _q8_0_layout, None, _q8_0_step, _q8_0_dequantize, rows_out=True, record=Q8_0_RECORD),
    Format("q4_0", 5, np.uint8, "U8", Q4_0_RECORD / Q4_0_BLOCK, Q4_0_BLOCK,
           f"fp16 per output and block of {Q4_0_BLOCK} inputs, inside {Q4_0_RECORD}-byte records (GGUF's Q4_0: "
           "d, then 16 bytes, byte j holding code j low and j + 16 high; w = d * (nibble - 8)), a row of "
           "records per output", _q4_0_layout, None, _q4_0_step, _q4_0_dequantize, rows_out=True, vocab="q8_0",
           record=Q4_0_RECORD),
)}
FORMATS = tuple(TABLE)                                                  # names, float32 first
PACKED = tuple(name for name, f in TABLE.items() if f.convert_step is not None)
BYTES = {name: f.bytes_per_weight for name, f in TABLE.items()}


def format_of(fn, fmt):
    """The Format named fmt; a ValueError naming fn and the known formats otherwise."""
    f = TABLE.get(fmt) if isinstance(fmt, str) else None
    if f is None:
        raise ValueError(f"{fn}: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return f


def check_format(fn, fmt):
    if not isinstance(fmt, str) or fmt not in TABLE:
        raise ValueError(f"{fn}: dtype must be one of {', '.join(repr(f) for f in FORMATS)}, got {fmt!r}")
    return fmt
