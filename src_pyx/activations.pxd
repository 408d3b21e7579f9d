# Pointwise activations and the softmax.

from libc.math cimport erff, INFINITY

from .simd cimport cyf_gelu_new_n, cyf_swiglu_n, cyf_exp_shift_n, cyf_max_n

# Activation codes, also used by the fused epilogues in linalg.
cdef enum Act:
    ACT_NONE = 0
    ACT_GELU_NEW = 1   # tanh approximation, GPT-2's "gelu_new"
    ACT_GELU_ERF = 2   # exact erf GELU, "gelu"
    ACT_SWIGLU = 3     # not pointwise: silu(gate) * up over a [gate | up] product (mlp only)

cdef inline float gelu_erf(float x) noexcept nogil:
    # 0.5 x (1 + erf(x / sqrt(2))); at x = -inf that is -inf * 0, the limit 0
    if x == -INFINITY:
        return 0.0
    return 0.5 * x * (1.0 + erff(x * 0.7071067811865476))

cdef inline void softmax_row(float* x, Py_ssize_t n) noexcept nogil:
    # Stable softmax in place: subtract the max before exp.  A row that is all
    # -inf (nothing visible) becomes uniform rather than NaN; +inf entries
    # share the mass equally.  The sum runs in a fixed order (deterministic).
    cdef Py_ssize_t i
    cdef float m = cyf_max_n(x, n, -INFINITY)
    cdef double s = 0.0
    if m == -INFINITY or m == INFINITY:
        for i in range(n):
            x[i] = 1.0 if (m == -INFINITY or x[i] == INFINITY) else 0.0
            s += x[i]
    else:
        s = cyf_exp_shift_n(x, n, m)
    cdef float inv = <float>(1.0 / s)
    for i in range(n):
        x[i] = x[i] * inv

# x[i] = gelu(x[i]) in place; kind: ACT_GELU_NEW or ACT_GELU_ERF.
cdef void gelu(float* x, Py_ssize_t n, int kind, int nthreads) noexcept nogil

# SwiGLU's gate over rows: out[t, j] = silu(h[t, j]) * h[t, F + j] for
# h [T, 2F] (the gate and up products side by side) and out [T, F].
cdef void swiglu(float* out, const float* h, Py_ssize_t T, Py_ssize_t F,
                 int nthreads) noexcept nogil

# Row-wise softmax of x [rows, n] in place.
cdef void softmax(float* x, Py_ssize_t rows, Py_ssize_t n, int nthreads) noexcept nogil
