"""Layer norm (GPT-2) and RMSNorm (Llama), one row (position) at a time."""

from cython.parallel cimport prange
from libc.math cimport sqrt

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr

from .simd cimport cyf_sum_f64, cyf_sqdev_f64

from cyformer import _checks

cnp.import_array()


cdef void ln_row(float* out, const float* x, const float* g, const float* b,
                 Py_ssize_t C, float eps, float* scale) noexcept nogil:
    cdef Py_ssize_t c
    cdef double mean, var, s
    cdef float mu, rstd
    # Two passes in double: exact enough that a constant row gives var = 0
    # (no cancellation).  Each pass sums eight interleaved lanes (simd.h),
    # so the order is fixed per row and the adds do not wait on each other.
    mean = cyf_sum_f64(x, C) / C
    var = cyf_sqdev_f64(x, C, mean) / C
    s = sqrt(var + eps)
    if scale != NULL:
        scale[0] = <float>s
    mu = <float>mean
    rstd = <float>(1.0 / s)
    for c in range(C):
        out[c] = (x[c] - mu) * rstd * g[c] + b[c]


cdef void rms_row(float* out, const float* x, const float* g, Py_ssize_t C, float eps,
                  float* scale) noexcept nogil:
    cdef Py_ssize_t c
    # the sum of squares in double over eight lanes, as layer norm's variance
    cdef double s = sqrt(cyf_sqdev_f64(x, C, 0.0) / C + eps)
    if scale != NULL:
        scale[0] = <float>s
    cdef float rstd = <float>(1.0 / s)
    for c in range(C):
        out[c] = x[c] * rstd * g[c]


cdef void norm_rows(int kind, float* out, const float* x, const float* g, const float* b,
                    Py_ssize_t T, Py_ssize_t C, float eps, float* scale,
                    int nthreads) noexcept nogil:
    cdef Py_ssize_t t
    if T <= 0:
        return
    # never more threads than rows: a decode step's single row stays on one
    # thread instead of waking the team
    for t in prange(T, num_threads=nthreads if nthreads < T else <int>T, schedule="static"):
        norm_row(kind, out + t * C, x + t * C, g, b, C, eps, scale + t if scale != NULL else NULL)


cdef void layer_norm(float* out, const float* x, const float* g, const float* b,
                     Py_ssize_t T, Py_ssize_t C, float eps, float* scale,
                     int nthreads) noexcept nogil:
    norm_rows(NORM_LAYER, out, x, g, b, T, C, eps, scale, nthreads)


KINDS = {"layer_norm": NORM_LAYER, "rms_norm": NORM_RMS}


def layer_norm_forward(x, g, b, eps=1e-5, out=None, scale=None, threads=None):
    """Layer norm over the last axis: x [T, C], g [C], b [C] -> out [T, C].

    scale: optional float32 [T] that receives sqrt(var + eps) per row.
    """
    return norm_forward("layer_norm", x, g, b, eps, out, scale, threads)


def rms_norm_forward(x, g, eps=1e-6, out=None, scale=None, threads=None):
    """RMSNorm over the last axis: x [T, C], g [C] -> out [T, C] =
    x / sqrt(mean(x^2) + eps) * g.  scale: optional float32 [T] that
    receives the denominator per row."""
    return norm_forward("rms_norm", x, g, None, eps, out, scale, threads)


def norm_forward(kind, x, g, b, eps, out=None, scale=None, threads=None):
    """Either normalisation by name ("layer_norm" needs b, "rms_norm" has none)."""
    if kind not in KINDS:
        raise ValueError(f"norm: kind must be one of {sorted(KINDS)}, got {kind!r}")
    fn = kind
    cdef int k = KINDS[kind]
    f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1]
    f32(fn, "g", g, 1)
    _checks.same_dim(fn, "g", g, 0, C, "x.shape[1]")
    if k == NORM_LAYER:
        f32(fn, "b", b, 1)
        _checks.same_dim(fn, "b", b, 0, C, "x.shape[1]")
    elif b is not None:
        raise ValueError(f"{fn}: takes no bias")
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: eps must be a number, got {eps!r}") from None
    if not (eps >= 0.0) or eps == float("inf"):
        raise ValueError(f"{fn}: eps must be finite and >= 0, got {eps}")
    if C == 0:
        raise ValueError(f"{fn}: x has no features (C = 0)")
    if out is None:
        out = np.empty((T, C), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, C))
        _checks.no_overlap(fn, "out", out, g=g, b=b)
        # in place (out is x) is fine: each row is read in full before it is
        # written; any other overlap is not
        if np.may_share_memory(out, x) and not (
                out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
                and out.shape == x.shape):
            raise ValueError(f"{fn}: out must not share memory with x unless it is x itself")
    if scale is not None:
        f32(fn, "scale", scale, 1, True)
        _checks.shape(fn, "scale", scale, (T,))
        _checks.no_overlap(fn, "scale", scale, x=x, g=g, b=b, out=out)
    cdef int nt = _checks.threads(fn, threads)
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef const float* pg = cptr(g)
    cdef const float* pb = cptr(b)
    cdef float* ps = wptr(scale)
    cdef float e = eps
    if T:
        with nogil:
            norm_rows(k, po, px, pg, pb, T, C, e, ps, nt)
    return out
