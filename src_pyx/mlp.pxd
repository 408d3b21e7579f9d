# The MLP block: linear -> activation -> linear.

# out (=|+=) act(x @ W_in + b_in) @ W_out + b_out; with act ACT_SWIGLU, W_in
# [C, 2F] holds the gate and up products side by side (read in one pass) and
# the hidden row is silu(gate) * up (Llama's SwiGLU).
# x [T, C], W_in [C, F] or [C, 2F], W_out [F, C]; biases may be NULL.
# hidden: mlp_hidden_size(T, F, act) floats (holds the post-activation [T, F]
# at its start on return); scratch: the larger linalg.linear_scratch_size of
# the two products.
cdef Py_ssize_t mlp_hidden_size(Py_ssize_t T, Py_ssize_t F, int act) noexcept nogil
from .linalg cimport Wt

cdef void mlp(float* out, const float* x, Wt W_in, const float* b_in,
              Wt W_out, const float* b_out, Py_ssize_t T, Py_ssize_t C,
              Py_ssize_t F, int act, bint accumulate, float* hidden, float* scratch,
              int nthreads) noexcept nogil
