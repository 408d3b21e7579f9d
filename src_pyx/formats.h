/* Weight formats as a table: one cyf_format row per format.
 *
 * A weight matrix reaches the kernels as a cyf_wt (data, scales, format,
 * orientation); every caller in linalg.pyx asks the matrix's row for the
 * kernel it needs (W->f->gemv_block, ...) and never tests the format.  A
 * format is its kernels plus one row of cyf_formats[] (and its record in
 * cyformer/formats.py, whose `code` is the row's index).  Optional kernels
 * are NULL where a format has none: the caller then takes the general path.
 *
 * The rows' kernels instantiate the loops of simd.h for a constant format,
 * so each format gets its own code with no run-time test inside. */
#ifndef CYFORMER_FORMATS_H
#define CYFORMER_FORMATS_H

#include "simd.h"

struct cyf_format;

/* A weight matrix as the kernels read it: [K, N] (inputs, outputs), or
 * [N, K] when t (a row per output: the embedding and unembedding). */
typedef struct cyf_wt {
    const void *data;
    const float *scale;          /* the format's scales (see its row), or NULL */
    const struct cyf_format *f;  /* its row of cyf_formats[] */
    int t;
    ptrdiff_t ld;                /* between rows of the stored array, in its elements */
} cyf_wt;

typedef struct cyf_format {
    const char *name;       /* cyformer/formats.py's name of the row */
    const char *kernels;    /* what computes with it, in words (build_info) */
    int out_scale;          /* scale[n] multiplies output n once, when it is finished */
    int in_place;           /* float32 [K, N] rows that the GEMM tile may read where they lie */
    /* partial[j] = sum_{k < kb} x[k0 + k] W(k0 + k, c0 + j), j < cw, W [K, N]
     * (with the scales of row blocks applied; tmp: cw floats of scratch) */
    void (*gemv_block)(float *partial, const float *x, const cyf_wt *W, ptrdiff_t k0, ptrdiff_t kb,
                       ptrdiff_t c0, ptrdiff_t cw, ptrdiff_t N, float *tmp);
    /* the same for nr rows of x (ldx apart) into nr partials (ldp apart),
     * each weight loaded once for every row; each row bitwise gemv_block's.
     * NULL: the caller runs gemv_block per row. */
    void (*gemv_block_rows)(float *partial, ptrdiff_t ldp, const float *x, ptrdiff_t ldx, int nr,
                            const cyf_wt *W, ptrdiff_t k0, ptrdiff_t kb, ptrdiff_t c0, ptrdiff_t cw);
    /* acc[j] = x . row a + j of W [N, K], j < nw (before out_scale) */
    void (*dot_t)(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K);
    /* dot_t for nr rows of x (ldx apart): acc[c + r * nw]; NULL: dot_t per row */
    void (*dot_t_rows)(float *acc, const float *x, ptrdiff_t ldx, int nr, const cyf_wt *W, ptrdiff_t a,
                       ptrdiff_t nw, ptrdiff_t K);
    /* dst[0:cnt] = W(k, n .. n + cnt - 1) of W [K, N] as scaled float32 (panel packing) */
    void (*pack_run)(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt);
    /* dst[k * ldd] = W(n, k0 + k), k < kn, of W [N, K] as scaled float32 */
    void (*pack_t)(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                   ptrdiff_t K);
} cyf_format;

/* ---- float32 -------------------------------------------------------- */
static void cyf_f32_gemv_block(float *partial, const float *x, const cyf_wt *W, ptrdiff_t k0, ptrdiff_t kb,
                               ptrdiff_t c0, ptrdiff_t cw, ptrdiff_t N, float *tmp)
{
    (void)N; (void)tmp;
    cyf_gemv_rows(x + k0, (const float *)W->data + k0 * W->ld + c0, W->ld, kb, cw, partial);
}

static void cyf_f32_gemv_block_rows(float *partial, ptrdiff_t ldp, const float *x, ptrdiff_t ldx, int nr,
                                    const cyf_wt *W, ptrdiff_t k0, ptrdiff_t kb, ptrdiff_t c0, ptrdiff_t cw)
{
    cyf_gemv_rows_b(x + k0, ldx, nr, (const float *)W->data + k0 * W->ld + c0, W->ld, kb, cw, partial, ldp);
}

static void cyf_f32_dot_t(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    for (ptrdiff_t j = 0; j < nw; j++)
        acc[j] = cyf_dot(x, (const float *)W->data + (a + j) * W->ld, K);
}

static void cyf_f32_dot_t_rows(float *acc, const float *x, ptrdiff_t ldx, int nr, const cyf_wt *W, ptrdiff_t a,
                               ptrdiff_t nw, ptrdiff_t K)
{
    cyf_dot_rows(x, ldx, nr, (const float *)W->data + a * W->ld, W->ld, (int)nw, K, acc, nw);
}

static void cyf_f32_pack_run(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt)
{
    (void)N;
    memcpy(dst, (const float *)W->data + k * W->ld + n, (size_t)cnt * sizeof(float));
}

static void cyf_f32_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                           ptrdiff_t K)
{
    (void)K;
    const float *row = (const float *)W->data + n * W->ld + k0;
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = row[k];
}

/* ---- bfloat16 and int8: a weight widens to float32 exactly --------------- */
#define CYF_WIDENED_ROW(NAME, FMT)                                                                        \
static void cyf_##NAME##_gemv_block(float *partial, const float *x, const cyf_wt *W, ptrdiff_t k0,        \
                                    ptrdiff_t kb, ptrdiff_t c0, ptrdiff_t cw, ptrdiff_t N, float *tmp)    \
{                                                                                                         \
    (void)N; (void)tmp;                                                                                   \
    cyf_gemv_rows_fmt(x + k0, W->data, FMT, W->ld, k0, c0, kb, cw, partial);                              \
}                                                                                                         \
static void cyf_##NAME##_dot_t(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw,    \
                               ptrdiff_t K)                                                               \
{                                                                                                         \
    for (ptrdiff_t j = 0; j < nw; j++)                                                                    \
        acc[j] = cyf_dot_q(x, W->data, FMT, W->ld, a + j, 0, K);                                          \
}
CYF_WIDENED_ROW(bf16, CYF_BF16)
CYF_WIDENED_ROW(i8, CYF_I8)

static void cyf_bf16_pack_run(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt)
{
    cyf_dequant_run(W->data, CYF_BF16, W->ld, W->scale, N, k, n, cnt, dst);
}

static void cyf_bf16_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                            ptrdiff_t K)
{
    (void)K;
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_BF16, W->ld, n, k0 + k);
}

static void cyf_i8_pack_run(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt)
{
    cyf_dequant_run(W->data, CYF_I8, W->ld, W->scale, N, k, n, cnt, dst);
}

static void cyf_i8_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                          ptrdiff_t K)
{
    (void)K;
    const float s = W->scale[n];
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_I8, W->ld, n, k0 + k) * s;
}

/* ---- int4: a scale per output and group of CYF_GROUP inputs ------------- */
static void cyf_i4_gemv_block(float *partial, const float *x, const cyf_wt *W, ptrdiff_t k0, ptrdiff_t kb,
                              ptrdiff_t c0, ptrdiff_t cw, ptrdiff_t N, float *tmp)
{   /* group by group (k0 starts a group), each group's sums scaled into partial */
    for (ptrdiff_t g = 0; g * CYF_GROUP < kb; g++) {
        const ptrdiff_t kg = kb - g * CYF_GROUP < CYF_GROUP ? kb - g * CYF_GROUP : CYF_GROUP;
        cyf_gemv_rows_fmt(x + k0 + g * CYF_GROUP, W->data, CYF_I4, W->ld, k0 + g * CYF_GROUP, c0, kg, cw, tmp);
        const float *s = W->scale + ((k0 + g * CYF_GROUP) / CYF_GROUP) * N + c0;
        if (g == 0)
            for (ptrdiff_t j = 0; j < cw; j++)
                partial[j] = s[j] * tmp[j];
        else
            for (ptrdiff_t j = 0; j < cw; j++)
                partial[j] = partial[j] + s[j] * tmp[j];
    }
}

static void cyf_i4_dot_t(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    for (ptrdiff_t j = 0; j < nw; j++)
        acc[j] = cyf_dot_q4(x, W->data, W->ld, a + j, W->scale + (a + j) * ng, K);
}

static void cyf_i4_pack_run(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt)
{
    cyf_dequant_run(W->data, CYF_I4, W->ld, W->scale, N, k, n, cnt, dst);
}

static void cyf_i4_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                          ptrdiff_t K)
{
    const ptrdiff_t ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_I4, W->ld, n, k0 + k) * W->scale[n * ng + (k0 + k) / CYF_GROUP];
}

/* ---- the table, indexed by cyformer/formats.py's Format.code ------------- */
static cyf_format cyf_formats[] = {
    {"float32", "float32 FMA", 0, 1, cyf_f32_gemv_block, cyf_f32_gemv_block_rows, cyf_f32_dot_t, cyf_f32_dot_t_rows,
     cyf_f32_pack_run, cyf_f32_pack_t},
    {"bfloat16", "widened to float32, FMA", 0, 0, cyf_bf16_gemv_block, NULL, cyf_bf16_dot_t, NULL, cyf_bf16_pack_run, cyf_bf16_pack_t},
    {"int8", "widened to float32, FMA", 1, 0, cyf_i8_gemv_block, NULL, cyf_i8_dot_t, NULL, cyf_i8_pack_run, cyf_i8_pack_t},
    {"int4", "widened to float32, FMA", 0, 0, cyf_i4_gemv_block, NULL, cyf_i4_dot_t, NULL, cyf_i4_pack_run, cyf_i4_pack_t},
};
#define CYF_NFORMATS ((int)(sizeof cyf_formats / sizeof cyf_formats[0]))

/* Row `code` of the table, or NULL past its end. */
static inline const cyf_format *cyf_format_at(int code)
{
    return code >= 0 && code < CYF_NFORMATS ? &cyf_formats[code] : NULL;
}

/* The embedding lookup: out[k] = W(n, k), k < K, of W [N, K] as scaled float32. */
static inline void cyf_dequant_row_t(float *out, const cyf_wt *W, ptrdiff_t n, ptrdiff_t K)
{
    W->f->pack_t(out, 1, W, n, 0, K, K);
}

#endif
