"""Weights in fewer bytes: bfloat16, int8 and int4 matrices.

Decode reads every weight once per token, so at a fixed memory bandwidth the
bytes per weight set the speed.  A ``Packed`` matrix holds one weight matrix
in a smaller format; the kernels widen it to float32 in registers (the
matrix-vector path of decode) or while packing GEMM panels (prefill), so
activations, norms, biases and the KV cache stay float32.

Formats (bytes per weight, GPT-2 small's 124M weights):

    float32   4                                        497 MB
    bfloat16  2      the top half of the float32 (round to nearest even)
    int8      1      symmetric, one float32 scale per output (row of the
                     output dimension): w = q * scale, q in [-127, 127]
    int4      0.5    symmetric, one float32 scale per output and group of
                     32 consecutive inputs: w = q * scale, q in [-8, 7],
                     two weights a byte (nibble = q + 8), each group's
                     scale the one of max|w| / 6 .. max|w| / 8.5 with the
                     least squared error (_int4_scale); the embedding and
                     unembedding in int8 (matrix_format)

int8 takes one scale per output rather than per block of 32 inputs: the
scale then multiplies a whole dot product once (one multiply per output, not
per block), and on the bundled model and GPT-2-sized random weights the
per-output form's error was within the int8 bounds the tests set.  int4
needs groups: one scale for 768 inputs leaves too few levels for the many
small weights.

int4's scale is searched rather than max|w| / 7: with 16 levels the grid
matters, and a finer one that clips the group's largest weight (or a
coarser one) often fits its other 31 weights better.  On the bundled model
the search took int4's held-out perplexity from +2.3 % of float32 to +1.0 %
and top-1 agreement from 91.8 % to 92.4 %, for a few seconds more of
conversion (GPT-2 small: 2.2 s against 0.4 s).  The format is unchanged:
a file with max|w| / 7 scales loads and runs as before.

An int4 model keeps its embedding and unembedding (the [V, C] matrices) in
int8.  They carry most of int4's error: on the bundled model, int4 in them
alone raised held-out perplexity 6.3 % and cut top-1 agreement with float32
to 89 %, int4 in every other matrix 2.2 % and 92 %; with them in int8 the
whole model measured +2.3 % and 92 % (before the scale search).  llama.cpp's 4-bit types likewise
keep the output matrix at a higher precision.

Orientation: block matrices are stored [K, N] (inputs, outputs) like the
float32 kernel layout; the embedding / unembedding [V, C] is stored as is,
a row per token (``transposed``): its rows are what the embedding looks up
and what the unembedding's outputs read.  Groups and pairs always run along
the input dimension.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

FORMATS = ("float32", "bfloat16", "int8", "int4")
GROUP = 32  # int4 inputs per scale (simd.h's CYF_GROUP)
BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True, eq=False)
class Packed:
    """A weight matrix in a smaller format.

    shape: the float matrix's shape, [K, N], or [N, K] when ``transposed``
    (a row per output).  data: uint16 (bfloat16), int8, or uint8 holding two
    int4 weights a byte, paired along the input dimension.  scale: float32
    [N] (int8) or per output and group ([K/32, N], or [N, K/32] when
    transposed) for int4; None for bfloat16.
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
    that int4 keeps the [V, C] embedding and unembedding (transposed) in int8."""
    return "int8" if dtype == "int4" and transposed else dtype


def packed_layout(fmt, shape, transposed=False):
    """(data shape, data dtype, scale shape or None) of a [rows, cols] float
    matrix converted to fmt (see Packed)."""
    rows, cols = shape
    K, N = (cols, rows) if transposed else (rows, cols)
    if fmt == "bfloat16":
        return tuple(shape), np.uint16, None
    if fmt == "int8":
        return tuple(shape), np.int8, (N,)
    if fmt != "int4":
        raise ValueError(f"packed_layout: format must be one of {', '.join(FORMATS[1:])}, got {fmt!r}")
    pairs, groups = -(-K // 2), -(-K // GROUP)
    return ((N, pairs), np.uint8, (N, groups)) if transposed else ((pairs, N), np.uint8, (groups, N))


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
    if p.fmt == "int4" and not p.transposed:
        step = -(-step // GROUP) * GROUP
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def quantize(w, fmt, transposed=False):
    """float32 matrix -> Packed (or w itself for "float32"), converted a step
    of rows at a time (see ``convert``)."""
    if fmt == "float32":
        return w
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
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
    if fmt == "int8" and not transposed:  # a scale per column: the maximum over every row first
        amax = np.zeros(shape[1], dtype=np.float32)
        for first, end in steps:
            np.maximum(amax, np.abs(rows(first, end)).max(axis=0), out=amax)
        out.scale[...] = _scale(amax, 127)
    for first, end in steps:
        _convert_step(out, rows(first, end), first)
    return _frozen(out)


def _convert_step(p, x, first):
    """Convert rows first .. first + len(x) (float32 x) into the Packed p.

    Where rows are int4 inputs, first starts a group of 32 (row_steps);
    where they are int8 inputs, p.scale is already set (convert)."""
    r = x.shape[0]
    if p.fmt == "bfloat16":
        p.data[first:first + r] = _bfloat16(x)
    elif p.fmt == "int8":
        if p.transposed:  # rows are outputs: a scale per row
            scale = _scale(np.abs(x).max(axis=1), 127)
            p.scale[first:first + r] = scale
            p.data[first:first + r] = _codes(x, _divisor(scale)[:, None], -127, 127).astype(np.int8)
        else:
            p.data[first:first + r] = _codes(x, _divisor(p.scale)[None, :], -127, 127).astype(np.int8)
    elif p.transposed:  # int4, rows are outputs: groups and pairs along each row
        K = x.shape[1]
        ng = -(-K // GROUP)
        g = np.zeros((r, ng, GROUP))                                   # the row padded to whole groups
        g.reshape(r, ng * GROUP)[:, :K] = x
        scale = _int4_scale(g, axis=2)                                 # [r, ng]
        q = _codes(g, _divisor(scale)[:, :, None], -8, 7, out=g).reshape(r, ng * GROUP)
        p.scale[first:first + r] = scale
        p.data[first:first + r] = _nibble_pairs(q[:, :2 * p.data.shape[1]], axis=1)
    else:  # int4, rows are inputs: groups and pairs down each column
        N = x.shape[1]
        ng = -(-r // GROUP)
        g = np.zeros((ng, GROUP, N))
        g.reshape(ng * GROUP, N)[:r] = x
        scale = _int4_scale(g, axis=1)                                 # [ng, N]
        q = _codes(g, _divisor(scale)[:, None, :], -8, 7, out=g).reshape(ng * GROUP, N)
        g0 = first // GROUP
        p.scale[g0:g0 + ng] = scale
        p.data[first // 2:first // 2 + -(-r // 2)] = _nibble_pairs(q[:r + r % 2], axis=0)


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


# int4 scales tried per group, max|w| / c (see the module's docstring); 11
# steps measured as well as 21 on the bundled model and better than 6.
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


def _outputs_last(w, transposed):
    """w with outputs on the last axis ([K, N]) for the scale arithmetic."""
    return w.T if transposed else w


def dequantize(p):
    """Packed -> float32 matrix of p.shape."""
    if not isinstance(p, Packed):
        return p
    if p.fmt == "bfloat16":
        return (p.data.astype(np.uint32) << 16).view(np.float32).reshape(p.shape)
    if p.fmt == "int8":
        q = _outputs_last(p.data, p.transposed).astype(np.float32)
        w = q * p.scale[None, :]
    else:
        packed = _outputs_last(p.data, p.transposed)                   # [K/2, N]
        K = p.shape[1] if p.transposed else p.shape[0]
        q = np.empty((packed.shape[0] * 2, packed.shape[1]), dtype=np.float32)
        q[0::2] = (packed & 15).astype(np.float32) - 8
        q[1::2] = (packed >> 4).astype(np.float32) - 8
        q = q[:K]
        scale = _outputs_last(p.scale, p.transposed)                   # [ng, N]
        w = q * np.repeat(scale, GROUP, axis=0)[:K]
    w = np.ascontiguousarray(w.T if p.transposed else w, dtype=np.float32)
    return w


def _frozen(p):
    p.data.flags.writeable = False
    if p.scale is not None:
        p.scale.flags.writeable = False
    return p


def check_format(fn, fmt):
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"{fn}: dtype must be one of {', '.join(repr(f) for f in FORMATS)}, got {fmt!r}")
    return fmt
