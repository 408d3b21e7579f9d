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
struct cyf_qgemm;
struct cyf_bgemm;

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
    /* acc[j] = x . row a + j of W [N, K], j < nw (before out_scale); NULL
     * where the row has prep (linalg then runs dot_tp_rows only) */
    void (*dot_t)(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K);
    /* dot_t for nr rows of x (ldx apart): acc[c + r * nw]; NULL: dot_t per row */
    void (*dot_t_rows)(float *acc, const float *x, ptrdiff_t ldx, int nr, const cyf_wt *W, ptrdiff_t a,
                       ptrdiff_t nw, ptrdiff_t K);
    /* dst[0:cnt] = W(k, n .. n + cnt - 1) of W [K, N] as scaled float32 (panel packing) */
    void (*pack_run)(float *dst, const cyf_wt *W, ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt);
    /* dst[k * ldd] = W(n, k0 + k), k < kn, of W [N, K] as scaled float32 */
    void (*pack_t)(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                   ptrdiff_t K);
    /* the integer GEMM (qgemm.h; set by cyf_formats_select) of the format's
     * [N, K] matrices.  NULL: the GEMM packs float32 panels (pack_t) */
    const struct cyf_qgemm *qgemm;
    /* x prepared once per product for W [N, K] (int8: its codes, lane scales
     * and corrections): prep_bytes(K) bytes a row of x, a multiple of 64 and
     * at most CYF_PREP_FLOATS(K) floats; dot_tp_rows is dot_t_rows on
     * prepared rows ldxp bytes apart.  NULL: linalg calls dot_t / dot_t_rows
     * on the float rows of x. */
    ptrdiff_t (*prep_bytes)(ptrdiff_t K);
    void (*prep)(void *xp, const float *x, ptrdiff_t K);
    void (*dot_tp_rows)(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W, ptrdiff_t a,
                        ptrdiff_t nw, ptrdiff_t K);
    /* the bfloat16 GEMM (bgemm.h; set by cyf_formats_select): bf16
     * activations.  NULL: as for qgemm */
    const struct cyf_bgemm *bgemm;
} cyf_format;

/* the most floats of scratch any format's prep takes for a row of K inputs */
#define CYF_PREP_FLOATS(K) ((K) + 256)  /* int8 3K + 192 bytes, q8_0 / q4_0 640 per 512 inputs */

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

/* ---- bfloat16: a weight widens to float32 exactly ------------------------ */
/* always [N, K] (rows_out) */
static void cyf_bf16_dot_t(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    for (ptrdiff_t j = 0; j < nw; j++)
        acc[j] = cyf_dot_q(x, W->data, CYF_BF16, W->ld, a + j, 0, K);
}

static void cyf_bf16_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                            ptrdiff_t K)
{
    (void)K;
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_BF16, W->ld, n, k0 + k);
}

/* int8 is always [N, K] (rows_out) */
static void cyf_i8_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                          ptrdiff_t K)
{
    (void)K;
    const float s = W->scale[n];
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_I8, W->ld, n, k0 + k) * s;
}

/* ---- int4: a scale per output and group of CYF_GROUP inputs, always [N, K]
 * (rows_out) ------------------------------------------------------------ */
static void cyf_i4_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                          ptrdiff_t K)
{
    const ptrdiff_t ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    for (ptrdiff_t k = 0; k < kn; k++)
        dst[k * ldd] = cyf_elem_t(W->data, CYF_I4, W->ld, n, k0 + k) * W->scale[n * ng + (k0 + k) / CYF_GROUP];
}

/* ---- int8 weights times int8 activations ---------------------------------
 * x is quantized a block of CYF_QB inputs at a time (llama.cpp's Q8_0
 * activations): d = max|x| / 127 and q = rint(x / d) in float32, so every
 * product q * w is exact in int32 and d (times the weights' per-output scale)
 * multiplies each block's sum once.  backends/numpy_ref.py's q8_* functions
 * are the reference, bit for bit.  Blocks start at multiples of CYF_QB of
 * the whole input (decode's row blocks start there), so a block's codes
 * never depend on how the rows were split. */
#define CYF_QB 32

/* Below max|x| of about 3.7e-37, 1 / d overflows float32, so the codes of a
 * block that small are taken as rint((x * 2^64) * (1 / (d * 2^64))): where
 * 1 / d is finite this is x * (1 / d) bit for bit (scaling by a power of two
 * is exact and commutes with the roundings), and where it is not, the codes
 * are what they would be with an unbounded exponent. */
#define CYF_Q8_SCALE_UP(d) ((d) < 0x1p-120f ? 0x1p64f : 1.0f)

/* A block's d = max|x| / 127, and what its inputs are multiplied by before
 * rounding: *s (CYF_Q8_SCALE_UP), then *id = 1 / (d * s), 0 for a block of
 * zeros.  Every quantizer of a block, scalar or vector, takes them here. */
static inline float cyf_q8_scale(float amax, float *s, float *id)
{
    const float d = amax / 127.0f;
    *s = CYF_Q8_SCALE_UP(d);
    *id = d != 0.0f ? 1.0f / (d * *s) : 0.0f;
    return d;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* cyf_q8_block's float steps on x[0:n], n <= CYF_QB, in two vectors (zeros
 * loaded past n): the codes as int32 lanes *c0, *c1 and the returned d (the
 * max of |x| over finite values is the same in any order; a NaN or an
 * infinity, found by an ordered compare, gives d = NaN and codes 0).  The
 * block quantizers of prefill (cyf_q8_block) and of int4 decode
 * (cyf_q4_row_t_vnni) both take it. */
static inline float cyf_q8_block_zmm(const float *x, ptrdiff_t n, __m512i *c0, __m512i *c1)
{
    const __mmask32 m = n >= CYF_QB ? ~(__mmask32)0 : n > 0 ? ((__mmask32)1 << n) - 1 : 0;
    const __m512 x0 = _mm512_maskz_loadu_ps((__mmask16)m, x), x1 = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), x + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1), big = _mm512_set1_ps(3.40282347e38f);
    *c0 = *c1 = _mm512_setzero_si512();
    if ((_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) != 0xFFFF)
        return __builtin_nanf("");
    float s, id;
    const float d = cyf_q8_scale(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)), &s, &id);
    const __m512 vs = _mm512_set1_ps(s), vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(127.0f);
    const __m512 lo = _mm512_set1_ps(-127.0f);
    enum { nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };  /* an immediate */
    /* rint, then clamped */
    const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_mul_ps(x0, vs), vid), nearest);
    const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_mul_ps(x1, vs), vid), nearest);
    *c0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r0, hi), lo));
    *c1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r1, hi), lo));
    return d;
}

/* A block in place: its codes as bytes.  Prefill quantizes T x K inputs per
 * product; a scalar loop took a tenth of an int8 prefill's time. */
static inline float cyf_q8_block_avx512(const float *x, ptrdiff_t n, signed char *q)
{
    __m512i c0, c1;
    const float d = cyf_q8_block_zmm(x, n, &c0, &c1);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(c1));
    return d;
}
#elif defined(__AVX2__)
/* The same in four 8-lane vectors (the x86-64-v3 kernels) */
static inline float cyf_q8_block32_avx2(const float *x, signed char *q)
{
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(3.40282347e38f);
    __m256 v[4], m = _mm256_setzero_ps();
    int finite = 1;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        const __m256 a = _mm256_and_ps(v[i], mag);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) == 0xFF;
        m = _mm256_max_ps(m, a);
    }
    if (!finite) {
        memset(q, 0, CYF_QB);  /* a NaN or an infinity */
        return __builtin_nanf("");
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float s, id;
    const float d = cyf_q8_scale(amax, &s, &id);
    const __m256 vs = _mm256_set1_ps(s), vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f);
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(v[i], vs), vid),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
    }
    /* the packs interleave 128-bit lanes: dwords 0, 4, 1, 5, ... put them back in order */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}
#endif

/* q[0:CYF_QB] and the returned d of x[0:n], n <= CYF_QB (q zero past n).
 * A block with a NaN or infinity gets d = NaN and q = 0, so its outputs are NaN. */
static inline float cyf_q8_block(const float *x, ptrdiff_t n, signed char *q)
{
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return cyf_q8_block_avx512(x, n, q);
#else
#if defined(__AVX2__)
    if (n == CYF_QB)
        return cyf_q8_block32_avx2(x, q);
#endif
    float amax = 0.0f;
    int finite = 1;
    for (ptrdiff_t i = 0; i < n; i++) {
        const float a = __builtin_fabsf(x[i]);
        finite &= a <= 3.40282347e38f;
        amax = a > amax ? a : amax;
    }
    memset(q, 0, CYF_QB);
    if (!finite)
        return __builtin_nanf("");
    float s, id;
    const float d = cyf_q8_scale(amax, &s, &id);
    for (ptrdiff_t i = 0; i < n; i++) {
        float v = __builtin_rintf(x[i] * s * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (signed char)v;
    }
    return d;
#endif
}

/* x[0:K] -> codes q[nblk * CYF_QB], scales d[nblk], and 128 * the sum of
 * each group of 4 codes (the unsigned-weight correction, see below) */
static inline void cyf_q8_row(const float *x, ptrdiff_t K, signed char *q, float *d, int *sum4)
{
    for (ptrdiff_t b = 0; b * CYF_QB < K; b++) {
        const ptrdiff_t n = K - b * CYF_QB < CYF_QB ? K - b * CYF_QB : CYF_QB;
        d[b] = cyf_q8_block(x + b * CYF_QB, n, q + b * CYF_QB);
        if (sum4)
            for (int l = 0; l < CYF_QB / 4; l++) {
                const signed char *g = q + b * CYF_QB + 4 * l;
                sum4[b * (CYF_QB / 4) + l] = 128 * (g[0] + g[1] + g[2] + g[3]);
            }
    }
}


/* ---- int8 [N, K] (every int8 matrix, rows_out) times int8 activations -----
 * x is quantized in blocks of CYF_QB from input 0.  Each output
 * sums in 16 float lanes over pairs of blocks (64 inputs, one 64-byte run
 * of a row): lane l of pair p takes the exact integer sum of the products of
 * inputs 64p + 4l .. 64p + 4l + 3 times its block's d (block 2p for lanes
 * 0-7, 2p + 1 for lanes 8-15), added with one rounding (fmaf); then the
 * lanes are added in one fixed tree, l + (l + 8), then + 4, + 2, + 1.  The
 * scale per output is out_scale's.  numpy_ref.q8_matvec_t is the reference,
 * bit for bit. */
#define CYF_QP (2 * CYF_QB)

/* x[0:K] -> codes q[npair * CYF_QP] (zero past K), each lane's d as
 * dl[npair * 16] (0 for a block past K) and, when corr is not NULL, minus
 * 128 * the sum of each lane's 4 codes (the unsigned-weight correction) */
static inline void cyf_q8_row_t(const float *x, ptrdiff_t K, signed char *q, float *dl, int *corr)
{
    const ptrdiff_t npair = (K + CYF_QP - 1) / CYF_QP;
    for (ptrdiff_t b = 0; b < 2 * npair; b++) {
        const ptrdiff_t n = K - b * CYF_QB < CYF_QB ? K - b * CYF_QB : CYF_QB;
        const float d = n > 0 ? cyf_q8_block(x + b * CYF_QB, n, q + b * CYF_QB) : 0.0f;
        if (n <= 0)
            memset(q + b * CYF_QB, 0, CYF_QB);
        for (int l = 0; l < 8; l++)
            dl[b * 8 + l] = d;
    }
    if (corr)
        for (ptrdiff_t l = 0; l < npair * 16; l++)
            corr[l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
}

/* The activations of one row of x prepared once per product (the row's
 * `prep`, read by dot_tp_rows): codes q [npair * CYF_QP], lane scales dl
 * [npair * 16], corrections corr [npair * 16], one after another, 192
 * bytes per pair of blocks (a multiple of 64). */
static ptrdiff_t cyf_i8q_prep_bytes(ptrdiff_t K)
{
    return (K + CYF_QP - 1) / CYF_QP * 192;
}

static void cyf_i8q_prep(void *xp, const float *x, ptrdiff_t K)
{
    const ptrdiff_t npair = (K + CYF_QP - 1) / CYF_QP;
    float *dl = (float *)((signed char *)xp + npair * CYF_QP);
    cyf_q8_row_t(x, K, (signed char *)xp, dl, (int *)(dl + npair * 16));
}

#define CYF_I8Q_Q(xp) ((const signed char *)(xp))
#define CYF_I8Q_DL(xp, npair) ((const float *)((const signed char *)(xp) + (npair) * CYF_QP))
#define CYF_I8Q_CORR(xp, npair) ((const int *)(CYF_I8Q_DL(xp, npair) + (npair) * 16))

/* dot_t of prepared rows (ldxp bytes apart), acc[j + r * nw]: the generic loops */
static void cyf_i8q_dot_tp_rows_generic(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                        ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t npair = (K + CYF_QP - 1) / CYF_QP, full = K / CYF_QP;
    for (ptrdiff_t j = 0; j < nw; j++) {
        const signed char *w = (const signed char *)W->data + (a + j) * W->ld;
        for (int r = 0; r < nr; r++) {
            const void *xr = (const unsigned char *)xp + r * ldxp;
            const signed char *q = CYF_I8Q_Q(xr);
            const float *dl = CYF_I8Q_DL(xr, npair);
            float lane[16] = {0};
            for (ptrdiff_t p = 0; p < full; p++) {
                const signed char *qp = q + p * CYF_QP, *wp = w + p * CYF_QP;
                for (int l = 0; l < 16; l++) {
                    const int s = qp[4 * l] * wp[4 * l] + qp[4 * l + 1] * wp[4 * l + 1]
                                + qp[4 * l + 2] * wp[4 * l + 2] + qp[4 * l + 3] * wp[4 * l + 3];
                    lane[l] = __builtin_fmaf(dl[p * 16 + l], (float)s, lane[l]);
                }
            }
            if (full < npair) {  /* the last, partial pair: no weight read past K */
                const ptrdiff_t p = full;
                for (int l = 0; l < 16; l++) {
                    int s = 0;
                    for (int i = 0; i < 4; i++) {
                        const ptrdiff_t k = p * CYF_QP + 4 * l + i;
                        if (k < K)
                            s += q[k] * w[k];
                    }
                    lane[l] = __builtin_fmaf(dl[p * 16 + l], (float)s, lane[l]);
                }
            }
            acc[r * nw + j] = cyf_tree16(lane);
        }
    }
}


/* ---- int4 [N, K] (a row per output) times int8 activations ---------------
 * Byte p of a row holds input 2p in its low nibble and 2p + 1 in its high
 * one (nibble = code + 8), with a float32 scale per group of CYF_GROUP
 * inputs (a group is an activation block).  x is quantized as for int8,
 * blocks of CYF_QB from input 0.  A chunk is 128 inputs, one 64-byte run
 * of a row, 4 groups: each output sums in 16 float lanes, lane l of chunk c
 * taking the exact integer sum of inputs 128c + 8l .. 128c + 8l + 7 (a
 * quarter of group 4c + l/4) times float32(d_x * s_w) of that group, added
 * with one rounding (fmaf), chunk after chunk; then cyf_tree16's tree.
 * The low nibbles of a run are its even inputs and the high ones the odd,
 * so x's codes are split once into even and odd (no shuffle of the
 * weights).  numpy_ref.q4_matvec_t is the reference, bit for bit. */
#define CYF_Q4C 128  /* inputs per chunk */

/* x[0:K] -> per chunk c < nch = ceil(K / CYF_Q4C): the even inputs' codes
 * qe[64c + b] = q[128c + 2b] and the odd ones' qo[64c + b] = q[128c + 2b + 1]
 * (zero past K), each lane's d_x dl[16c + l] (0 past K) and corr[16c + l] =
 * -8 * the sum of the lane's 8 codes (the nibbles' +8 taken off). */
static inline void cyf_q4_row_t(const float *x, ptrdiff_t K, signed char *qe, signed char *qo, float *dl, int *corr)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C;
    signed char q[CYF_Q4C];
    for (ptrdiff_t c = 0; c < nch; c++) {
        for (int g = 0; g < CYF_Q4C / CYF_QB; g++) {
            const ptrdiff_t k0 = c * CYF_Q4C + g * CYF_QB, n = K - k0 < CYF_QB ? K - k0 : CYF_QB;
            float d = 0.0f;
            if (n > 0)
                d = cyf_q8_block(x + k0, n, q + g * CYF_QB);
            else
                memset(q + g * CYF_QB, 0, CYF_QB);
            for (int l = 0; l < 4; l++)
                dl[c * 16 + 4 * g + l] = d;
        }
        for (int b = 0; b < CYF_Q4C / 2; b++) {
            qe[c * 64 + b] = q[2 * b];
            qo[c * 64 + b] = q[2 * b + 1];
        }
        for (int l = 0; l < 16; l++) {
            int s = 0;
            for (int i = 0; i < 8; i++)
                s += q[8 * l + i];
            corr[c * 16 + l] = -8 * s;
        }
    }
}

/* One output: row w (ceil(K/2) bytes) and its group scales sc against x's
 * chunks (cyf_q4_row_t), in the lane order above. */
static inline float cyf_i4q_row_dot_t(const unsigned char *w, const float *sc, const signed char *qe,
                                      const signed char *qo, const float *dl, const int *corr, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C, nbytes = (K + 1) / 2, ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    float lane[16] = {0.0f};
    for (ptrdiff_t c = 0; c < nch; c++) {
        const ptrdiff_t b0 = c * 64;
        int s[16];
        for (int l = 0; l < 16; l++)
            s[l] = corr[c * 16 + l];
        if (b0 + 64 <= nbytes) {  /* the products first: a loop the compiler vectorizes */
            short pr[64];
            for (int b = 0; b < 64; b++)
                pr[b] = (short)((w[b0 + b] & 15) * qe[b0 + b] + (w[b0 + b] >> 4) * qo[b0 + b]);
            for (int l = 0; l < 16; l++)
                s[l] += pr[4 * l] + pr[4 * l + 1] + pr[4 * l + 2] + pr[4 * l + 3];
        } else {  /* the last, partial chunk: no byte read past the row's end */
            for (ptrdiff_t b = b0; b < nbytes; b++)
                s[(b - b0) / 4] += (w[b] & 15) * qe[b] + (w[b] >> 4) * qo[b];
        }
        float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* the chunk's group scales, 0 past the row's */
        for (int g = 0; g < 4; g++)
            if (4 * c + g < ng)
                s4[g] = sc[4 * c + g];
        for (int l = 0; l < 16; l++)
            lane[l] = __builtin_fmaf(dl[c * 16 + l] * s4[l / 4], (float)s[l], lane[l]);
    }
    return cyf_tree16(lane);
}

/* A row of x prepared once per product (int4's `prep`, read by
 * dot_tp_rows): cyf_q4_row_t's qe [nch * 64], qo [nch * 64], dl [nch * 16]
 * and corr [nch * 16], one after another, 256 bytes per chunk of 128 inputs
 * (a multiple of 64). */
static ptrdiff_t cyf_i4q_prep_bytes(ptrdiff_t K)
{
    return (K + CYF_Q4C - 1) / CYF_Q4C * 256;
}

#define CYF_I4Q_QE(xp) ((const signed char *)(xp))
#define CYF_I4Q_QO(xp, nch) ((const signed char *)(xp) + (nch) * 64)
#define CYF_I4Q_DL(xp, nch) ((const float *)((const unsigned char *)(xp) + (nch) * 128))
#define CYF_I4Q_CORR(xp, nch) ((const int *)((const unsigned char *)(xp) + (nch) * 192))

static void cyf_i4q_prep(void *xp, const float *x, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C;
    signed char *p = (signed char *)xp;
    cyf_q4_row_t(x, K, p, p + nch * 64, (float *)(p + nch * 128), (int *)(p + nch * 192));
}

/* dot_t of prepared rows (ldxp bytes apart), acc[j + r * nw]: each row of W
 * read once for every row of x, the generic loops */
static void cyf_i4q_dot_tp_rows_generic(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                        ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C, ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    for (ptrdiff_t j = 0; j < nw; j++) {
        const unsigned char *w = (const unsigned char *)W->data + (a + j) * W->ld;
        const float *sc = W->scale + (a + j) * ng;
        for (int r = 0; r < nr; r++) {
            const unsigned char *xr = (const unsigned char *)xp + r * ldxp;
            acc[r * nw + j] = cyf_i4q_row_dot_t(w, sc, CYF_I4Q_QE(xr), CYF_I4Q_QO(xr, nch), CYF_I4Q_DL(xr, nch),
                                                CYF_I4Q_CORR(xr, nch), K);
        }
    }
}

/* nr rows of x, 4 at a time, through TILE(MW, MX) (reading r0), each tile
 * shape a constant so its accumulators stay in registers: the batched
 * integer kernels' walk over rows of x. */
#define CYF_Q_TILE_ROWS(TILE, MW, nr)                                    \
    for (int r0 = 0; r0 < (nr); r0 += 4)                                 \
        switch ((nr) - r0 < 4 ? (nr) - r0 : 4) {                         \
        case 1: TILE(MW, 1); break;                                      \
        case 2: TILE(MW, 2); break;                                      \
        case 3: TILE(MW, 3); break;                                      \
        default: TILE(MW, 4);                                            \
        }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CYF_HAVE_VNNI_KERNELS 1


/* int8 [N, K] with AVX512-VNNI: a 64-byte run of a row is one pair of
 * blocks, its 16 int32 lanes are the 16 lanes of the generic loops.
 * Weights are the unsigned side (w + 128), each lane starting from its
 * correction, so vpdpbusd leaves the exact lane sum.  A tile of MX prepared
 * rows of x (ldxp bytes apart) and MW rows of W shares every load; MX, MW
 * are constants once inlined. */
/* Several rows of x (the batched step, pf set): the tile MW rows of W ahead
 * times CYF_TILES_AHEAD is asked for in memory order, MW lines per step.
 * Rows are stored one after another, so that is one stream; asked for row
 * by row, MW short streams side by side, it came from DRAM at half the
 * speed.  One row of x streams fine on the hardware prefetchers alone.
 * int8's and int4's tiles. */
#define CYF_TILES_AHEAD 2
/* The walk of a batched product over its tiles, TILE(MW, MX) reading j and
 * r0: nr > 1 rows of x meet 4 rows of W at a time, 4 rows of x per tile;
 * the last rows of W, or one row of x, a row of W at a time. */
#define CYF_Q_TILE_WALK(TILE, nr, nw)                                    \
    do {                                                                 \
        ptrdiff_t j = 0;                                                 \
        if ((nr) > 1)                                                    \
            for (; j + 4 <= (nw); j += 4)                                \
                CYF_Q_TILE_ROWS(TILE, 4, nr);                            \
        for (; j < (nw); j++)                                            \
            CYF_Q_TILE_ROWS(TILE, 1, nr);                                \
    } while (0)
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_i8q_dot_t_tile(float *acc, ptrdiff_t ldacc, const signed char *w, ptrdiff_t ld, const int MW,
                                      const unsigned char *xp, ptrdiff_t ldxp, const int MX, ptrdiff_t npair,
                                      ptrdiff_t K, const int pf)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const ptrdiff_t full = K / CYF_QP;
    const __mmask64 last = full < npair ? (__mmask64)-1 >> (CYF_QP - (K - full * CYF_QP)) : 0;
    __m512 f[4][4];
    for (int r = 0; r < MX; r++)
        for (int m = 0; m < MW; m++)
            f[r][m] = _mm512_setzero_ps();
#define CYF_I8Q_T_STEP(LOAD)                                                                              \
    do {                                                                                                  \
        __m512i wv[4];                                                                                    \
        if (pf)                                                                                           \
            for (int m = 0; m < MW; m++)                                                                  \
                _mm_prefetch((const char *)(w + CYF_TILES_AHEAD * MW * ld + (p * MW + m) * 64), _MM_HINT_T0);           \
        for (int m = 0; m < MW; m++)                                                                      \
            wv[m] = _mm512_xor_si512(LOAD(w + m * ld + p * CYF_QP), flip);                                \
        for (int r = 0; r < MX; r++) {                                                                    \
            const unsigned char *xr = xp + r * ldxp;                                                      \
            const __m512i qq = _mm512_loadu_si512(CYF_I8Q_Q(xr) + p * CYF_QP);                           \
            const __m512i c = _mm512_loadu_si512(CYF_I8Q_CORR(xr, npair) + p * 16);                       \
            const __m512 d = _mm512_loadu_ps(CYF_I8Q_DL(xr, npair) + p * 16);                             \
            for (int m = 0; m < MW; m++)                                                                  \
                f[r][m] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, wv[m], qq)), f[r][m]); \
        }                                                                                                 \
    } while (0)
#define CYF_LOAD_FULL(P) _mm512_loadu_si512(P)
#define CYF_LOAD_LAST(P) _mm512_maskz_loadu_epi8(last, P)
    ptrdiff_t p = 0;
    for (; p < full; p++)
        CYF_I8Q_T_STEP(CYF_LOAD_FULL);
    if (p < npair)
        CYF_I8Q_T_STEP(CYF_LOAD_LAST);
#undef CYF_LOAD_FULL
#undef CYF_LOAD_LAST
#undef CYF_I8Q_T_STEP
    for (int r = 0; r < MX; r++)
        for (int m = 0; m < MW; m++)
            acc[r * ldacc + m] = cyf_tree16_512(f[r][m]);
}

/* acc[j + r * nw] = prepared row r of x (ldxp bytes apart) . row a + j of
 * W [N, K]; every row's arithmetic is the one-row kernel's.  One row of x
 * reads W a row at a time: from DRAM, rows read side by side on the
 * hardware prefetchers alone streamed at 8-13 GB/s on one Zen 4 core, one
 * row at a time at 28-30 (50257 x 768).  Several rows of x: every 4 rows of
 * W meet all of them, 4 at a time from registers, so W comes from DRAM once
 * and each weight serves 4 rows of x per load (with one row of W per tile,
 * the batched step was load-bound). */
__attribute__((target("avx512vnni")))
static void cyf_i8q_dot_tp_rows_vnni(float *acc, const void *xpv, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                     ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t npair = (K + CYF_QP - 1) / CYF_QP, ld = W->ld;
    const signed char *Wd = (const signed char *)W->data + a * ld;
    const unsigned char *xp = (const unsigned char *)xpv;
#define CYF_I8Q_TILE(MW, MX) \
    cyf_i8q_dot_t_tile(acc + r0 * nw + j, nw, Wd + j * ld, ld, MW, xp + r0 * ldxp, ldxp, MX, npair, K, nr > 1)
    CYF_Q_TILE_WALK(CYF_I8Q_TILE, nr, nw);
#undef CYF_I8Q_TILE
}

/* cyf_q4_row_t in AVX-512, the same bits: cyf_q8_block_zmm per block of
 * 32, the codes split into even and odd inputs by two
 * permutes, and each lane's correction from its 8 codes by vpdpbusd with
 * ones.  Quantizing x scalar took about a tenth of a 3072 x 768 product
 * from L3 (one call per 512 outputs). */
__attribute__((target("avx512vnni")))
static inline void cyf_q4_row_t_vnni(const float *x, ptrdiff_t K, signed char *qe, signed char *qo, float *dl,
                                     int *corr)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1)), ones = _mm512_set1_epi8(1);
    for (ptrdiff_t c = 0; c < nch; c++) {
        for (int g = 0; g < CYF_Q4C / CYF_QB; g++) {
            const ptrdiff_t k0 = c * CYF_Q4C + g * CYF_QB, n = K - k0 < CYF_QB ? K - k0 : CYF_QB;
            __m512i q0, q1;
            const float d = cyf_q8_block_zmm(x + k0, n, &q0, &q1);
            _mm_storeu_si128((__m128i *)(qe + c * 64 + g * 16), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, even, q1)));
            _mm_storeu_si128((__m128i *)(qo + c * 64 + g * 16), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, odd, q1)));
            for (int l = 0; l < 4; l++)
                dl[c * 16 + 4 * g + l] = d;
        }
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones,
                                                                  _mm512_loadu_si512(qe + c * 64)),
                                              ones, _mm512_loadu_si512(qo + c * 64));
        _mm512_storeu_si512(corr + c * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 3)));
    }
}

/* int4 [N, K] with AVX512-VNNI: a 64-byte run of a row is one chunk; its
 * low nibbles (& 15) meet the even codes and its high ones (>> 4) the odd
 * codes in two vpdpbusd (nibbles unsigned, codes signed) into the same
 * int32 lanes, each lane starting from its correction, so lane l holds the
 * exact sum of cyf_i4q_row_dot_t's lane l.  The group scales of the chunk
 * (4 floats) are spread over the lanes by one permute.  A tile of MX
 * prepared rows of x (ldxp bytes apart) and MW rows of W shares every load;
 * MX, MW are constants once inlined. */
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_i4q_dot_t_tile(float *acc, ptrdiff_t ldacc, const unsigned char *w, ptrdiff_t ld,
                                      const float *sc, ptrdiff_t ng, const int MW, const unsigned char *xp,
                                      ptrdiff_t ldxp, const int MX, ptrdiff_t nch, ptrdiff_t K, const int pf)
{
    const __m512i nib = _mm512_set1_epi8(15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const ptrdiff_t nbytes = (K + 1) / 2, full = nbytes / 64;
    const __mmask64 last = full < nch ? (__mmask64)-1 >> (64 - (nbytes - full * 64)) : 0;
    const __mmask8 lastg = full < nch ? (__mmask8)((1u << (ng - 4 * full)) - 1u) : 0;
    __m512 f[4][4];
    for (int r = 0; r < MX; r++)
        for (int m = 0; m < MW; m++)
            f[r][m] = _mm512_setzero_ps();
#define CYF_I4Q_T_STEP(LOADW, LOADS)                                                                      \
    do {                                                                                                  \
        __m512i lo[4], hi[4];                                                                             \
        __m512 s16[4];                                                                                    \
        if (pf)                                                                                           \
            for (int m = 0; m < MW; m++)                                                                  \
                _mm_prefetch((const char *)(w + CYF_TILES_AHEAD * MW * ld + (c * MW + m) * 64), _MM_HINT_T0);           \
        for (int m = 0; m < MW; m++) {                                                                    \
            const __m512i v = LOADW(w + m * ld + c * 64);                                                 \
            lo[m] = _mm512_and_si512(v, nib);                                                             \
            hi[m] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);                                       \
            s16[m] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(LOADS(sc + m * ng + 4 * c)));   \
        }                                                                                                 \
        for (int r = 0; r < MX; r++) {                                                                    \
            const unsigned char *xr = xp + r * ldxp;                                                      \
            const __m512i e = _mm512_loadu_si512(CYF_I4Q_QE(xr) + c * 64);                                \
            const __m512i o = _mm512_loadu_si512(CYF_I4Q_QO(xr, nch) + c * 64);                           \
            const __m512i k = _mm512_loadu_si512(CYF_I4Q_CORR(xr, nch) + c * 16);                         \
            const __m512 d = _mm512_loadu_ps(CYF_I4Q_DL(xr, nch) + c * 16);                               \
            for (int m = 0; m < MW; m++) {                                                                \
                const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(k, lo[m], e), hi[m], o);        \
                f[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(d, s16[m]), _mm512_cvtepi32_ps(s), f[r][m]);      \
            }                                                                                             \
        }                                                                                                 \
    } while (0)
#define CYF_LOAD_W(P) _mm512_loadu_si512(P)
#define CYF_LOAD_S(P) _mm_loadu_ps(P)
#define CYF_LOAD_W_LAST(P) _mm512_maskz_loadu_epi8(last, P)
#define CYF_LOAD_S_LAST(P) _mm_maskz_loadu_ps(lastg, P)
    ptrdiff_t c = 0;
    for (; c < full; c++)
        CYF_I4Q_T_STEP(CYF_LOAD_W, CYF_LOAD_S);
    if (c < nch)
        CYF_I4Q_T_STEP(CYF_LOAD_W_LAST, CYF_LOAD_S_LAST);
#undef CYF_LOAD_W
#undef CYF_LOAD_S
#undef CYF_LOAD_W_LAST
#undef CYF_LOAD_S_LAST
#undef CYF_I4Q_T_STEP
    for (int r = 0; r < MX; r++)
        for (int m = 0; m < MW; m++)
            acc[r * ldacc + m] = cyf_tree16_512(f[r][m]);
}

/* x prepared with AVX-512 (cyf_q4_row_t_vnni: the same bytes as cyf_i4q_prep) */
__attribute__((target("avx512vnni")))
static void cyf_i4q_prep_vnni(void *xp, const float *x, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C;
    signed char *p = (signed char *)xp;
    cyf_q4_row_t_vnni(x, K, p, p + nch * 64, (float *)(p + nch * 128), (int *)(p + nch * 192));
}

/* acc[j + r * nw] = prepared row r of x (ldxp bytes apart) . row a + j of
 * W [N, K], walked as int8's: one row of x, one row of W at a time; several,
 * every 4 rows of W against all of them, 4 at a time from registers.  Every
 * row's arithmetic is the one-row kernel's. */
__attribute__((target("avx512vnni")))
static void cyf_i4q_dot_tp_rows_vnni(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                     ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C, ld = W->ld;
    const ptrdiff_t ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    const unsigned char *Wd = (const unsigned char *)W->data + a * ld;
    const float *S = W->scale + a * ng;
#define CYF_I4Q_TILE(MW, MX) cyf_i4q_dot_t_tile(acc + r0 * nw + j, nw, Wd + j * ld, ld, S + j * ng, ng, MW, \
                                                (const unsigned char *)xp + r0 * ldxp, ldxp, MX, nch, K, nr > 1)
    CYF_Q_TILE_WALK(CYF_I4Q_TILE, nr, nw);
#undef CYF_I4Q_TILE
}
#else
#define CYF_HAVE_VNNI_KERNELS 0
#endif

/* ---- int8 and int4 [N, K] times int8 activations with AVX2 ---------------
 * vpmaddubsw multiplies unsigned by signed bytes into 16-bit pair sums,
 * vpmaddwd adds the pairs into int32 lanes: 4 products per lane, as
 * vpdpbusd.  int8 weights are taken as |w| against the codes with w's sign
 * (vpsignb), so a pair sum is at most 2 * 128 * 127 < 2^15: exact, no
 * saturation.  int4's nibbles are q + 8 already unsigned (8 * the codes'
 * sum taken off, as with VNNI).  The same integers and roundings as the
 * generic loops, so the same bits.  Compiled for AVX2 and FMA function by
 * function, so every build of the x86-64 levels carries them; chosen at
 * run time when the CPU has AVX2 but no AVX512-VNNI. */
#if defined(__x86_64__)
#define CYF_HAVE_AVX2_KERNELS 1
#include <immintrin.h>
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define CYF_HAVE_AVXVNNI_KERNELS 1  /* the compiler knows target("avxvnni") */
#else
#define CYF_HAVE_AVXVNNI_KERNELS 0
#endif

/* int8 [N, K]: a 64-byte run of a row is two 256-bit registers, lanes 0-7
 * and 8-15 of the generic loops; its last, partial run is copied into a
 * zeroed buffer (no read past the row).  Each run and its |w| serve up to
 * NX prepared rows of x from registers (the batched step: one core, GPT-2
 * small, 16 sequences 64.7-65.9 -> 55.4-56.8 ms against one row at a time);
 * each row's lanes summed in cyf_tree16's tree. */
__attribute__((target("avx2,fma"), always_inline))
static inline void cyf_i8q_tile_avx2(float *acc, ptrdiff_t ldacc, const signed char *w, const void *xp,
                                     ptrdiff_t ldxp, const int NX, ptrdiff_t npair, ptrdiff_t K)
{
    const ptrdiff_t full = K / CYF_QP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 lo[4], hi[4];
    for (int r = 0; r < NX; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (ptrdiff_t p = 0; p < npair; p++) {
        signed char tail[CYF_QP];
        const signed char *wp = w + p * CYF_QP;
        if (p == full) {
            memset(tail, 0, sizeof tail);
            memcpy(tail, wp, (size_t)(K - full * CYF_QP));
            wp = tail;
        }
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wp);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < NX; r++) {
            const void *xr = (const unsigned char *)xp + r * ldxp;
            const signed char *q = CYF_I8Q_Q(xr) + p * CYF_QP;
            const float *dl = CYF_I8Q_DL(xr, npair) + p * 16;
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)q);
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
            const __m256i s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(q0, w0)), ones);
            const __m256i s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(q1, w1)), ones);
            lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(dl), _mm256_cvtepi32_ps(s0), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(dl + 8), _mm256_cvtepi32_ps(s1), hi[r]);
        }
    }
    for (int r = 0; r < NX; r++)
        acc[r * ldacc] = cyf_tree16_ps(lo[r], hi[r]);
}

__attribute__((target("avx2,fma")))
static void cyf_i8q_dot_tp_rows_avx2(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                     ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t npair = (K + CYF_QP - 1) / CYF_QP;
#define CYF_I8Q_TILE(MW, NX) \
    cyf_i8q_tile_avx2(acc + r0 * nw + j, nw, w, (const unsigned char *)xp + r0 * ldxp, ldxp, NX, npair, K)
    for (ptrdiff_t j = 0; j < nw; j++) {
        const signed char *w = (const signed char *)W->data + (a + j) * W->ld;
        CYF_Q_TILE_ROWS(CYF_I8Q_TILE, 1, nr);
    }
#undef CYF_I8Q_TILE
}

#define CYF_D2_CAT_(a, b) a##b
#define CYF_D2_CAT(a, b) CYF_D2_CAT_(a, b)
#define CYF_D2_(name) CYF_D2_CAT(name, CYF_D2_SFX)
#define CYF_D2_ATTR __attribute__((target("avx2,fma")))
#define CYF_D2_SFX avx2
#include "dot_avx2.h"
#undef CYF_D2_ATTR
#undef CYF_D2_SFX
#if CYF_HAVE_AVXVNNI_KERNELS
#define CYF_D2_ATTR __attribute__((target("avx2,fma,avxvnni")))
#define CYF_D2_SFX avxvnni
#define CYF_D2_DPBUSD _mm256_dpbusd_avx_epi32
#include "dot_avx2.h"
#undef CYF_D2_ATTR
#undef CYF_D2_SFX
#undef CYF_D2_DPBUSD
#endif
#define CYF_D2_ATTR __attribute__((target("avx2,fma,avx512vnni,avx512vl")))
#define CYF_D2_SFX vnni256
#define CYF_D2_DPBUSD _mm256_dpbusd_epi32
#include "dot_avx2.h"
#undef CYF_D2_ATTR
#undef CYF_D2_SFX
#undef CYF_D2_DPBUSD
#else
#define CYF_HAVE_AVX2_KERNELS 0
#define CYF_HAVE_AVXVNNI_KERNELS 0
#endif

/* ---- bfloat16 weights times bfloat16 activations: AVX512-BF16 -------------
 * vdpbf16ps adds the products of two bf16 pairs into each float32 lane:
 * acc = fma(a[2i+1], b[2i+1], acc), then acc = fma(a[2i], b[2i], acc), each
 * rounded to nearest even, with bf16 denormal inputs and a denormal
 * accumulator read as zero and denormal results flushed to zero (Intel's
 * pseudo-code; checked bit for bit on AMD Zen 4).  x is rounded to bf16
 * (nearest even, cyformer.formats._bfloat16's rule), so these kernels
 * compute something other than the widening ones: backends/numpy_ref's
 * bf16dp_* functions are the reference, bit for bit. */
/* float32 -> bfloat16, nearest even; a NaN stays a (quiet) NaN */
static inline unsigned short cyf_bf16_round(float v)
{
    unsigned int u;
    memcpy(&u, &v, sizeof u);
    if (v != v)
        return (unsigned short)((u >> 16) | 0x40);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* xp[i] = the bf16 pair (x[2i], x[2i+1]) as one 32-bit lane (even input in
 * the low half), i < npad; inputs past n are zero */
static inline void cyf_bf16_pairs_of(const float *x, ptrdiff_t n, unsigned int *xp, ptrdiff_t npad)
{
    ptrdiff_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* 32 inputs at a time, cyf_bf16_round's integer steps in 16 lanes, the
     * rounded halves packed to 16 bits (vpmovdw): consecutive bf16 values
     * are the pairs.  (vcvtne2ps2bf16 would flush float32 denormals first,
     * which can differ where one rounds up to the least normal.) */
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    for (; 2 * i + 32 <= n && i + 16 <= npad; i += 16) {
        __m256i h[2];
        for (int c = 0; c < 2; c++) {
            const __m512 v = _mm512_loadu_ps(x + 2 * i + 16 * c);
            const __m512i u = _mm512_castps_si512(v), top = _mm512_srli_epi32(u, 16);
            const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(top, one)), 16);
            const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            h[c] = _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(r, nan, top, quiet));
        }
        _mm512_storeu_si512(xp + i, _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1));
    }
#endif
    for (; i < npad; i++) {
        const unsigned int lo = 2 * i < n ? cyf_bf16_round(x[2 * i]) : 0;
        const unsigned int hi = 2 * i + 1 < n ? cyf_bf16_round(x[2 * i + 1]) : 0;
        xp[i] = lo | hi << 16;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CYF_HAVE_BF16DP_KERNELS 1

/* x_r . row w of W [N, K] for NX rows of x given as bf16 pairs (xp, ldq
 * apart; NX a constant once inlined): out[r * ldo].  16 lanes per product,
 * lane i taking inputs 32t + 2i and 32t + 2i + 1 by vdpbf16ps (zeros past K),
 * then cyf_tree16's pairwise tree over the lanes. */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
cyf_bf16dp_dot(float *out, ptrdiff_t ldo, const unsigned int *xp, ptrdiff_t ldq, const int NX,
               const unsigned short *w, ptrdiff_t K)
{
    __m512 s[4];
#pragma GCC unroll 4
    for (int r = 0; r < NX; r++)
        s[r] = _mm512_setzero_ps();
    ptrdiff_t i = 0;
    for (; i + 32 <= K; i += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
#pragma GCC unroll 4
        for (int r = 0; r < NX; r++)
            s[r] = _mm512_dpbf16_ps(s[r], wv, (__m512bh)_mm512_loadu_si512(xp + r * ldq + i / 2));
    }
    if (i < K) {  /* the last inputs, masked: a missing weight is zero and meets a zero input */
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << (K - i)) - 1u), w + i);
#pragma GCC unroll 4
        for (int r = 0; r < NX; r++)
            s[r] = _mm512_dpbf16_ps(s[r], wv, (__m512bh)_mm512_loadu_si512(xp + r * ldq + i / 2));
    }
#pragma GCC unroll 4
    for (int r = 0; r < NX; r++)
        out[r * ldo] = cyf_tree16_512(s[r]);
}

/* x prepared once per product: its bf16 pairs, whole 512-bit loads (a
 * multiple of 64 bytes) */
static ptrdiff_t cyf_bf16dp_prep_bytes(ptrdiff_t K)
{
    return (K + 31) / 32 * 64;
}

static void cyf_bf16dp_prep(void *xp, const float *x, ptrdiff_t K)
{
    cyf_bf16_pairs_of(x, K, (unsigned int *)xp, (K + 31) / 32 * 16);
}

/* acc[j + r * nw] = prepared row r of x (ldxp bytes apart) . row a + j of
 * W [N, K]: one row of W at a time (four rows side by side read 2x slower
 * from DRAM: one core, 50257x768), each loaded once for up to 4 rows of x;
 * each output is one chain and tree, the same for any number of rows. */
__attribute__((target("avx512bf16")))
static void cyf_bf16dp_dot_tp_rows(float *acc, const void *xpv, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                   ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const unsigned int *xp = (const unsigned int *)xpv;
    const ptrdiff_t ldq = ldxp / 4;
    const unsigned short *Wd = (const unsigned short *)W->data + a * W->ld;
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int m = nr - r0 < 4 ? nr - r0 : 4;
        const unsigned int *x0 = xp + r0 * ldq;
        float *o = acc + r0 * nw;
        for (ptrdiff_t j = 0; j < nw; j++) {
            const unsigned short *w = Wd + j * W->ld;
            switch (m) {  /* a constant row count, so the sums stay in registers */
            case 4: cyf_bf16dp_dot(o + j, nw, x0, ldq, 4, w, K); break;
            case 3: cyf_bf16dp_dot(o + j, nw, x0, ldq, 3, w, K); break;
            case 2: cyf_bf16dp_dot(o + j, nw, x0, ldq, 2, w, K); break;
            default: cyf_bf16dp_dot(o + j, nw, x0, ldq, 1, w, K); break;
            }
        }
    }
}
#else
#define CYF_HAVE_BF16DP_KERNELS 0
#endif

/* ---- q8_0: GGUF's Q8_0 records, a row per output --------------------------
 * Each output's row is K/32 records of 34 bytes: an fp16 scale d_w, then 32
 * int8 codes (w = d_w * q).  The matrix is always read [N, K] (the Python
 * record's rows_out), so only dot_t, dot_t_rows and pack_t exist.  x is
 * quantized per block as for int8 (cyf_q8_block), and each output is
 * llama.cpp's vec_dot_q8_0_q8_0 in a fixed order that vectorises over the
 * blocks of one row (a row is one contiguous run, which the hardware
 * prefetcher streams): block b's term isum_b * float32(d_w,b * d_x,b),
 * isum_b the exact int32 sum of its 32 code products, is added with one
 * rounding (fmaf) into lane b % 16 of 16 partial sums, blocks in order,
 * and the lanes are added as halves (16 -> 8 -> 4 -> 2 -> 1, lane i with
 * lane i + half).  backends/numpy_ref's q8_0_matvec is the reference, bit
 * for bit. */
#define CYF_Q80_REC 34
#define CYF_Q80_LANES 16

/* fp16 bits -> float32, exactly (subnormals and specials included), at any
 * kernel level (x86-64-v2 has no F16C). */
static inline float cyf_half(const unsigned char *p)
{
    const unsigned h = (unsigned)p[0] | (unsigned)p[1] << 8;
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
    unsigned u;
    float f;
    if (e == 31)
        u = sign | 0x7F800000u | (m << 13);
    else if (e)
        u = sign | ((e + 112) << 23) | (m << 13);
    else {  /* zero or subnormal: m * 2^-24, exact */
        f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
}


/* One output: x's codes q and scales dx (nblk blocks) against row `row`. */
static inline float cyf_q80_row_dot(const signed char *q, const float *dx, const unsigned char *row, ptrdiff_t nblk)
{
    float s[CYF_Q80_LANES] = {0.0f};
    const ptrdiff_t npad = (nblk + CYF_Q80_LANES - 1) / CYF_Q80_LANES * CYF_Q80_LANES;
    for (ptrdiff_t b = 0; b < npad; b++) {
        float t = 0.0f;
        int isum = 0;
        if (b < nblk) {  /* past the last block: 0 * 0 added, as the vector kernel's padded lanes */
            const unsigned char *rec = row + b * CYF_Q80_REC;
            const signed char *w = (const signed char *)rec + 2, *qb = q + b * CYF_QB;
            for (int i = 0; i < CYF_QB; i++)
                isum += qb[i] * w[i];
            t = cyf_half(rec) * dx[b];
        }
        s[b % CYF_Q80_LANES] = __builtin_fmaf(t, (float)isum, s[b % CYF_Q80_LANES]);
    }
    return cyf_tree16(s);
}

static void cyf_q80_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                           ptrdiff_t K)
{
    (void)K;
    const unsigned char *row = (const unsigned char *)W->data + n * W->ld;
    ptrdiff_t k = 0;
    while (k < kn) {  /* a record's run at a time: its scale widened once */
        const ptrdiff_t b = (k0 + k) / CYF_QB, i0 = (k0 + k) % CYF_QB;
        const ptrdiff_t e = kn - k < CYF_QB - i0 ? kn - k : CYF_QB - i0;
        const unsigned char *rec = row + b * CYF_Q80_REC;
        const signed char *qs = (const signed char *)rec + 2 + i0;
        const float d = cyf_half(rec);
        for (ptrdiff_t i = 0; i < e; i++)
            dst[(k + i) * ldd] = (float)qs[i] * d;
        k += e;
    }
}


/* ---- q4_0: GGUF's Q4_0 records, a row per output --------------------------
 * q8_0's scheme with 18-byte records: an fp16 scale d_w, then 16 bytes,
 * byte j holding code j in its low nibble and code j + 16 in its high one
 * (w = d_w * (nibble - 8)).  Each output is the same fixed-order sum as
 * q8_0's (isum_b now the exact sum of q * (nibble - 8)); backends/numpy_ref's
 * q4_0_matvec is the reference, bit for bit. */
#define CYF_Q40_REC 18

static inline float cyf_q40_row_dot(const signed char *q, const float *dx, const unsigned char *row, ptrdiff_t nblk)
{
    float s[CYF_Q80_LANES] = {0.0f};
    const ptrdiff_t npad = (nblk + CYF_Q80_LANES - 1) / CYF_Q80_LANES * CYF_Q80_LANES;
    for (ptrdiff_t b = 0; b < npad; b++) {
        float t = 0.0f;
        int isum = 0;
        if (b < nblk) {  /* past the last block: 0 * 0 added, as the vector kernel's padded lanes */
            const unsigned char *rec = row + b * CYF_Q40_REC, *w = rec + 2;
            const signed char *qb = q + b * CYF_QB;
            for (int i = 0; i < CYF_QB / 2; i++)
                isum += qb[i] * ((w[i] & 15) - 8) + qb[i + CYF_QB / 2] * ((w[i] >> 4) - 8);
            t = cyf_half(rec) * dx[b];
        }
        s[b % CYF_Q80_LANES] = __builtin_fmaf(t, (float)isum, s[b % CYF_Q80_LANES]);
    }
    return cyf_tree16(s);
}

#if CYF_HAVE_AVX2_KERNELS
/* cyf_q80_row_dot / cyf_q40_row_dot with AVX2 and F16C, the same bits, 8
 * blocks at a time (lanes b % 16 < 8, then >= 8, of the 16 partial sums): each
 * block's 32 code products summed exactly by vpmaddubsw on |w| and the
 * codes with w's sign (pair sums below 2^15) and vpmaddwd, the 8 blocks'
 * lanes added by a vphaddd tree, their scales converted exactly by
 * vcvtph2ps, then the generic loops' float steps, lane by lane.  Blocks
 * past nblk are 0 * 0, as there.  q4_0's nibbles become codes in registers
 * (low ones elements 0..15, high ones 16..31, minus 8). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256i cyf_rec_codes_avx2_(const unsigned char *r, int nib)
{
    if (!nib)
        return _mm256_loadu_si256((const __m256i *)(r + 2));
    const __m128i m = _mm_set1_epi8(15), v = _mm_loadu_si128((const __m128i *)(r + 2));
    return _mm256_sub_epi8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m)),
                           _mm256_set1_epi8(8));
}

/* Blocks 0 .. nb - 1 of 8 (records rb, rec bytes apart) against MX rows of
 * x's codes (ldq apart): p[r][k] the vphaddd of blocks 2k and 2k + 1's
 * int32 pair sums (added as soon as they exist: fewer registers live),
 * h[i] the fp16 scales; 0 past nb. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void cyf_rec_blocks_avx2_(__m256i (*p)[4], short *h, const unsigned char *rb, ptrdiff_t rec,
                                        const signed char *q, ptrdiff_t ldq, int nb, int nib, const int MX)
{
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __m256i e[4][2];
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++) {
            const int i = 2 * k + u;
            if (i < nb) {
                const unsigned char *r1 = rb + i * rec;
                const __m256i w = cyf_rec_codes_avx2_(r1, nib), aw = _mm256_abs_epi8(w);
                h[i] = (short)(r1[0] | r1[1] << 8);
                for (int r = 0; r < MX; r++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q + r * ldq + i * CYF_QB));
                    e[r][u] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
                }
            } else {
                h[i] = 0;
                for (int r = 0; r < MX; r++)
                    e[r][u] = _mm256_setzero_si256();
            }
        }
        for (int r = 0; r < MX; r++)
            p[r][k] = _mm256_hadd_epi32(e[r][0], e[r][1]);
    }
}

/* s + (d_w * d_x) * isum for 8 blocks from bh: p their paired sums of
 * one row of x (cyf_rec_blocks_avx2_), dw their scales, d the row's scales */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 cyf_rec_half_avx2_(__m256 s, const __m256i *p, __m256 dw, const float *d, ptrdiff_t bh,
                                        ptrdiff_t nblk)
{
    /* vphaddd: lanes (0..3 | 4..7) of the 8 blocks' sums, then the halves added */
    const __m256i h03 = _mm256_hadd_epi32(p[0], p[1]), h47 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),
                                          _mm256_permute2x128_si256(h03, h47, 0x31));
    __m256 dv;
    if (bh + 8 <= nblk) {
        dv = _mm256_loadu_ps(d + bh);
    } else {
        float dl[8];
        for (int i = 0; i < 8; i++)
            dl[i] = bh + i < nblk ? d[bh + i] : 0.0f;
        dv = _mm256_loadu_ps(dl);
    }
    return _mm256_fmadd_ps(_mm256_mul_ps(dw, dv), _mm256_cvtepi32_ps(isum), s);
}

/* MX rows of x (codes q + r * ldq, scales dx + r * ldd) against one row of
 * records: each block's codes are loaded and made |w| once for all rows
 * (a batch's step had run one row at a time), every row's integer and
 * float steps the one-row kernel's.  16 blocks a step, lanes 0-7 then
 * 8-15, so the two partial sums are registers. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void cyf_rec_rows_avx2_(float *out, ptrdiff_t ldo, const signed char *q, ptrdiff_t ldq, const float *dx,
                                      ptrdiff_t ldd, const unsigned char *row, ptrdiff_t nblk, int nib, const int MX)
{
    const ptrdiff_t rec = nib ? CYF_Q40_REC : CYF_Q80_REC;
    const ptrdiff_t npad = (nblk + CYF_Q80_LANES - 1) / CYF_Q80_LANES * CYF_Q80_LANES;
    __m256 s0[4], s1[4];
    for (int r = 0; r < MX; r++)
        s0[r] = s1[r] = _mm256_setzero_ps();
    for (ptrdiff_t b0 = 0; b0 < npad; b0 += 16) {
        for (int half = 0; half < 2; half++) {
            const ptrdiff_t bh = b0 + 8 * half;
            __m256i p[4][4];
            short h[8];
            if (bh + 8 <= nblk)  /* 8 whole blocks: no test per block */
                cyf_rec_blocks_avx2_(p, h, row + bh * rec, rec, q + bh * CYF_QB, ldq, 8, nib, MX);
            else  /* past the last block: 0 * 0, as the generic loops */
                cyf_rec_blocks_avx2_(p, h, row + bh * rec, rec, q + bh * CYF_QB, ldq,
                                     bh < nblk ? (int)(nblk - bh) : 0, nib, MX);
            const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
#pragma GCC unroll 4
            for (int r = 0; r < MX; r++) {
                if (half)
                    s1[r] = cyf_rec_half_avx2_(s1[r], p[r], dw, dx + r * ldd, bh, nblk);
                else
                    s0[r] = cyf_rec_half_avx2_(s0[r], p[r], dw, dx + r * ldd, bh, nblk);
            }
        }
    }
    for (int r = 0; r < MX; r++)
        out[r * ldo] = cyf_tree16_ps(s0[r], s1[r]);
}

/* cyf_rec_rows_dot_fn with AVX2: 4 rows of x at a time, then 2, then 1
 * (in the v3 build, 8 rows of 3072x768: 897-908 us 4 at a time, 944-954
 * 2 at a time; q4_0 951-955 and 1068) */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void cyf_rec_rows_dot_avx2_(float *out, ptrdiff_t ldo, const signed char *q, const float *dx, int m,
                                          const unsigned char *row, ptrdiff_t nblk, int nib)
{
    const ptrdiff_t ldq = nblk * CYF_QB;
    int r = 0;
    for (; r + 4 <= m; r += 4)
        cyf_rec_rows_avx2_(out + r * ldo, ldo, q + r * ldq, ldq, dx + r * nblk, nblk, row, nblk, nib, 4);
    for (; r + 2 <= m; r += 2)
        cyf_rec_rows_avx2_(out + r * ldo, ldo, q + r * ldq, ldq, dx + r * nblk, nblk, row, nblk, nib, 2);
    if (r < m)
        cyf_rec_rows_avx2_(out + r * ldo, ldo, q + r * ldq, ldq, dx + r * nblk, nblk, row, nblk, nib, 1);
}

__attribute__((target("avx2,fma,f16c")))
static void cyf_q80_rows_dot_avx2(float *out, ptrdiff_t ldo, const signed char *q, const float *dx, int m,
                                  const unsigned char *row, ptrdiff_t nblk)
{
    cyf_rec_rows_dot_avx2_(out, ldo, q, dx, m, row, nblk, 0);
}

__attribute__((target("avx2,fma,f16c")))
static void cyf_q40_rows_dot_avx2(float *out, ptrdiff_t ldo, const signed char *q, const float *dx, int m,
                                  const unsigned char *row, ptrdiff_t nblk)
{
    cyf_rec_rows_dot_avx2_(out, ldo, q, dx, m, row, nblk, 1);
}
#endif

/* m rows of x (codes q nblk * CYF_QB apart, scales dx nblk apart) against
 * one row of records: out[r * ldo] */
typedef void (*cyf_rec_rows_dot_fn)(float *out, ptrdiff_t ldo, const signed char *q, const float *dx, int m,
                                    const unsigned char *row, ptrdiff_t nblk);

static inline void cyf_rec_dot_t_rows_(float *acc, const float *x, ptrdiff_t ldx, int nr, const cyf_wt *W,
                                       ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K, cyf_rec_rows_dot_fn rows_dot)
{
    const ptrdiff_t nblk = K / CYF_QB;
    if (nblk == 0 || nr <= 0) {
        for (ptrdiff_t j = 0; j < nw * (nr > 0 ? nr : 0); j++)
            acc[j] = 0.0f;
        return;
    }
    signed char q[8 * nblk * CYF_QB];
    float d[8 * nblk];
    for (int r0 = 0; r0 < nr; r0 += 8) {
        const int m = nr - r0 < 8 ? nr - r0 : 8;
        for (int r = 0; r < m; r++)
            cyf_q8_row(x + (r0 + r) * ldx, K, q + r * nblk * CYF_QB, d + r * nblk, NULL);
        for (ptrdiff_t j = 0; j < nw; j++)
            rows_dot(acc + r0 * nw + j, nw, q, d, m, (const unsigned char *)W->data + (a + j) * W->ld, nblk);
    }
}

#define CYF_REC_DOT_T(NAME, ROWS_DOT)                                                                      \
static void NAME##_dot_t(float *acc, const float *x, const cyf_wt *W, ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)  \
{                                                                                                          \
    cyf_rec_dot_t_rows_(acc, x, 0, 1, W, a, nw, K, ROWS_DOT);                                              \
}                                                                                                          \
static void NAME##_dot_t_rows(float *acc, const float *x, ptrdiff_t ldx, int nr, const cyf_wt *W, ptrdiff_t a, \
                              ptrdiff_t nw, ptrdiff_t K)                                                   \
{                                                                                                          \
    cyf_rec_dot_t_rows_(acc, x, ldx, nr, W, a, nw, K, ROWS_DOT);                                           \
}

/* The generic loops' rows: one row_dot each */
#define CYF_REC_ROWS_GENERIC(NAME, ROW_DOT)                                                                \
static void NAME(float *out, ptrdiff_t ldo, const signed char *q, const float *dx, int m,                 \
                 const unsigned char *row, ptrdiff_t nblk)                                                 \
{                                                                                                          \
    for (int r = 0; r < m; r++)                                                                            \
        out[r * ldo] = ROW_DOT(q + r * nblk * CYF_QB, dx + r * nblk, row, nblk);                           \
}
CYF_REC_ROWS_GENERIC(cyf_q80_rows_dot, cyf_q80_row_dot)
CYF_REC_ROWS_GENERIC(cyf_q40_rows_dot, cyf_q40_row_dot)

CYF_REC_DOT_T(cyf_q80, cyf_q80_rows_dot)
#if CYF_HAVE_AVX2_KERNELS
CYF_REC_DOT_T(cyf_q80_avx2, cyf_q80_rows_dot_avx2)
CYF_REC_DOT_T(cyf_q40_avx2, cyf_q40_rows_dot_avx2)
#endif

CYF_REC_DOT_T(cyf_q40, cyf_q40_rows_dot)
#undef CYF_REC_DOT_T

static void cyf_q40_pack_t(float *dst, ptrdiff_t ldd, const cyf_wt *W, ptrdiff_t n, ptrdiff_t k0, ptrdiff_t kn,
                           ptrdiff_t K)
{
    (void)K;
    const unsigned char *row = (const unsigned char *)W->data + n * W->ld;
    ptrdiff_t k = 0;
    while (k < kn) {  /* a record's run at a time: its scale widened once */
        const ptrdiff_t b = (k0 + k) / CYF_QB, i0 = (k0 + k) % CYF_QB;
        const ptrdiff_t e = kn - k < CYF_QB - i0 ? kn - k : CYF_QB - i0;
        const unsigned char *rec = row + b * CYF_Q40_REC;
        const float d = cyf_half(rec);
        for (ptrdiff_t i = i0; i < i0 + e; i++) {
            const int nib = i < CYF_QB / 2 ? rec[2 + i] & 15 : rec[2 + i - CYF_QB / 2] >> 4;
            dst[(k + i - i0) * ldd] = (float)(nib - 8) * d;
        }
        k += e;
    }
}

#if CYF_HAVE_VNNI_KERNELS
/* ---- q8_0 and q4_0 with VNNI ---------------------------------------------
 * A row at a time, 16 blocks (a chunk) per step.  Each of a block's two
 * halves of 16 codes (q8_0's bytes 0-15 and 16-31, the sign bit flipped;
 * q4_0's low and high nibbles of its 16 bytes, as they lie) goes in a
 * 128-bit lane, four blocks to a register, against x's codes laid out to
 * match (cyf_rec_x): two vpdpbusd leave 4 int32 lanes per block.  One
 * unpack-add round over the chunk's four results, then one over its two,
 * leaves block 4j + i in lane 4i + j (cyf_rec_sigma, a 4 x 4 transpose);
 * x's scales and code sums and the weights' scales (word permutes of the
 * records' bytes, not a gather) are kept in that order, so each lane's
 * float steps are the generic loop's for its block, and one permute puts
 * the lanes back before the tree.  The codes' +128 (q8_0) or the nibbles'
 * +8 (q4_0) times x's codes' sum is taken off, so isum is exact.  The
 * earlier kernels paired blocks in 256-bit halves (q4_0's nibbles moved
 * into element order by two shuffles a block) and reduced 8 lanes a block,
 * three times the steps for each row of x. */
static const int cyf_rec_sigma[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* The chunk's blocks 4g .. 4g + 3 (nb present in the chunk): lo and hi,
 * the codes 0-15 and 16-31 of each block in its 128-bit lane, 0 past nb
 * (no record read past the row). */
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_rec_w4(__m512i *lo, __m512i *hi, const unsigned char *rc, int g, ptrdiff_t nb, int nib,
                              const int all)
{
    if (nib) {
        __m128i l[4];
        for (int i = 0; i < 4; i++)
            l[i] = all || 4 * g + i < nb ? _mm_loadu_si128((const __m128i *)(rc + (4 * g + i) * CYF_Q40_REC + 2))
                                         : _mm_setzero_si128();
        const __m512i a = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(l[0]), l[1], 1), l[2], 2), l[3], 3);
        const __m512i m = _mm512_set1_epi8(15);
        *lo = _mm512_and_si512(a, m);
        *hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m);
    } else {  /* whole blocks in 256-bit halves, then their halves of 16 codes regrouped, + 128 (the sign bit) */
        __m256i f[4];
        for (int i = 0; i < 4; i++)
            f[i] = all || 4 * g + i < nb ? _mm256_loadu_si256((const __m256i *)(rc + (4 * g + i) * CYF_Q80_REC + 2))
                                         : _mm256_setzero_si256();
        const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(f[0]), f[1], 1);  /* b0lo b0hi b1lo b1hi */
        const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(f[2]), f[3], 1);
        const __m512i flip = _mm512_set1_epi8((char)0x80);  /* 0 past nb: x's codes there are 0 */
        *lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0x88), flip);
        *hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0xDD), flip);
    }
}

/* The chunk's weights: wv[2g], wv[2g + 1] for the groups holding a block */
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_rec_w(__m512i *wv, const unsigned char *rc, ptrdiff_t nb, int nib)
{
    for (int g = 0; g < 4; g++)
        if (4 * g + 3 < nb)  /* all four blocks here: no test per block */
            cyf_rec_w4(&wv[2 * g], &wv[2 * g + 1], rc, g, nb, nib, 1);
        else if (4 * g < nb)
            cyf_rec_w4(&wv[2 * g], &wv[2 * g + 1], rc, g, nb, nib, 0);
}

/* The 64 bytes of a chunk from byte off, those past its first `bytes` read
 * as 0 (not read: the last chunk of a row). */
__attribute__((target("avx512vnni"), always_inline))
static inline __m512i cyf_rec_window(const unsigned char *rc, ptrdiff_t off, ptrdiff_t bytes)
{
    if (bytes - off >= 64)
        return _mm512_loadu_si512(rc + off);
    return _mm512_maskz_loadu_epi8(bytes <= off ? 0 : ((__mmask64)1 << (bytes - off)) - 1, rc + off);
}

/* The chunk's 16 fp16 scales in cyf_rec_sigma's order, 0 past nb (lane p:
 * block 4 (p % 4) + p / 4).  q8_0's record is 17 words, so blocks 4i ..
 * 4i + 3 have theirs at words 0, 17, 34, 51 of the 64 from block 4i's
 * record: one word permute per 4 blocks.  q4_0's is 9 words: blocks 0..7
 * at 9b in the chunk's first 64 words, 8..15 at 9b - 72 in the 64 from
 * word 72: two permutes. */
static const short cyf_q80_dw_idx[32] = {0, 0, 0, 0, 17, 17, 17, 17, 34, 34, 34, 34, 51, 51, 51, 51};
static const short cyf_q40_dw_idx[2][32] = {
    {0, 36, 0, 0, 9, 45, 0, 0, 18, 54, 0, 0, 27, 63},
    {0, 0, 0, 36, 0, 0, 9, 45, 0, 0, 18, 54, 0, 0, 27, 63},
};

__attribute__((target("avx512vnni"), always_inline))
static inline __m512 cyf_rec_dw(const unsigned char *rc, ptrdiff_t nb, int nib)
{
    __m512i r;
    if (nib) {
        const ptrdiff_t bytes = nb * CYF_Q40_REC;
        const __m512i lo = _mm512_permutex2var_epi16(cyf_rec_window(rc, 0, bytes),
                                                     _mm512_loadu_si512(cyf_q40_dw_idx[0]), cyf_rec_window(rc, 64, bytes));
        const __m512i hi = _mm512_permutex2var_epi16(cyf_rec_window(rc, 144, bytes),
                                                     _mm512_loadu_si512(cyf_q40_dw_idx[1]), cyf_rec_window(rc, 208, bytes));
        r = _mm512_mask_blend_epi16(0xCCCC, lo, hi);  /* lanes whose block is 8..15 */
    } else {
        const ptrdiff_t bytes = nb * CYF_Q80_REC;
        const __m512i idx = _mm512_loadu_si512(cyf_q80_dw_idx);
        r = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {  /* blocks 4i + j in lanes 4j + i */
            const ptrdiff_t off = i * 4 * CYF_Q80_REC;
            r = _mm512_mask_blend_epi16((__mmask32)(0x1111u << i), r,
                                        _mm512_permutex2var_epi16(cyf_rec_window(rc, off, bytes), idx,
                                                                  cyf_rec_window(rc, off + 64, bytes)));
        }
    }
    return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
}

/* s += (d_w * d_x) * isum per lane (in cyf_rec_sigma's order) for one
 * chunk of nb blocks: wv the weights (cyf_rec_w), xv x's codes, bsum and dx
 * in sigma's order, dw the weights' scales in it (cyf_rec_dw). */
__attribute__((target("avx512vnni"), always_inline))
static inline __m512 cyf_rec_chunk(__m512 s, const __m512i *wv, const unsigned char *xv, const int *bsum, __m512 dw,
                                   const float *dx, ptrdiff_t nb)
{
    const __m512i zero = _mm512_setzero_si512();
    __m512i u[4] = {zero, zero, zero, zero}, t1 = zero;
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++)
        if (4 * g < nb)
            u[g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, wv[2 * g], _mm512_loadu_si512(xv + 2 * g * 64)),
                                       wv[2 * g + 1], _mm512_loadu_si512(xv + (2 * g + 1) * 64));
    /* per 128-bit lane i: (a0+a2, b0+b2, a1+a3, b1+b3) of blocks i and 4 + i, ... */
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[0], u[1]), _mm512_unpackhi_epi32(u[0], u[1]));
    if (nb > 8)
        t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[2], u[3]), _mm512_unpackhi_epi32(u[2], u[3]));
    /* ... then lane 4i + j: block 4j + i's sum */
    const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1)),
                                          _mm512_loadu_si512(bsum));
    return _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_loadu_ps(dx)), _mm512_cvtepi32_ps(isum), s);
}

/* x's codes per chunk c, group g: vector 2g the codes 0..15 of blocks
 * 4g .. 4g + 3 (16 bytes each), vector 2g + 1 their codes 16..31; d and
 * bsum in cyf_rec_sigma's order, 0 past nblk: bsum 128 * the codes' sums
 * (q8_0's flipped sign bit) or 8 * (q4_0's nibbles' +8), div 1 or 16. */
__attribute__((target("avx512vnni")))
static inline void cyf_rec_x(const float *x, ptrdiff_t K, ptrdiff_t nblk, ptrdiff_t nch, signed char *q, float *d,
                             int *sum4, int *bsum, unsigned char *xv, int div)
{
    const ptrdiff_t npad = nch * CYF_Q80_LANES;
    memset(q, 0, (size_t)(npad * CYF_QB));
    cyf_q8_row(x, K, q, d, sum4);  /* d [nblk] in block order first */
    for (ptrdiff_t c = 0; c < nch; c++) {
        float db[CYF_Q80_LANES];
        int bb[CYF_Q80_LANES];
        for (int k = 0; k < CYF_Q80_LANES; k++) {
            const ptrdiff_t b = c * CYF_Q80_LANES + k;
            int sb = 0;  /* 128 * the codes' sum */
            for (int l = 0; b < nblk && l < CYF_QB / 4; l++)
                sb += sum4[b * (CYF_QB / 4) + l];
            db[k] = b < nblk ? d[b] : 0.0f;
            bb[k] = sb / div;
        }
        for (int p = 0; p < CYF_Q80_LANES; p++) {
            d[c * CYF_Q80_LANES + p] = db[cyf_rec_sigma[p]];
            bsum[c * CYF_Q80_LANES + p] = bb[cyf_rec_sigma[p]];
        }
        for (int g = 0; g < 4; g++) {
            const signed char *qg = q + (c * CYF_Q80_LANES + 4 * g) * CYF_QB;  /* blocks 4g .. 4g + 3, 128 bytes */
            const __m512i a = _mm512_loadu_si512(qg), b = _mm512_loadu_si512(qg + 64);  /* lanes: b0lo b0hi b1lo b1hi | ... */
            _mm512_storeu_si512(xv + (c * 8 + 2 * g) * 64, _mm512_shuffle_i64x2(a, b, 0x88));      /* lanes 0, 2 of a, b */
            _mm512_storeu_si512(xv + (c * 8 + 2 * g + 1) * 64, _mm512_shuffle_i64x2(a, b, 0xDD));  /* lanes 1, 3 */
        }
    }
}

/* A row of x prepared for the record kernels (the rows' `prep`, cyf_rec_x):
 * its codes laid out as the weights are read (nch * 8 vectors of 64 bytes),
 * then the block scales d [npad] and code sums bsum [npad] in the lanes'
 * order. */
static ptrdiff_t cyf_rec_prep_bytes(ptrdiff_t K)
{
    return (K / CYF_QB + CYF_Q80_LANES - 1) / CYF_Q80_LANES * (8 * 64 + 8 * CYF_Q80_LANES);
}

#define CYF_REC_D(xp, nch) ((const float *)((const unsigned char *)(xp) + (nch) * 8 * 64))
#define CYF_REC_BSUM(xp, nch) ((const int *)(CYF_REC_D(xp, nch) + (nch) * CYF_Q80_LANES))

__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_rec_prep_(void *xp, const float *x, ptrdiff_t K, int nib)
{
    const ptrdiff_t nblk = K / CYF_QB, nch = (nblk + CYF_Q80_LANES - 1) / CYF_Q80_LANES, npad = nch * CYF_Q80_LANES;
    signed char q[npad * CYF_QB + 1];
    int sum4[npad * (CYF_QB / 4) + 1];
    unsigned char *xv = (unsigned char *)xp;
    float *d = (float *)(xv + nch * 8 * 64);
    cyf_rec_x(x, K, nblk, nch, q, d, sum4, (int *)(d + npad), xv, nib ? 16 : 1);
}

__attribute__((target("avx512vnni")))
static void cyf_q80_prep(void *xp, const float *x, ptrdiff_t K)
{
    cyf_rec_prep_(xp, x, K, 0);
}

__attribute__((target("avx512vnni")))
static void cyf_q40_prep(void *xp, const float *x, ptrdiff_t K)
{
    cyf_rec_prep_(xp, x, K, 1);
}

/* Decode of a row of records for nr prepared rows of x (ldxp bytes apart;
 * dot_t: nr = 1): each chunk of a row of W is unpacked once into registers
 * for up to 16 rows of x, whose sums wait in memory between chunks (one
 * load and store per 512 inputs); every row's arithmetic is the one-row
 * kernel's, so are its bits (cyf_rec_chunk).  K < 32 (no block) gives
 * zeros, as the generic loops do. */
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_rec_rows_vnni_(float *acc, const void *xpv, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                      ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K, int nib, const int MAXR)
{
    const ptrdiff_t nblk = K / CYF_QB, ld = W->ld, rec = nib ? CYF_Q40_REC : CYF_Q80_REC;
    const ptrdiff_t nch = (nblk + CYF_Q80_LANES - 1) / CYF_Q80_LANES;
    const unsigned char *xp = (const unsigned char *)xpv;
    __m512i wv[8];
    __m512 s[16];
    for (int r0 = 0; r0 < nr; r0 += MAXR) {
        const int m = nr - r0 < MAXR ? nr - r0 : MAXR;
        for (ptrdiff_t j = 0; j < nw; j++) {
            const unsigned char *row = (const unsigned char *)W->data + (a + j) * ld;
            for (int r = 0; r < m; r++)
                s[r] = _mm512_setzero_ps();
            for (ptrdiff_t c = 0; c < nch; c++) {
                const unsigned char *rc = row + c * CYF_Q80_LANES * rec;
                const ptrdiff_t nb = nblk - c * CYF_Q80_LANES < CYF_Q80_LANES ? nblk - c * CYF_Q80_LANES
                                                                              : CYF_Q80_LANES;
                cyf_rec_w(wv, rc, nb, nib);
                const __m512 dw = cyf_rec_dw(rc, nb, nib);
                for (int r = 0; r < m; r++) {
                    const unsigned char *xr = xp + (r0 + r) * ldxp;
                    s[r] = cyf_rec_chunk(s[r], wv, xr + c * 8 * 64, CYF_REC_BSUM(xr, nch) + c * CYF_Q80_LANES, dw,
                                         CYF_REC_D(xr, nch) + c * CYF_Q80_LANES, nb);
                }
            }
            /* the lanes back in block order (sigma is its own inverse) */
            const __m512i back = _mm512_loadu_si512(cyf_rec_sigma);
            for (int r = 0; r < m; r++)
                acc[(r0 + r) * nw + j] = cyf_tree16_512(_mm512_permutexvar_ps(back, s[r]));
        }
    }
}

__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_rec_dot_tp_vnni_(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                        ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K, int nib)
{
    if (nr == 1)  /* its sum stays in a register: decode */
        cyf_rec_rows_vnni_(acc, xp, ldxp, 1, W, a, nw, K, nib, 1);
    else
        cyf_rec_rows_vnni_(acc, xp, ldxp, nr, W, a, nw, K, nib, 16);
}

__attribute__((target("avx512vnni")))
static void cyf_q80_dot_tp_rows_vnni(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W, ptrdiff_t a,
                                     ptrdiff_t nw, ptrdiff_t K)
{
    cyf_rec_dot_tp_vnni_(acc, xp, ldxp, nr, W, a, nw, K, 0);
}

__attribute__((target("avx512vnni")))
static void cyf_q40_dot_tp_rows_vnni(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W, ptrdiff_t a,
                                     ptrdiff_t nw, ptrdiff_t K)
{
    cyf_rec_dot_tp_vnni_(acc, xp, ldxp, nr, W, a, nw, K, 1);
}
#endif

#include "amx.h"  /* the model of AMX's tile instructions: every level has it (a test hook) */
#include "qgemm.h"
#include "bgemm.h"

/* ---- the table, indexed by cyformer/formats.py's Format.code ------------- */
static cyf_format cyf_formats[] = {
    {"float32", "float32 FMA", 0, 1, cyf_f32_gemv_block, cyf_f32_gemv_block_rows, cyf_f32_dot_t, cyf_f32_dot_t_rows,
     cyf_f32_pack_run, cyf_f32_pack_t},
    /* always [N, K] (rows_out): no [K, N] kernels */
    {"bfloat16", "widened to float32, FMA", 0, 0, NULL, NULL, cyf_bf16_dot_t, NULL, NULL, cyf_bf16_pack_t},
    {"int8", "int8 activations in decode and prefill, generic integer loops", 1, 0, NULL, NULL,
     NULL, NULL, NULL, cyf_i8_pack_t, NULL, cyf_i8q_prep_bytes, cyf_i8q_prep,
     cyf_i8q_dot_tp_rows_generic},
    {"int4", "int8 activations in decode and prefill, generic integer loops", 0, 0, NULL, NULL,
     NULL, NULL, NULL, cyf_i4_pack_t, NULL, cyf_i4q_prep_bytes, cyf_i4q_prep,
     cyf_i4q_dot_tp_rows_generic},
    {"q8_0", "[N, K]: int8 activations, generic integer loops", 0, 0, NULL, NULL, cyf_q80_dot_t,
     cyf_q80_dot_t_rows, NULL, cyf_q80_pack_t},
    {"q4_0", "[N, K]: int8 activations, generic integer loops", 0, 0, NULL, NULL, cyf_q40_dot_t,
     cyf_q40_dot_t_rows, NULL, cyf_q40_pack_t},
};
#define CYF_NFORMATS ((int)(sizeof cyf_formats / sizeof cyf_formats[0]))

/* Row `code` of the table, or NULL past its end. */
static inline const cyf_format *cyf_format_at(int code)
{
    return code >= 0 && code < CYF_NFORMATS ? &cyf_formats[code] : NULL;
}

/* bfloat16's row: vdpbf16ps with AVX512-BF16 (bit 2), else widening; the bit used */
static inline int cyf_formats_select_bf16(int features)
{
    cyf_format *bf = &cyf_formats[1];
    if (CYF_HAVE_BF16DP_KERNELS && (features & 2)) {
#if CYF_HAVE_BF16DP_KERNELS
        bf->dot_t = NULL;
        bf->dot_t_rows = NULL;
        bf->prep_bytes = cyf_bf16dp_prep_bytes;
        bf->prep = cyf_bf16dp_prep;
        bf->dot_tp_rows = cyf_bf16dp_dot_tp_rows;
        bf->bgemm = &cyf_bf16_bgemm;
        bf->kernels = "bf16 activations in decode and prefill, AVX512-BF16 vdpbf16ps";
        /* prefill on AMX-BF16 (128), or on its model (16: tests) */
        const int amx = features & 128 ? 0 : features & 16 ? 1 : -1;
        if (amx >= 0) {
            bf->bgemm = &cyf_bf16_bgemm_amx[amx];
            bf->kernels = amx ? "bf16 activations in decode and prefill; decode: AVX512-BF16 vdpbf16ps, prefill: a C "
                                "model of AMX tdpbf16ps (tests)"
                              : "bf16 activations in decode and prefill; decode: AVX512-BF16 vdpbf16ps, prefill: AMX "
                                "tdpbf16ps";
            return 2 | (amx ? 16 : 128);
        }
#endif
        return 2;
    }
    bf->dot_t = cyf_bf16_dot_t;
    bf->dot_t_rows = NULL;
    bf->prep_bytes = NULL;
    bf->prep = NULL;
    bf->dot_tp_rows = NULL;
    bf->bgemm = NULL;
    bf->kernels = "widened to float32, FMA";
    return 0;
}

/* q8_0's and q4_0's rows: their VNNI kernels where the CPU has them. */
static inline void cyf_q80_select(int vnni)
{
    cyf_format *q80 = &cyf_formats[4], *q40 = &cyf_formats[5];
#if CYF_HAVE_VNNI_KERNELS
    if (vnni) {
        q80->dot_t = NULL;
        q80->dot_t_rows = NULL;
        q80->prep_bytes = cyf_rec_prep_bytes;
        q80->prep = cyf_q80_prep;
        q80->dot_tp_rows = cyf_q80_dot_tp_rows_vnni;
        q80->qgemm = &cyf_q80_qgemm_vnni;
        q80->kernels = "[N, K]: int8 activations in decode and prefill, AVX512-VNNI vpdpbusd";
        q40->dot_t = NULL;
        q40->dot_t_rows = NULL;
        q40->prep_bytes = cyf_rec_prep_bytes;
        q40->prep = cyf_q40_prep;
        q40->dot_tp_rows = cyf_q40_dot_tp_rows_vnni;
        q40->qgemm = &cyf_q40_qgemm_vnni;
        q40->kernels = "[N, K]: int8 activations in decode and prefill, AVX512-VNNI vpdpbusd";
        return;
    }
#endif
    (void)vnni;
    /* no integer GEMM here: the generic tile is slower than the float panels */
    q80->dot_t = cyf_q80_dot_t;
    q80->dot_t_rows = cyf_q80_dot_t_rows;
    q80->prep_bytes = q40->prep_bytes = NULL;
    q80->prep = q40->prep = NULL;
    q80->dot_tp_rows = q40->dot_tp_rows = NULL;
    q80->qgemm = NULL;
    q80->kernels = "[N, K]: int8 activations in decode, generic integer loops; prefill: widened to float32, FMA";
    q40->dot_t = cyf_q40_dot_t;
    q40->dot_t_rows = cyf_q40_dot_t_rows;
    q40->qgemm = NULL;
    q40->kernels = q80->kernels;
}

/* Point each row at the best kernels this CPU runs: features as
 * cyformer._runtime.cpu_features()'s bits (1: AVX512-VNNI, 2: AVX512-BF16,
 * 4: AVX2 and FMA, x86-64-v3; with AVX512-VNNI, 8: AMX-INT8 granted by the
 * OS, 16: the C model of AMX instead, which tests choose; with AVX2 and no
 * AVX512-VNNI, 32: AVX-VNNI, 64: its tile in AVX512-VNNI's encoding, which
 * tests choose; with AVX512-BF16, 128: AMX-BF16 granted by the OS, 16 its
 * model too).
 * Called once at import (and by tests, to run every variant); returns the
 * bits used. */
static inline int cyf_formats_select(int features)
{
    cyf_format *i8 = &cyf_formats[2], *i4 = &cyf_formats[3];
    const int bf16 = cyf_formats_select_bf16(features);
    cyf_q80_select(CYF_HAVE_VNNI_KERNELS && (features & 1));
    if (CYF_HAVE_VNNI_KERNELS && (features & 1)) {
#if CYF_HAVE_VNNI_KERNELS
        i8->dot_tp_rows = cyf_i8q_dot_tp_rows_vnni;
        i8->kernels = "int8 activations in decode and prefill, AVX512-VNNI vpdpbusd";
        i4->prep = cyf_i4q_prep_vnni;
        i4->dot_tp_rows = cyf_i4q_dot_tp_rows_vnni;
        i8->qgemm = &cyf_i8_qgemm_vnni;
        i4->qgemm = &cyf_i4_qgemm_vnni;
        i4->kernels = "int8 activations in decode and prefill, AVX512-VNNI vpdpbusd";
        /* prefill on AMX (8), or on its model (16: tests) */
        const int amx = features & 8 ? 0 : features & 16 ? 1 : -1;
        if (amx >= 0) {
            cyf_format *rows[4] = {i8, i4, &cyf_formats[4], &cyf_formats[5]};
            static const char *const said[2][2] = {
                {"int8 activations in decode and prefill; decode: AVX512-VNNI vpdpbusd, prefill: AMX tdpbsud",
                 "[N, K]: int8 activations in decode and prefill; decode: AVX512-VNNI vpdpbusd, prefill: AMX tdpbsud"},
                {"int8 activations in decode and prefill; decode: AVX512-VNNI vpdpbusd, prefill: a C model of AMX "
                 "tdpbsud (tests)",
                 "[N, K]: int8 activations in decode and prefill; decode: AVX512-VNNI vpdpbusd, prefill: a C model "
                 "of AMX tdpbsud (tests)"}};
            for (int i = 0; i < 4; i++) {
                rows[i]->qgemm = &cyf_qgemm_amx[amx][i];
                rows[i]->kernels = said[amx][i >= 2];
            }
            return bf16 | 1 | (amx ? 16 : 8);
        }
#endif
        return bf16 | 1;
    }
    i8->dot_tp_rows = cyf_i8q_dot_tp_rows_generic;
    i8->kernels = "int8 activations in decode and prefill, generic integer loops";
    i4->prep = cyf_i4q_prep;
    i4->dot_tp_rows = cyf_i4q_dot_tp_rows_generic;
    i8->qgemm = &cyf_i8_qgemm_generic;
    i4->qgemm = &cyf_i4_qgemm_generic;
    i4->kernels = "int8 activations in decode and prefill, generic integer loops";
    if (CYF_HAVE_AVX2_KERNELS && (features & 4)) {
#if CYF_HAVE_AVX2_KERNELS
        i8->dot_tp_rows = cyf_i8q_dot_tp_rows_avx2;
        i8->qgemm = &cyf_i8_qgemm_avx2;
        i8->kernels = "int8 activations in decode and prefill, AVX2 vpmaddubsw + vpmaddwd";
        i4->dot_tp_rows = cyf_i4q_dot_tp_rows_avx2;
        i4->qgemm = &cyf_i4_qgemm_avx2;
        cyf_formats[4].qgemm = &cyf_q80_qgemm_avx2;
        cyf_formats[5].qgemm = &cyf_q40_qgemm_avx2;
        cyf_formats[4].dot_t = cyf_q80_avx2_dot_t;
        cyf_formats[4].dot_t_rows = cyf_q80_avx2_dot_t_rows;
        cyf_formats[5].dot_t = cyf_q40_avx2_dot_t;
        cyf_formats[5].dot_t_rows = cyf_q40_avx2_dot_t_rows;
        cyf_formats[4].kernels = cyf_formats[5].kernels =
            "[N, K]: int8 activations in decode and prefill, AVX2 vpmaddubsw + vpmaddwd";
        i4->kernels = "int8 activations in decode and prefill, AVX2 vpmaddubsw + vpmaddwd";
        /* vpdpbusd on 8 lanes: AVX-VNNI (32), or its EVEX form (64: tests) */
        const int v256 = CYF_HAVE_AVXVNNI_KERNELS && (features & 32) ? 0 : features & 64 ? 1 : -1;
        if (v256 >= 0) {
            cyf_format *rows[4] = {i8, i4, &cyf_formats[4], &cyf_formats[5]};
            static const char *const said[2][3] = {
                {"int8 activations in decode and prefill; decode: AVX2 vpmaddubsw + vpmaddwd, prefill: AVX-VNNI "
                 "vpdpbusd",
                 "int8 activations in decode and prefill, AVX-VNNI vpdpbusd",
                 "[N, K]: int8 activations in decode and prefill; decode: AVX2 vpmaddubsw + vpmaddwd, prefill: "
                 "AVX-VNNI vpdpbusd"},
                {"int8 activations in decode and prefill; decode: AVX2 vpmaddubsw + vpmaddwd, prefill: AVX-VNNI's "
                 "tile with AVX512-VNNI's 256-bit vpdpbusd (tests)",
                 "int8 activations in decode and prefill, AVX-VNNI's kernels with AVX512-VNNI's 256-bit vpdpbusd "
                 "(tests)",
                 "[N, K]: int8 activations in decode and prefill; decode: AVX2 vpmaddubsw + vpmaddwd, prefill: "
                 "AVX-VNNI's tile with AVX512-VNNI's 256-bit vpdpbusd (tests)"}};
            for (int i = 0; i < 4; i++) {
                rows[i]->qgemm = &cyf_qgemm_vnni256[v256][i];
                rows[i]->kernels = said[v256][i < 2 ? i : 2];
            }
#if CYF_HAVE_AVXVNNI_KERNELS
            i4->dot_tp_rows = v256 ? cyf_i4q_dot_tp_rows_vnni256 : cyf_i4q_dot_tp_rows_avxvnni;
#else
            i4->dot_tp_rows = cyf_i4q_dot_tp_rows_vnni256;
#endif
            return bf16 | 4 | (v256 ? 64 : 32);
        }
#endif
        return bf16 | 4;
    }
    return bf16;
}

/* The embedding lookup: out[k] = W(n, k), k < K, of W [N, K] as scaled float32. */
static inline void cyf_dequant_row_t(float *out, const cyf_wt *W, ptrdiff_t n, ptrdiff_t K)
{
    W->f->pack_t(out, 1, W, n, 0, K, K);
}

#endif
