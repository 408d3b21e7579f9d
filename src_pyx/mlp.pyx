"""The MLP block: linear -> GELU -> linear, with the GELU fused into the first
product's epilogue and the residual add fused into the second's."""

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport ACT_NONE, ACT_GELU_NEW, ACT_GELU_ERF
from .linalg cimport linear, linear_scratch_size, scratch_floats

from cyformer import _checks

cnp.import_array()

ACTIVATIONS = {"gelu_new": ACT_GELU_NEW, "gelu": ACT_GELU_ERF}


cdef void mlp(float* out, const float* x, const float* W_fc, const float* b_fc,
              const float* W_proj, const float* b_proj, Py_ssize_t T, Py_ssize_t C,
              Py_ssize_t D, int act, bint accumulate, float* hidden, float* scratch,
              int nthreads) noexcept nogil:
    linear(hidden, x, W_fc, b_fc, T, C, D, False, act, False, scratch, nthreads)
    linear(out, hidden, W_proj, b_proj, T, D, C, False, ACT_NONE, accumulate, scratch, nthreads)


def mlp_forward(x, W_fc, b_fc, W_proj, b_proj, out=None, *, activation="gelu_new",
                accumulate=False, threads=None, workspace=None):
    """out (=|+=) gelu(x @ W_fc + b_fc) @ W_proj + b_proj.

    x [T, C], W_fc [C, D], b_fc [D], W_proj [D, C], b_proj [C] -> out [T, C].
    workspace: a linalg.Workspace for the hidden activations and scratch
    (allocated per call when None).
    """
    fn = "mlp"
    f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1]
    f32(fn, "W_fc", W_fc, 2)
    _checks.same_dim(fn, "W_fc", W_fc, 0, C, "x.shape[1]")
    cdef Py_ssize_t D = W_fc.shape[1]
    f32(fn, "b_fc", b_fc, 1)
    _checks.shape(fn, "b_fc", b_fc, (D,))
    f32(fn, "W_proj", W_proj, 2)
    _checks.shape(fn, "W_proj", W_proj, (D, C))
    f32(fn, "b_proj", b_proj, 1)
    _checks.shape(fn, "b_proj", b_proj, (C,))
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"mlp: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if out is None:
        if accumulate:
            raise ValueError("mlp: accumulate=True needs an out array to add into")
        out = np.empty((T, C), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, C))
        _checks.no_overlap(fn, "out", out, x=x, W_fc=W_fc, b_fc=b_fc, W_proj=W_proj, b_proj=b_proj)
    if T == 0 or C == 0 or D == 0:
        raise ValueError(f"mlp: empty dimension (T={T}, C={C}, D={D})")
    cdef int nt = _checks.threads(fn, threads)
    cdef list keep = []
    cdef float* ph = scratch_floats(fn, workspace, T * D + max(linear_scratch_size(T, C, D, False, nt),
                                                               linear_scratch_size(T, D, C, False, nt)), keep)
    cdef float* ps = ph + T * D
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef const float* pwf = cptr(W_fc)
    cdef const float* pbf = cptr(b_fc)
    cdef const float* pwp = cptr(W_proj)
    cdef const float* pbp = cptr(b_proj)
    cdef int act = ACTIVATIONS[activation]
    cdef bint acc = bool(accumulate)
    with nogil:
        mlp(po, px, pwf, pbf, pwp, pbp, T, C, D, act, acc, ph, ps, nt)
    return out
