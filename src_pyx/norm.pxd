# Layer normalisation.

# out[t] = (x[t] - mean) / sqrt(var + eps) * g + b for each row of x [T, C].
# scale (may be NULL) receives sqrt(var + eps) per row: the factor that
# interpretability work divides out (TransformerLens' hook_scale).
cdef void layer_norm(float* out, const float* x, const float* g, const float* b,
                     Py_ssize_t T, Py_ssize_t C, float eps, float* scale,
                     int nthreads) noexcept nogil

# One row: out[0:C] from x[0:C]; scale (may be NULL) gets sqrt(var + eps).
cdef void ln_row(float* out, const float* x, const float* g, const float* b,
                 Py_ssize_t C, float eps, float* scale) noexcept nogil
