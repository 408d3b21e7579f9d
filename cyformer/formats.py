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
                     two weights a byte (nibble = q + 8)

int8 takes one scale per output rather than per block of 32 inputs: the
scale then multiplies a whole dot product once (one multiply per output, not
per block), and on the bundled model and GPT-2-sized random weights the
per-output form's error was within the int8 bounds the tests set.  int4
needs groups: one scale for 768 inputs leaves too few levels for the many
small weights.

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


def _outputs_last(w, transposed):
    """w with outputs on the last axis ([K, N]) for the scale arithmetic."""
    return w.T if transposed else w


def quantize(w, fmt, transposed=False):
    """float32 matrix -> Packed (or w itself for "float32")."""
    if fmt == "float32":
        return w
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a matrix, got shape {w.shape}")
    shape = tuple(w.shape)
    if fmt == "bfloat16":
        u = w.view(np.uint32)
        # round to nearest, ties to even; NaN stays NaN (quiet)
        rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(w)
        if nan.any():
            rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return _frozen(Packed(fmt, rounded, None, shape, transposed))
    x = _outputs_last(w, transposed).astype(np.float64)  # [K, N]
    K, N = x.shape
    if fmt == "int8":
        amax = np.abs(x).max(axis=0)                                   # [N]
        scale = (amax / 127.0).astype(np.float32)
        safe = np.where(scale > 0, scale, 1).astype(np.float64)
        q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)      # [K, N]
        data = np.ascontiguousarray(q.T if transposed else q)
        return _frozen(Packed(fmt, data, scale, shape, transposed))
    ng = -(-K // GROUP)
    pad = ng * GROUP - K
    xp = np.concatenate([x, np.zeros((pad, N))]) if pad else x
    g = xp.reshape(ng, GROUP, N)
    amax = np.abs(g).max(axis=1)                                       # [ng, N]
    scale = (amax / 7.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float64)
    q = np.clip(np.rint(g / safe[:, None, :]), -8, 7).reshape(ng * GROUP, N)[:K + (K % 2)]
    if K % 2 and not pad:
        q = np.concatenate([q, np.zeros((1, N))])
    nib = (q + 8).astype(np.uint8)                                     # [K (even), N]
    packed = nib[0::2] | (nib[1::2] << 4)                              # [K/2, N]
    if transposed:
        return _frozen(Packed(fmt, np.ascontiguousarray(packed.T), np.ascontiguousarray(scale.T),
                              shape, True))
    return _frozen(Packed(fmt, np.ascontiguousarray(packed), scale, shape, False))


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
