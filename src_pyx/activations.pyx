"""Pointwise activations (GELU in both forms) and the row softmax."""

from cython.parallel cimport prange

import numpy as np

cimport numpy as cnp

from ._util cimport f32, wptr

from cyformer import _checks

cnp.import_array()

GELU_KINDS = {"gelu_new": ACT_GELU_NEW, "gelu": ACT_GELU_ERF}


cdef enum:
    GELU_CHUNK = 4096  # floats per work item: 16 KB, a multiple of the vector width


cdef void gelu(float* x, Py_ssize_t n, int kind, int nthreads) noexcept nogil:
    cdef Py_ssize_t i, c
    if kind == ACT_GELU_ERF:
        for i in prange(n, num_threads=nthreads, schedule="static"):
            x[i] = gelu_erf(x[i])
    else:
        for c in prange((n + GELU_CHUNK - 1) // GELU_CHUNK, num_threads=nthreads, schedule="static"):
            cyf_gelu_new_n(x + c * GELU_CHUNK, GELU_CHUNK if n - c * GELU_CHUNK > GELU_CHUNK else n - c * GELU_CHUNK)


cdef void softmax(float* x, Py_ssize_t rows, Py_ssize_t n, int nthreads) noexcept nogil:
    cdef Py_ssize_t r
    for r in prange(rows, num_threads=nthreads, schedule="static"):
        softmax_row(x + r * n, n)


def gelu_inplace(x, kind="gelu_new", threads=None):
    """x = gelu(x) in place for a C-contiguous float32 array; returns x.

    kind: "gelu_new" (tanh approximation, GPT-2) or "gelu" (exact, erf).
    """
    f32("gelu", "x", x, -1, True)
    if not isinstance(kind, str) or kind not in GELU_KINDS:
        raise ValueError(f"gelu: kind must be one of {sorted(GELU_KINDS)}, got {kind!r}")
    cdef int nt = _checks.threads("gelu", threads)
    cdef float* px = wptr(x)
    cdef Py_ssize_t n = x.size
    cdef int k = GELU_KINDS[kind]
    with nogil:
        gelu(px, n, k, nt)
    return x


def softmax_inplace(x, threads=None):
    """Softmax over the last axis of a float32 array, in place; returns x.

    Rows that are entirely -inf come out uniform instead of NaN.
    """
    f32("softmax", "x", x, -1, True)
    if x.ndim == 0 or x.shape[x.ndim - 1] == 0:
        raise ValueError(f"softmax: x needs a non-empty last axis, got shape {x.shape}")
    cdef int nt = _checks.threads("softmax", threads)
    cdef float* px = wptr(x)
    cdef Py_ssize_t n = x.shape[x.ndim - 1]
    cdef Py_ssize_t rows = x.size // n
    with nogil:
        softmax(px, rows, n, nt)
    return x
