"""Pointwise activations (GELU in both forms) and the row softmax."""

from cython.parallel cimport prange

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr

from cyformer import _checks

cnp.import_array()

GELU_KINDS = {"gelu_new": ACT_GELU_NEW, "gelu": ACT_GELU_ERF}
# Every activation a product's epilogue can apply, by config name.
ACTIVATIONS = {"none": ACT_NONE, **GELU_KINDS}


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


cdef void swiglu(float* out, const float* h, Py_ssize_t T, Py_ssize_t F,
                 int nthreads) noexcept nogil:
    cdef Py_ssize_t t
    for t in prange(T, num_threads=nthreads if nthreads < T else <int>T, schedule="static"):
        cyf_swiglu_n(out + t * F, h + t * 2 * F, h + t * 2 * F + F, F)


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


def swiglu_forward(h, out=None, threads=None):
    """SwiGLU's gate: h [T, 2F] (gate | up products) -> out [T, F] =
    silu(gate) * up, silu(x) = x / (1 + e^-x)."""
    fn = "swiglu"
    f32(fn, "h", h, 2)
    cdef Py_ssize_t T = h.shape[0], F = h.shape[1] // 2
    if h.shape[1] % 2:
        raise ValueError(f"swiglu: h must be [T, 2F] (gate | up), got shape {h.shape}")
    if out is None:
        out = np.empty((T, F), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, F))
        _checks.no_overlap(fn, "out", out, h=h)
    cdef int nt = _checks.threads(fn, threads)
    cdef float* po = wptr(out)
    cdef const float* ph = cptr(h)
    if T and F:
        with nogil:
            swiglu(po, ph, T, F, nt)
    return out


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
