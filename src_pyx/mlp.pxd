# The MLP block: linear -> GELU -> linear.

# out (=|+=) gelu(x @ W_fc + b_fc) @ W_proj + b_proj
# x [T, C], W_fc [C, D], W_proj [D, C], hidden [T, D] scratch (holds the
# post-activation on return), scratch: the larger linalg.linear_scratch_size
# of the two products.
cdef void mlp(float* out, const float* x, const float* W_fc, const float* b_fc,
              const float* W_proj, const float* b_proj, Py_ssize_t T, Py_ssize_t C,
              Py_ssize_t D, int act, bint accumulate, float* hidden, float* scratch,
              int nthreads) noexcept nogil
