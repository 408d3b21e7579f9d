# Normalisation of the residual stream, one row (position) at a time.

cdef enum NormKind:
    NORM_LAYER = 0  # layer norm: centre, scale to unit variance, gain and bias (GPT-2)
    NORM_RMS = 1    # RMSNorm: scale to unit root-mean-square, gain only (Llama)

# out[t] = (x[t] - mean) / sqrt(var + eps) * g + b for each row of x [T, C].
# scale (may be NULL) receives sqrt(var + eps) per row: the factor that
# interpretability work divides out (TransformerLens' hook_scale).
cdef void layer_norm(float* out, const float* x, const float* g, const float* b,
                     Py_ssize_t T, Py_ssize_t C, float eps, float* scale,
                     int nthreads) noexcept nogil

# One row: out[0:C] from x[0:C]; scale (may be NULL) gets sqrt(var + eps).
cdef void ln_row(float* out, const float* x, const float* g, const float* b,
                 Py_ssize_t C, float eps, float* scale) noexcept nogil

# out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * g; scale gets the denominator.
cdef void rms_row(float* out, const float* x, const float* g, Py_ssize_t C, float eps,
                  float* scale) noexcept nogil

# Either kind, one row (b is unused by NORM_RMS).
cdef inline void norm_row(int kind, float* out, const float* x, const float* g, const float* b,
                          Py_ssize_t C, float eps, float* scale) noexcept nogil:
    if kind == NORM_RMS:
        rms_row(out, x, g, C, eps, scale)
    else:
        ln_row(out, x, g, b, C, eps, scale)

# Either kind over the rows of x [T, C].
cdef void norm_rows(int kind, float* out, const float* x, const float* g, const float* b,
                    Py_ssize_t T, Py_ssize_t C, float eps, float* scale,
                    int nthreads) noexcept nogil
