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
    # weights in fewer bytes
    enum:
        CYF_F32
        CYF_BF16
        CYF_I8
        CYF_I4
        CYF_GROUP
    void cyf_gemv_rows_q(const float* x, const void* W, int fmt, Py_ssize_t ld, Py_ssize_t k0,
                         Py_ssize_t j0, Py_ssize_t K, Py_ssize_t n, float* out)
    float cyf_dot_q(const float* x, const void* W, int fmt, Py_ssize_t ld, Py_ssize_t n,
                    Py_ssize_t k0, Py_ssize_t K)
    float cyf_dot_q4(const float* x, const void* W, Py_ssize_t ld, Py_ssize_t n, const float* scale,
                     Py_ssize_t K)
    float cyf_elem_t(const void* W, int fmt, Py_ssize_t ld, Py_ssize_t n, Py_ssize_t k)
    void cyf_dequant_run(const void* W, int fmt, Py_ssize_t ld, const float* scale, Py_ssize_t N,
                         Py_ssize_t k, Py_ssize_t n, Py_ssize_t cnt, float* dst)
    float cyf_max_n(const float* x, Py_ssize_t n, float init)
