# Linear algebra kernels: the products that hold almost all of the FLOPs.
#
# Layout conventions (row-major, float32):
#   x   [T, K]   activations, one row per position
#   W   [K, N]   weights as Hugging Face's Conv1D stores them (in, out);
#                with w_t=True, W is [N, K] (the tied unembedding, wte)
#   b   [N]      bias, may be NULL
#   out [T, N]
# Every output element is one sequential k = 0..K-1 chain of multiply-adds,
# and threads split outputs (column strips), never the summed dimension, so
# results are bitwise identical at any thread count.

# Floats of scratch memory that linear() needs per thread for T rows.
cdef Py_ssize_t linear_scratch_size(Py_ssize_t T, Py_ssize_t K) noexcept nogil

cdef float dot(const float* a, const float* b, Py_ssize_t n) noexcept nogil

# out = act(x @ W + b) or out += x @ W + b (accumulate), act an activations.Act
# (an activation and accumulate are never combined).  T < MATVEC_ROWS runs the bandwidth-bound
# matrix-vector path, otherwise the packed, register-blocked GEMM path.
cdef void linear(float* out, const float* x, const float* W, const float* b,
                 Py_ssize_t T, Py_ssize_t K, Py_ssize_t N, bint w_t,
                 int act, bint accumulate, float* scratch, int nthreads) noexcept nogil

# out[i] += x[i]
cdef void add(float* out, const float* x, Py_ssize_t n, int nthreads) noexcept nogil

# out[t] = wte[ids[t]] + wpe[pos0 + t]; ids must already be validated.
cdef void embed(float* out, const long long* ids, const float* wte, const float* wpe,
                Py_ssize_t T, Py_ssize_t C, Py_ssize_t pos0, int nthreads) noexcept nogil
