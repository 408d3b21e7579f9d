# The inner loops of simd.h, declared once for every kernel module.

cdef extern from "simd.h" nogil:
    enum:
        CYF_VW  # floats per vector register
        CYF_MR  # rows of the GEMM register tile
        CYF_NR  # columns of the GEMM register tile
    void cyf_gemm_tile(const float* x, Py_ssize_t ldx, int nrows,
                       const float* wp, Py_ssize_t ldw, Py_ssize_t K, float* tile,
                       Py_ssize_t ldt)
    void cyf_gemv_strip(const float* x, const float* W, Py_ssize_t ldw, Py_ssize_t K,
                        Py_ssize_t n, float* out)
    void cyf_gemv_rows(const float* x, const float* W, Py_ssize_t ldw, Py_ssize_t K,
                       Py_ssize_t n, float* out)
    float cyf_dot(const float* a, const float* b, Py_ssize_t n)
    # a few rows of x against one weight matrix
    void cyf_gemv_rows_b(const float* x, Py_ssize_t ldx, int nr, const float* W, Py_ssize_t ldw,
                         Py_ssize_t K, Py_ssize_t n, float* out, Py_ssize_t ldo)
    void cyf_dot_rows(const float* x, Py_ssize_t ldx, int nr, const float* w, Py_ssize_t ldw, int nw,
                      Py_ssize_t n, float* out, Py_ssize_t ldo)
    float cyf_stream_sum(const float* x, Py_ssize_t n)
    double cyf_sum_f64(const float* x, Py_ssize_t n)
    double cyf_sqdev_f64(const float* x, Py_ssize_t n, double mean)
    void cyf_gelu_new_n(float* x, Py_ssize_t n)
    void cyf_swiglu_n(float* out, const float* g, const float* u, Py_ssize_t n)
    double cyf_exp_shift_n(float* x, Py_ssize_t n, float shift)
    # weights in fewer bytes: their kernels are rows of formats.h's table (linalg.pxd)
    float cyf_max_n(const float* x, Py_ssize_t n, float init)
