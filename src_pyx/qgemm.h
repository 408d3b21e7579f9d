/* The integer GEMM of int8 and int4 weights (prefill): a format row's
 * optional `qgemm` (formats.h).  Included by formats.h after cyf_q8_block.
 *
 * Each row of x is quantized once per product exactly as decode does
 * (cyf_q8_row: the same codes q and block scales d), the weights are packed
 * a panel at a time into a VNNI layout (below), and a register tile of
 * CYF_QMR rows by CYF_QNR outputs sums exact int32 products per block of
 * CYF_QB inputs.  The float arithmetic is the matrix-vector path's, term by
 * term: for each run of bpp blocks (linalg's GEMV_ROWS rows) a partial sum
 * p = fma(d_b, isum_b, p) from 0 in block order (int4: (d_b * s_b) first),
 * the partials added in order: backends/numpy_ref's q8_matvec /
 * grouped_matvec of the transposed codes, bit for bit on any CPU.  Every
 * format with a qgemm is stored a row per output (rows_out) and decodes
 * in lanes (q8_matvec_t, q4_matvec_t, q8_0_matvec): the same integer
 * products summed in another float order. */
#ifndef CYFORMER_QGEMM_H
#define CYFORMER_QGEMM_H

#define CYF_QMR 6   /* rows of x per register tile: 12 int32 + 12 float accumulators */
#define CYF_QNR 32  /* outputs per packed strip: two vectors of 16 int32 lanes */
#define CYF_AMR 16  /* rows of x per AMX tile: a tile register's 16 rows */
#define CYF_QMR_MAX (CYF_QMR > CYF_AMR ? CYF_QMR : CYF_AMR)  /* the most rows any tile takes (the driver's tile buffer) */

/* A packed strip of CYF_QNR outputs, for K inputs in nblk = ceil(K / CYF_QB)
 * blocks (Kp = nblk * CYF_QB):
 *   codes  [Kp / 4][CYF_QNR][4] bytes: w + 128 (unsigned, vpdpbusd's first
 *          operand), 4 consecutive inputs of one output per int32 lane;
 *          inputs past K and outputs past N hold w = 0;
 *   scales [nblk][CYF_QNR] floats: int4's group scales (unused for int8).
 * The code of an input past K meets an activation code 0, so its value
 * never matters; it is set for tidiness. */
static inline ptrdiff_t cyf_qstrip_bytes(ptrdiff_t K)
{
    const ptrdiff_t nblk = (K + CYF_QB - 1) / CYF_QB;
    return nblk * CYF_QB * CYF_QNR + nblk * CYF_QNR * (ptrdiff_t)sizeof(float);
}

typedef struct cyf_qgemm {
    /* c[r * CYF_QNR + j] = row r of the quantized x times output j of the
     * strip, r < rows <= CYF_QMR (before the format's out_scale): codes q
     * [rows][nblk * CYF_QB], d and bsum [rows][nblk] (cyf_q8_rows_gemm),
     * bpp blocks per partial sum */
    void (*tile)(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                 const unsigned char *strip, ptrdiff_t nblk, int bpp);
    /* outputs n0 .. n0+pw-1 of W [N, K] (every format with a qgemm stores a
     * row per output) into ceil(pw / CYF_QNR) strips of cyf_qstrip_bytes(K)
     * each, one after another */
    void (*pack_t)(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0, ptrdiff_t pw);
    int mr;  /* the most rows the tile takes in one call: CYF_QMR, or CYF_AMR with AMX */
} cyf_qgemm;

/* A tile's entry points on its inline body: int8 (grouped 0), and int4 and
 * GGUF's records (grouped 1: each block's sum times d * the weights' scale) */
#define CYF_QTILE_ENTRY(NAME, TARGET, BODY, GROUPED)                                                         \
__attribute__((target(TARGET)))                                                                              \
static void NAME(float *c, const signed char *q, const float *d, const int *bsum, int rows,                  \
                 const unsigned char *strip, ptrdiff_t nblk, int bpp)                                        \
{                                                                                                            \
    BODY(c, q, d, bsum, rows, strip, nblk, bpp, GROUPED);                                                    \
}

/* x [K] -> codes q [nblk * CYF_QB] (zero past K), d [nblk] (cyf_q8_row's)
 * and bsum[b] = 128 * the sum of block b's codes: the correction for the
 * weights' +128. */
static inline void cyf_q8_row_gemm(const float *x, ptrdiff_t K, signed char *q, float *d, int *bsum)
{
    cyf_q8_row(x, K, q, d, NULL);
    for (ptrdiff_t b = 0; b * CYF_QB < K; b++) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m512i c = _mm512_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * CYF_QB))),
                                           _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * CYF_QB + 16))));
        bsum[b] = 128 * _mm512_reduce_add_epi32(c);
#else
        int s = 0;
        for (int i = 0; i < CYF_QB; i++)
            s += q[b * CYF_QB + i];
        bsum[b] = 128 * s;
#endif
    }
}

static inline unsigned char *cyf_qstrip_code(unsigned char *strip, ptrdiff_t k, ptrdiff_t j)
{
    return strip + (k >> 2) * (4 * CYF_QNR) + j * 4 + (k & 3);
}

/* The strips' codes set to w = 0 and scales to 0 before the columns go in. */
static inline void cyf_qpanel_clear(unsigned char *panel, ptrdiff_t K, ptrdiff_t nstr)
{
    const ptrdiff_t sb = cyf_qstrip_bytes(K), cb = (K + CYF_QB - 1) / CYF_QB * CYF_QB * CYF_QNR;
    for (ptrdiff_t s = 0; s < nstr; s++) {
        memset(panel + s * sb, 128, (size_t)cb);
        memset(panel + s * sb + cb, 0, (size_t)(sb - cb));
    }
}


/* W [N, K]: output n's 4 consecutive codes are 4 consecutive bytes of its row. */
static void cyf_i8_qpack_t(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0, ptrdiff_t pw)
{
    (void)N;
    const ptrdiff_t sb = cyf_qstrip_bytes(K), nstr = (pw + CYF_QNR - 1) / CYF_QNR;
    cyf_qpanel_clear(panel, K, nstr);
    for (ptrdiff_t j = 0; j < pw; j++) {
        const signed char *row = (const signed char *)W->data + (n0 + j) * W->ld;
        unsigned char *strip = panel + (j / CYF_QNR) * sb;
        for (ptrdiff_t k = 0; k < K; k++)
            *cyf_qstrip_code(strip, k, j % CYF_QNR) = (unsigned char)(row[k] + 128);
    }
}

/* int4 W [N, K] (a row per output; byte p: input 2p low, 2p + 1 high):
 * a byte's two nibbles are two consecutive codes of one int32 lane of the
 * strip, so each byte becomes two adjacent bytes; the row's group scales
 * go beside as for [K, N].  Inputs past K keep w = 0. */
static void cyf_i4_qpack_t(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0, ptrdiff_t pw)
{
    (void)N;
    const ptrdiff_t sb = cyf_qstrip_bytes(K), nstr = (pw + CYF_QNR - 1) / CYF_QNR;
    const ptrdiff_t nblk = (K + CYF_QB - 1) / CYF_QB, cb = nblk * CYF_QB * CYF_QNR, full = K / 2;
    cyf_qpanel_clear(panel, K, nstr);
    for (ptrdiff_t j = 0; j < pw; j++) {
        const unsigned char *row = (const unsigned char *)W->data + (n0 + j) * W->ld;
        const float *s = W->scale + (n0 + j) * nblk;
        unsigned char *strip = panel + (j / CYF_QNR) * sb;
        const ptrdiff_t jj = j % CYF_QNR;
        for (ptrdiff_t p = 0; p < full; p++) {
            unsigned char *dst = cyf_qstrip_code(strip, 2 * p, jj);
            dst[0] = (unsigned char)((row[p] & 15) + 120);
            dst[1] = (unsigned char)((row[p] >> 4) + 120);
        }
        if (K & 1)  /* an odd K: the last byte's low nibble only */
            *cyf_qstrip_code(strip, K - 1, jj) = (unsigned char)((row[full] & 15) + 120);
        for (ptrdiff_t b = 0; b < nblk; b++)
            ((float *)(strip + cb))[b * CYF_QNR + jj] = s[b];
    }
}

/* q8_0 / q4_0 (W [N, K], GGUF's records a row per output): each record's
 * codes into the strip (q + 128; q4_0's nibble - 8 + 128) and its fp16
 * scale, as float32, where int4 keeps its group scales, so int4's grouped
 * tile multiplies them: (d_b * d_w) first, as in int4. */
static inline void cyf_qrec_pack_t_(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t n0, ptrdiff_t pw,
                                    int nibbles)
{
    const ptrdiff_t sb = cyf_qstrip_bytes(K), nstr = (pw + CYF_QNR - 1) / CYF_QNR;
    const ptrdiff_t nblk = K / CYF_QB, cb = (K + CYF_QB - 1) / CYF_QB * CYF_QB * CYF_QNR;
    const ptrdiff_t rec = nibbles ? CYF_Q40_REC : CYF_Q80_REC;
    cyf_qpanel_clear(panel, K, nstr);
    for (ptrdiff_t j = 0; j < pw; j++) {
        const unsigned char *row = (const unsigned char *)W->data + (n0 + j) * W->ld;
        unsigned char *strip = panel + (j / CYF_QNR) * sb;
        const ptrdiff_t jj = j % CYF_QNR;
        for (ptrdiff_t b = 0; b < nblk; b++) {
            const unsigned char *r = row + b * rec, *w = r + 2;
            ((float *)(strip + cb))[b * CYF_QNR + jj] = cyf_half(r);
            for (int i = 0; i < CYF_QB; i++) {
                const int code = nibbles ? (i < CYF_QB / 2 ? (w[i] & 15) : (w[i - CYF_QB / 2] >> 4)) - 8
                                         : (int)(signed char)w[i];
                *cyf_qstrip_code(strip, b * CYF_QB + i, jj) = (unsigned char)(code + 128);
            }
        }
    }
}

static void cyf_q80_qpack_t(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0,
                            ptrdiff_t pw)
{
    (void)N;
    cyf_qrec_pack_t_(panel, W, K, n0, pw, 0);
}

static void cyf_q40_qpack_t(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0,
                            ptrdiff_t pw)
{
    (void)N;
    cyf_qrec_pack_t_(panel, W, K, n0, pw, 1);
}

/* The tile in integer loops: every CPU, and the oracle of the vector one.
 * Each group of 4 packed inputs serves every row; the loop over a strip's
 * 32 outputs is the one the compiler vectorizes. */
static inline void cyf_qtile_generic_(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                      const unsigned char *strip, ptrdiff_t nblk, int bpp, int grouped)
{
    const ptrdiff_t Kp = nblk * CYF_QB;
    const float *sc = (const float *)(strip + Kp * CYF_QNR);
    float acc[CYF_QMR][CYF_QNR], p[CYF_QMR][CYF_QNR];
    int s[CYF_QMR][CYF_QNR];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < CYF_QNR; j++)
            acc[r][j] = -0.0f;  /* -0 + p is p, bit for bit: the first partial as it is */
    for (ptrdiff_t b0 = 0; b0 < nblk; b0 += bpp) {
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < CYF_QNR; j++)
                p[r][j] = 0.0f;
        for (ptrdiff_t b = b0; b < b0 + bpp && b < nblk; b++) {
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < CYF_QNR; j++)
                    s[r][j] = -bsum[r * nblk + b];
            for (int g = 0; g < CYF_QB / 4; g++) {
                const unsigned char *w = strip + (b * (CYF_QB / 4) + g) * (4 * CYF_QNR);
                for (int r = 0; r < rows; r++) {
                    const signed char *qq = q + r * Kp + b * CYF_QB + 4 * g;
                    const int q0 = qq[0], q1 = qq[1], q2 = qq[2], q3 = qq[3];
                    for (int j = 0; j < CYF_QNR; j++)
                        s[r][j] += w[4 * j] * q0 + w[4 * j + 1] * q1 + w[4 * j + 2] * q2 + w[4 * j + 3] * q3;
                }
            }
            for (int r = 0; r < rows; r++) {
                const float dr = d[r * nblk + b];
                for (int j = 0; j < CYF_QNR; j++) {
                    const float t = grouped ? dr * sc[b * CYF_QNR + j] : dr;
                    p[r][j] = __builtin_fmaf(t, (float)s[r][j], p[r][j]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < CYF_QNR; j++)
                acc[r][j] = acc[r][j] + p[r][j];
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < CYF_QNR; j++)
            c[r * CYF_QNR + j] = acc[r][j];
}

static void cyf_i8_qtile_generic(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                 const unsigned char *strip, ptrdiff_t nblk, int bpp)
{
    cyf_qtile_generic_(c, q, d, bsum, rows, strip, nblk, bpp, 0);
}

static void cyf_i4_qtile_generic(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                 const unsigned char *strip, ptrdiff_t nblk, int bpp)
{
    cyf_qtile_generic_(c, q, d, bsum, rows, strip, nblk, bpp, 1);
}

/* The register tiles' rows: codes, scales and code sums of each of
 * CYF_QMR rows, those past `rows` repeating the last one (their sums are
 * computed and not stored). */
static inline void cyf_qtile_rows_(const signed char *q, const float *d, const int *bsum, int rows, ptrdiff_t nblk,
                                   const signed char **qr, const float **dr, const int **br)
{
    for (int r = 0; r < CYF_QMR; r++) {
        const int rr = r < rows ? r : rows - 1;
        qr[r] = q + rr * nblk * CYF_QB;
        dr[r] = d + rr * nblk;
        br[r] = bsum + rr * nblk;
    }
}

static const cyf_qgemm cyf_i8_qgemm_generic = {cyf_i8_qtile_generic, cyf_i8_qpack_t, CYF_QMR};
static const cyf_qgemm cyf_i4_qgemm_generic = {cyf_i4_qtile_generic, cyf_i4_qpack_t, CYF_QMR};

#if CYF_HAVE_VNNI_KERNELS
/* The tile with vpdpbusd: per 4 inputs, 2 vectors of packed codes against a
 * broadcast 4 codes of each row; rows past `rows` repeat the last one (their
 * sums are computed and not stored). */
__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_qtile_vnni_(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                   const unsigned char *strip, ptrdiff_t nblk, int bpp, int grouped)
{
    const ptrdiff_t Kp = nblk * CYF_QB;
    const float *sc = (const float *)(strip + Kp * CYF_QNR);
    const signed char *qr[CYF_QMR];
    const float *dr[CYF_QMR];
    const int *br[CYF_QMR];
    cyf_qtile_rows_(q, d, bsum, rows, nblk, qr, dr, br);
    float acc[CYF_QMR * CYF_QNR] __attribute__((aligned(64)));
    const __m512 mz = _mm512_set1_ps(-0.0f);  /* -0 + p is p: the first partial as it is */
    for (int r = 0; r < CYF_QMR; r++) {
        _mm512_store_ps(acc + r * CYF_QNR, mz);
        _mm512_store_ps(acc + r * CYF_QNR + 16, mz);
    }
    for (ptrdiff_t b0 = 0; b0 < nblk; b0 += bpp) {
        const ptrdiff_t b1 = b0 + bpp < nblk ? b0 + bpp : nblk;
        __m512 p[CYF_QMR][2];
#pragma GCC unroll 6
        for (int r = 0; r < CYF_QMR; r++)
            p[r][0] = p[r][1] = _mm512_setzero_ps();
        for (ptrdiff_t b = b0; b < b1; b++) {
            __m512i s[CYF_QMR][2];
#pragma GCC unroll 6
            for (int r = 0; r < CYF_QMR; r++)
                s[r][0] = s[r][1] = _mm512_set1_epi32(-br[r][b]);
            const unsigned char *w = strip + b * CYF_QB * CYF_QNR;
#pragma GCC unroll 8
            for (int g = 0; g < CYF_QB / 4; g++) {
                const __m512i w0 = _mm512_loadu_si512(w + g * 4 * CYF_QNR);
                const __m512i w1 = _mm512_loadu_si512(w + g * 4 * CYF_QNR + 64);
#pragma GCC unroll 6
                for (int r = 0; r < CYF_QMR; r++) {
                    int v;
                    memcpy(&v, qr[r] + b * CYF_QB + 4 * g, 4);
                    const __m512i qq = _mm512_set1_epi32(v);
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, qq);
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, qq);
                }
            }
            __m512 s0 = _mm512_setzero_ps(), s1 = s0;
            if (grouped) {
                s0 = _mm512_loadu_ps(sc + b * CYF_QNR);
                s1 = _mm512_loadu_ps(sc + b * CYF_QNR + 16);
            }
#pragma GCC unroll 6
            for (int r = 0; r < CYF_QMR; r++) {
                const __m512 db = _mm512_set1_ps(dr[r][b]);
                const __m512 t0 = grouped ? _mm512_mul_ps(db, s0) : db, t1 = grouped ? _mm512_mul_ps(db, s1) : db;
                p[r][0] = _mm512_fmadd_ps(t0, _mm512_cvtepi32_ps(s[r][0]), p[r][0]);
                p[r][1] = _mm512_fmadd_ps(t1, _mm512_cvtepi32_ps(s[r][1]), p[r][1]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < CYF_QMR; r++) {
            _mm512_store_ps(acc + r * CYF_QNR, _mm512_add_ps(_mm512_load_ps(acc + r * CYF_QNR), p[r][0]));
            _mm512_store_ps(acc + r * CYF_QNR + 16, _mm512_add_ps(_mm512_load_ps(acc + r * CYF_QNR + 16), p[r][1]));
        }
    }
    memcpy(c, acc, (size_t)rows * CYF_QNR * sizeof(float));
}

CYF_QTILE_ENTRY(cyf_i8_qtile_vnni, "avx512vnni", cyf_qtile_vnni_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_vnni, "avx512vnni", cyf_qtile_vnni_, 1)

/* The packers with AVX-512: 64 inputs of each of 16 rows widen in
 * registers to 64 codes + 128 (one vector: 16 dwords of 4 inputs of one
 * output each); transposed (cyf_transpose16_epi32), each vector is one
 * quad of inputs for the 16 outputs, half a row of the strip.  Inputs past
 * K and outputs past pw are 128 (w = 0).  The same bytes as the generic
 * packers, which took 2.5 times as long as the GEMM's tiles (int4, batches
 * of 32-token prompts).  kind: what a row holds. */
enum { CYF_PACK_I8, CYF_PACK_I4, CYF_PACK_Q80, CYF_PACK_Q40 };

/* 16 codes + 128 of a q4_0 record's 16 nibble bytes: low nibbles, then high */
__attribute__((target("avx512vnni"), always_inline))
static inline __m256i cyf_q40_codes_(const unsigned char *w)
{
    const __m128i v = _mm_loadu_si128((const __m128i *)w), nib = _mm_set1_epi8(15), bias = _mm_set1_epi8(120);
    return _mm256_set_m128i(_mm_add_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), nib), bias),
                            _mm_add_epi8(_mm_and_si128(v, nib), bias));
}

__attribute__((target("avx512vnni"), always_inline))
static inline __m512i cyf_qpack_codes_(const unsigned char *row, ptrdiff_t k0, ptrdiff_t K, int kind)
{
    const ptrdiff_t kn = K - k0 >= 64 ? 64 : K - k0;
    const __mmask64 m = kn == 64 ? ~(__mmask64)0 : ((__mmask64)1 << kn) - 1;
    const __m512i wzero = _mm512_set1_epi8((char)128);
    __m512i v;
    if (kind == CYF_PACK_I8) {
        v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, row + k0), wzero);
    } else if (kind == CYF_PACK_I4) {  /* byte p: input 2p low, 2p + 1 high */
        const ptrdiff_t bn = (kn + 1) / 2;
        const __mmask32 mb = bn == 32 ? ~(__mmask32)0 : ((__mmask32)1 << bn) - 1;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mb, row + k0 / 2));  /* word p: byte p */
        const __m512i nib = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)),
                                            _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F00)));
        v = _mm512_add_epi8(nib, _mm512_set1_epi8(120));
    } else {  /* GGUF's records (K a multiple of 32): records k0 / 32 and, if in K, the next */
        const ptrdiff_t rec = kind == CYF_PACK_Q80 ? CYF_Q80_REC : CYF_Q40_REC;
        const unsigned char *r0 = row + k0 / CYF_QB * rec + 2, *r1 = r0 + rec;
        __m256i c0, c1 = _mm256_setzero_si256();
        if (kind == CYF_PACK_Q80) {
            c0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)r0), _mm256_set1_epi8((char)128));
            if (kn == 64)
                c1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)r1), _mm256_set1_epi8((char)128));
        } else {
            c0 = cyf_q40_codes_(r0);
            if (kn == 64)
                c1 = cyf_q40_codes_(r1);
        }
        v = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
    }
    return _mm512_mask_mov_epi8(wzero, m, v);
}

/* Output n's scales of blocks b0 .. b0 + nb - 1 (nb <= 16, b0 a multiple
 * of 16) as float32 bits, 0 past them: int4's group scales, or the
 * records' fp16 scales as decode reads a chunk's (cyf_rec_dw), put back in
 * block order. */
__attribute__((target("avx512vnni"), always_inline))
static inline __m512i cyf_qpack_scales_(const cyf_wt *W, ptrdiff_t n, ptrdiff_t b0, ptrdiff_t nb, ptrdiff_t nblk, int kind)
{
    if (kind == CYF_PACK_I4)
        return _mm512_castps_si512(_mm512_maskz_loadu_ps((__mmask16)((1u << nb) - 1u), W->scale + n * nblk + b0));
    const int nib = kind == CYF_PACK_Q40;
    const __m512 d = cyf_rec_dw((const unsigned char *)W->data + n * W->ld + b0 * (nib ? CYF_Q40_REC : CYF_Q80_REC), nb,
                                nib);
    return _mm512_castps_si512(_mm512_permutexvar_ps(_mm512_loadu_si512(cyf_rec_sigma), d));
}

/* The byte of a row where input k lies */
static inline ptrdiff_t cyf_qpack_at_(ptrdiff_t k, int kind)
{
    return kind == CYF_PACK_I8 ? k : kind == CYF_PACK_I4 ? k / 2 : k / CYF_QB * (kind == CYF_PACK_Q80 ? CYF_Q80_REC : CYF_Q40_REC);
}

__attribute__((target("avx512vnni"), always_inline))
static inline void cyf_qpack_t_vnni_(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t n0, ptrdiff_t pw,
                                     int kind)
{
    const ptrdiff_t sb = cyf_qstrip_bytes(K), nstr = (pw + CYF_QNR - 1) / CYF_QNR;
    const ptrdiff_t nblk = (K + CYF_QB - 1) / CYF_QB, Kp = nblk * CYF_QB;
    for (ptrdiff_t s = 0; s < nstr; s++) {
        unsigned char *strip = panel + s * sb;
        float *scales = (float *)(strip + Kp * CYF_QNR);  /* int8: unused */
        const ptrdiff_t js = s * CYF_QNR, nj = pw - js < CYF_QNR ? pw - js : CYF_QNR;
        cyf_touch_rows((const unsigned char *)W->data + (n0 + js) * W->ld, W->ld, nj, cyf_qpack_at_(K - 1, kind) + 1);
        for (int h = 0; h < 2; h++) {
            const ptrdiff_t j0 = s * CYF_QNR + h * 16;
            for (ptrdiff_t k0 = 0; k0 < Kp; k0 += 64) {
                __m512i v[16];
                for (int r = 0; r < 16; r++)
                    v[r] = j0 + r < pw && k0 < K
                               ? cyf_qpack_codes_((const unsigned char *)W->data + (n0 + j0 + r) * W->ld, k0, K, kind)
                               : _mm512_set1_epi8((char)128);
                cyf_transpose16_epi32(v);  /* v[i]: input quad k0 / 4 + i of the 16 outputs */
                for (int i = 0; i < 16 && k0 + 4 * i < Kp; i++)
                    _mm512_storeu_si512(strip + (k0 / 4 + i) * (4 * CYF_QNR) + h * 64, v[i]);
            }
        }
        if (kind == CYF_PACK_I8)
            memset(scales, 0, (size_t)(sb - Kp * CYF_QNR));
        else  /* 16 blocks of 16 outputs at a time, transposed, not a scalar fp16 conversion per scale */
            for (int h = 0; h < 2; h++)
                for (ptrdiff_t b0 = 0; b0 < nblk; b0 += 16) {
                    const ptrdiff_t nbk = nblk - b0 < 16 ? nblk - b0 : 16, j0 = s * CYF_QNR + h * 16;
                    __m512i v[16];
                    for (int r = 0; r < 16; r++)
                        v[r] = j0 + r < pw ? cyf_qpack_scales_(W, n0 + j0 + r, b0, nbk, nblk, kind) : _mm512_setzero_si512();
                    cyf_transpose16_epi32(v);  /* v[i]: block b0 + i's scales of the 16 outputs */
                    for (ptrdiff_t i = 0; i < nbk; i++)
                        _mm512_storeu_si512(scales + (b0 + i) * CYF_QNR + h * 16, v[i]);
                }
    }
}

#define CYF_QPACK_VNNI(NAME, KIND)                                                                          \
__attribute__((target("avx512vnni")))                                                                       \
static void NAME(unsigned char *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0, ptrdiff_t pw) \
{                                                                                                           \
    (void)N;                                                                                                \
    cyf_qpack_t_vnni_(panel, W, K, n0, pw, KIND);                                                           \
}
CYF_QPACK_VNNI(cyf_i8_qpack_t_vnni, CYF_PACK_I8)
CYF_QPACK_VNNI(cyf_i4_qpack_t_vnni, CYF_PACK_I4)
CYF_QPACK_VNNI(cyf_q80_qpack_t_vnni, CYF_PACK_Q80)
CYF_QPACK_VNNI(cyf_q40_qpack_t_vnni, CYF_PACK_Q40)
#undef CYF_QPACK_VNNI

static const cyf_qgemm cyf_i8_qgemm_vnni = {cyf_i8_qtile_vnni, cyf_i8_qpack_t_vnni, CYF_QMR};
static const cyf_qgemm cyf_i4_qgemm_vnni = {cyf_i4_qtile_vnni, cyf_i4_qpack_t_vnni, CYF_QMR};
/* GGUF's records: int4's grouped tile (their codes fit it); always [N, K] */
static const cyf_qgemm cyf_q80_qgemm_vnni = {cyf_i4_qtile_vnni, cyf_q80_qpack_t_vnni, CYF_QMR};
static const cyf_qgemm cyf_q40_qgemm_vnni = {cyf_i4_qtile_vnni, cyf_q40_qpack_t_vnni, CYF_QMR};

/* ---- The tile with AMX (qtile_amx.h): one body, two instruction sets ----
 * The model (amx.h), with the AVX-512 the rest of this section takes: the
 * tile's code tested on CPUs without AMX; never chosen for speed. */
#include "amx.h"
#define CYF_AMX_MODEL 1
#include "amx_ops.h"
#define CYF_AMX_TILE_ cyf_qtile_amx_model_
#include "qtile_amx.h"
#undef CYF_AMX_TILE_
#undef CYF_AMX_MODEL

/* The instructions themselves (amx_ops.h) */
#define CYF_AMX_MODEL 0
#include "amx_ops.h"
#define CYF_AMX_TILE_ cyf_qtile_amx_
#include "qtile_amx.h"
#undef CYF_AMX_TILE_
#undef CYF_AMX_MODEL

CYF_QTILE_ENTRY(cyf_i8_qtile_amx, "avx512vnni", cyf_qtile_amx_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_amx, "avx512vnni", cyf_qtile_amx_, 1)
CYF_QTILE_ENTRY(cyf_i8_qtile_amx_model, "avx512vnni", cyf_qtile_amx_model_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_amx_model, "avx512vnni", cyf_qtile_amx_model_, 1)

/* [variant][format]: AMX, its model; int8, int4, q8_0, q4_0 (the VNNI packers) */
static const cyf_qgemm cyf_qgemm_amx[2][4] = {
    {{cyf_i8_qtile_amx, cyf_i8_qpack_t_vnni, CYF_AMR}, {cyf_i4_qtile_amx, cyf_i4_qpack_t_vnni, CYF_AMR},
     {cyf_i4_qtile_amx, cyf_q80_qpack_t_vnni, CYF_AMR}, {cyf_i4_qtile_amx, cyf_q40_qpack_t_vnni, CYF_AMR}},
    {{cyf_i8_qtile_amx_model, cyf_i8_qpack_t_vnni, CYF_AMR}, {cyf_i4_qtile_amx_model, cyf_i4_qpack_t_vnni, CYF_AMR},
     {cyf_i4_qtile_amx_model, cyf_q80_qpack_t_vnni, CYF_AMR}, {cyf_i4_qtile_amx_model, cyf_q40_qpack_t_vnni, CYF_AMR}},
};
#endif

#if CYF_HAVE_AVX2_KERNELS
/* The tile with AVX2: vpmaddubsw cannot take the codes w + 128 (a pair sum
 * of 2 * 255 * 127 saturates 16 bits), so, as the decode kernels, |w|
 * (w = code ^ 0x80) meets the codes q with w's sign (vpsignb): pair sums
 * at most 2 * 128 * 127, vpmaddwd by ones adds them into int32 lanes.  The
 * block sums are then sum w * q outright, bsum unused: the same int32 as
 * the other tiles, the same float steps, so the same bits.  16 ymm
 * registers: 6 rows by 8 outputs at a time (6 int32 accumulators), the
 * strip's 32 outputs in 4 passes; rows past `rows` repeat the last one. */
#define CYF_Q2_ATTR __attribute__((target("avx2,fma"), always_inline))
#define CYF_Q2_TILE_ cyf_qtile_avx2_
#include "qtile_avx2.h"
#undef CYF_Q2_ATTR
#undef CYF_Q2_TILE_

/* AVX-VNNI (Alder Lake and later AVX2 parts); and its instruction in
 * AVX512-VNNI's encoding, which this project's AVX-512 machines run, so
 * the tests cover the tile's code where AVX-VNNI is missing */
#if CYF_HAVE_AVXVNNI_KERNELS
#define CYF_Q2_ATTR __attribute__((target("avx2,fma,avxvnni"), always_inline))
#define CYF_Q2_TILE_ cyf_qtile_avxvnni_
#define CYF_Q2_DPBUSD _mm256_dpbusd_avx_epi32
#include "qtile_avx2.h"
#undef CYF_Q2_ATTR
#undef CYF_Q2_TILE_
#undef CYF_Q2_DPBUSD
#endif
#define CYF_Q2_ATTR __attribute__((target("avx2,fma,avx512vnni,avx512vl"), always_inline))
#define CYF_Q2_TILE_ cyf_qtile_vnni256_
#define CYF_Q2_DPBUSD _mm256_dpbusd_epi32
#include "qtile_avx2.h"
#undef CYF_Q2_ATTR
#undef CYF_Q2_TILE_
#undef CYF_Q2_DPBUSD

CYF_QTILE_ENTRY(cyf_i8_qtile_avx2, "avx2,fma", cyf_qtile_avx2_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_avx2, "avx2,fma", cyf_qtile_avx2_, 1)
CYF_QTILE_ENTRY(cyf_q80_qtile_avx2, "avx2,fma", cyf_qtile_avx2_, 2)  /* grouped, 32-bit sums */
CYF_QTILE_ENTRY(cyf_i8_qtile_vnni256, "avx2,fma,avx512vnni,avx512vl", cyf_qtile_vnni256_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_vnni256, "avx2,fma,avx512vnni,avx512vl", cyf_qtile_vnni256_, 1)
#if CYF_HAVE_AVXVNNI_KERNELS
CYF_QTILE_ENTRY(cyf_i8_qtile_avxvnni, "avx2,fma,avxvnni", cyf_qtile_avxvnni_, 0)
CYF_QTILE_ENTRY(cyf_i4_qtile_avxvnni, "avx2,fma,avxvnni", cyf_qtile_avxvnni_, 1)
#endif

static const cyf_qgemm cyf_i8_qgemm_avx2 = {cyf_i8_qtile_avx2, cyf_i8_qpack_t, CYF_QMR};
static const cyf_qgemm cyf_i4_qgemm_avx2 = {cyf_i4_qtile_avx2, cyf_i4_qpack_t, CYF_QMR};
/* q4_0's codes fit int4's 16-bit block sums; q8_0's do not (|w| up to 127) */
static const cyf_qgemm cyf_q40_qgemm_avx2 = {cyf_i4_qtile_avx2, cyf_q40_qpack_t, CYF_QMR};
static const cyf_qgemm cyf_q80_qgemm_avx2 = {cyf_q80_qtile_avx2, cyf_q80_qpack_t, CYF_QMR};
/* [variant][format]: AVX-VNNI, its EVEX form (tests); int8, int4, q8_0, q4_0
 * (vpdpbusd's int32 lanes take q8_0's codes too).  The generic packers: an
 * AVX-VNNI CPU may have no AVX-512. */
static const cyf_qgemm cyf_qgemm_vnni256[2][4] = {
#if CYF_HAVE_AVXVNNI_KERNELS
    {{cyf_i8_qtile_avxvnni, cyf_i8_qpack_t, CYF_QMR}, {cyf_i4_qtile_avxvnni, cyf_i4_qpack_t, CYF_QMR},
     {cyf_i4_qtile_avxvnni, cyf_q80_qpack_t, CYF_QMR}, {cyf_i4_qtile_avxvnni, cyf_q40_qpack_t, CYF_QMR}},
#else
    {{0}},  /* a compiler without avxvnni: never chosen (cyf_formats_select) */
#endif
    {{cyf_i8_qtile_vnni256, cyf_i8_qpack_t, CYF_QMR}, {cyf_i4_qtile_vnni256, cyf_i4_qpack_t, CYF_QMR},
     {cyf_i4_qtile_vnni256, cyf_q80_qpack_t, CYF_QMR}, {cyf_i4_qtile_vnni256, cyf_q40_qpack_t, CYF_QMR}},
};
#endif

#endif
