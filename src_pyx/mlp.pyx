"""The MLP block: linear -> activation -> linear.  A GELU is fused into the
first product's epilogue; SwiGLU's gate and up products are one product over
their weights side by side, then one pass combines them.  The residual add is
fused into the second product's epilogue."""

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport ACT_NONE, ACT_SWIGLU, swiglu
from .linalg cimport Wt, linear, linear_scratch_size, scratch_floats, weights_of

from .activations import GELU_KINDS
from cyformer import _checks

cnp.import_array()

MLP_KINDS = {**GELU_KINDS, "swiglu": ACT_SWIGLU}


cdef Py_ssize_t mlp_hidden_size(Py_ssize_t T, Py_ssize_t F, int act) noexcept nogil:
    return T * F * (3 if act == ACT_SWIGLU else 1)  # [T, F] (+ the [T, 2F] gate | up)


cdef void mlp(float* out, const float* x, Wt W_in, const float* b_in,
              Wt W_out, const float* b_out, Py_ssize_t T, Py_ssize_t C,
              Py_ssize_t F, int act, bint accumulate, float* hidden, float* scratch,
              int nthreads) noexcept nogil:
    if act == ACT_SWIGLU:
        linear(hidden + T * F, x, W_in, b_in, T, C, 2 * F, ACT_NONE, False, scratch, nthreads)
        swiglu(hidden, hidden + T * F, T, F, nthreads)
    else:
        linear(hidden, x, W_in, b_in, T, C, F, act, False, scratch, nthreads)
    linear(out, hidden, W_out, b_out, T, F, C, ACT_NONE, accumulate, scratch, nthreads)


def mlp_forward(x, W_in, b_in, W_out, b_out, out=None, *, activation="gelu_new",
                accumulate=False, threads=None, workspace=None):
    """out (=|+=) act(x @ W_in + b_in) @ W_out + b_out.

    x [T, C], W_in [C, F] ([C, 2F]: gate | up for activation "swiglu"),
    b_in [F] or [2F] or None, W_out [F, C], b_out [C] or None -> out [T, C].
    activation: "gelu_new", "gelu" or "swiglu".  workspace: a
    linalg.Workspace for the hidden activations and scratch (allocated per
    call when None).
    """
    fn = "mlp"
    if not isinstance(activation, str) or activation not in MLP_KINDS:
        raise ValueError(f"mlp: activation must be one of {sorted(MLP_KINDS)}, got {activation!r}")
    cdef int act = MLP_KINDS[activation]
    f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1]
    cdef list keep = [], keep_in = []
    cdef Wt wi = weights_of(fn, "W_in", W_in, C, False, keep_in)
    cdef Py_ssize_t N = W_in.shape[1]
    if act == ACT_SWIGLU and N % 2:
        raise ValueError(f"mlp: W_in must be [C, 2F] (gate | up) for swiglu, got {W_in.shape}")
    cdef Py_ssize_t F = N // 2 if act == ACT_SWIGLU else N
    if b_in is not None:
        f32(fn, "b_in", b_in, 1)
        _checks.shape(fn, "b_in", b_in, (N,))
    cdef Wt wo = weights_of(fn, "W_out", W_out, F, False, keep)
    cdef list keep_out = list(keep)
    _checks.same_dim(fn, "W_out", W_out, 1, C, "x.shape[1]")
    if b_out is not None:
        f32(fn, "b_out", b_out, 1)
        _checks.shape(fn, "b_out", b_out, (C,))
    if out is None:
        if accumulate:
            raise ValueError("mlp: accumulate=True needs an out array to add into")
        out = np.empty((T, C), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, C))
        _checks.no_overlap(fn, "out", out, x=x, b_in=b_in, b_out=b_out)
        for a in keep_in:
            _checks.no_overlap(fn, "out", out, W_in=a)
        for a in keep_out:
            _checks.no_overlap(fn, "out", out, W_out=a)
    if T == 0 or C == 0 or F == 0:
        raise ValueError(f"mlp: empty dimension (T={T}, C={C}, F={F})")
    cdef int nt = _checks.threads(fn, threads)
    cdef Py_ssize_t nh = mlp_hidden_size(T, F, act)
    cdef float* ph = scratch_floats(fn, workspace, nh + max(linear_scratch_size(T, C, N, wi, nt),
                                                            linear_scratch_size(T, F, C, wo, nt)), keep)
    cdef float* ps = ph + nh
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef const float* pbi = cptr(b_in)
    cdef const float* pbo = cptr(b_out)
    cdef bint acc = bool(accumulate)
    with nogil:
        mlp(po, px, wi, pbi, wo, pbo, T, C, F, act, acc, ph, ps, nt)
    return out
