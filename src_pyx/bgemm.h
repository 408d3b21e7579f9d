/* The bfloat16 GEMM (prefill) with AVX512-BF16: a format row's optional
 * `bgemm` (formats.h).  Included by formats.h after the bf16dp kernels.
 *
 * Each row of x is rounded once per product to bf16 pairs, as decode does
 * (cyf_bf16_pairs_of: the pair (x[2p], x[2p+1]) in one 32-bit lane, zero
 * past K); the weights are packed a panel at a time into strips of pairs
 * (below), and a register tile of CYF_BMR rows by CYF_BNR outputs adds them
 * with vdpbf16ps, two products per float32 lane per instruction: for each
 * run of bpp pairs (linalg's GEMV_ROWS inputs) a vdpbf16ps chain from zero
 * over the pairs in order, the runs' sums added in order.  So every row's
 * outputs are bitwise those of backends/numpy_ref's bf16dp_gemm at any
 * thread count; decode (bfloat16 is stored a row per output) sums the same
 * products in 16 lanes per row instead (bf16dp_dot_t), equal to rounding. */
#ifndef CYFORMER_BGEMM_H
#define CYFORMER_BGEMM_H

#ifndef CYF_BMR
#define CYF_BMR 8   /* rows of x per register tile: 16 partial sums, 2 weight vectors (see below) */
#endif
#ifndef CYF_BNR
#define CYF_BNR 32  /* outputs per packed strip: two vectors of 16 float32 lanes */
#endif

/* A packed strip of CYF_BNR outputs for K inputs: [(K + 1) / 2][CYF_BNR]
 * 32-bit lanes, lane (p, j) the bf16 pair (W(2p, j), W(2p + 1, j)), even
 * input in the low half; a missing input (K odd) or output (past N) is 0. */
static inline ptrdiff_t cyf_bstrip_words(ptrdiff_t K)
{
    return (K + 1) / 2 * CYF_BNR;
}

typedef struct cyf_bgemm {
    /* outputs n0 .. n0+pw-1 of W [N, K] (bfloat16 stores a row per output)
     * into ceil(pw / CYF_BNR) strips of cyf_bstrip_words(K) each, one after
     * another: a row's inputs 2p, 2p+1 already are a pair, so packing is a
     * 32-bit transpose */
    void (*pack_t)(unsigned int *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0, ptrdiff_t pw);
    /* c[r * CYF_BNR + j] = row r of x times output j of the strip, r < rows
     * <= CYF_BMR: xp the rows' np pairs, ldx apart; bpp pairs per run */
    void (*tile)(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows, const unsigned int *strip, ptrdiff_t np,
                 int bpp);
    int mr;  /* the most rows the tile takes in one call: CYF_BMR, or CYF_AMR with AMX */
} cyf_bgemm;
#define CYF_BMR_MAX (CYF_BMR > CYF_AMR ? CYF_BMR : CYF_AMR)  /* the most rows any tile takes (the driver's tile buffer) */

#if CYF_HAVE_BF16DP_KERNELS
/* Packing W [N, K]: 16 outputs by 16 pairs at a time, each output's 16
 * pairs one 64-byte load of its row, transposed in registers
 * (cyf_transpose16_epi32) into 16 rows of the strip. */
__attribute__((target("avx512bf16")))
static void cyf_bf16_bpack_t(unsigned int *panel, const cyf_wt *W, ptrdiff_t K, ptrdiff_t N, ptrdiff_t n0,
                             ptrdiff_t pw)
{
    (void)N;
    const ptrdiff_t sw = cyf_bstrip_words(K), np = (K + 1) / 2, ld = W->ld;
    const ptrdiff_t ncols = (pw + CYF_BNR - 1) / CYF_BNR * CYF_BNR;
    const unsigned short *base = (const unsigned short *)W->data + n0 * ld;
    const __m512i zero = _mm512_setzero_si512();
    for (ptrdiff_t j0 = 0; j0 < ncols; j0 += 16) {
        unsigned int *dst = panel + (j0 / CYF_BNR) * sw + j0 % CYF_BNR;
        cyf_touch_rows(base + j0 * ld, ld * 2, pw - j0 < 16 ? pw - j0 : 16, 2 * K);
        for (ptrdiff_t p0 = 0; p0 < np; p0 += 16) {
            /* the bf16 inputs 2 p0 .. 2 p0 + 31 of each row, those past K masked off */
            const ptrdiff_t nk = K - 2 * p0 < 32 ? K - 2 * p0 : 32;
            const __mmask32 m = nk >= 32 ? ~0u : (__mmask32)((1u << nk) - 1u);
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = j0 + i < pw ? _mm512_maskz_loadu_epi16(m, base + (j0 + i) * ld + 2 * p0) : zero;
            cyf_transpose16_epi32(r);
            const int npp = np - p0 < 16 ? (int)(np - p0) : 16;
            for (int i = 0; i < npp; i++)
                _mm512_storeu_si512(dst + (p0 + i) * CYF_BNR, r[i]);
        }
    }
}

/* The tile.  Rows past `rows` repeat the last one (their sums are computed
 * and not stored).  The running sums start at -0: -0 + s is s, bit for bit,
 * the first run's sum as it is (bf16dp_matvec's first partial). */
__attribute__((target("avx512bf16"), always_inline))
static inline void cyf_btile_(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows, const unsigned int *strip,
                              ptrdiff_t np, int bpp)
{
    enum { NV = CYF_BNR / 16 };
    const unsigned int *xr[CYF_BMR];
    for (int r = 0; r < CYF_BMR; r++)
        xr[r] = xp + (r < rows ? r : rows - 1) * ldx;
    __m512 acc[CYF_BMR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < CYF_BMR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[r][v] = _mm512_set1_ps(-0.0f);
    for (ptrdiff_t p0 = 0; p0 < np; p0 += bpp) {
        const ptrdiff_t p1 = p0 + bpp < np ? p0 + bpp : np;
        __m512 s[CYF_BMR][NV];
#pragma GCC unroll 16
        for (int r = 0; r < CYF_BMR; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                s[r][v] = _mm512_setzero_ps();
        for (ptrdiff_t p = p0; p < p1; p++) {
            const unsigned int *w = strip + p * CYF_BNR;
            __m512bh wv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                wv[v] = (__m512bh)_mm512_loadu_si512(w + 16 * v);
#pragma GCC unroll 16
            for (int r = 0; r < CYF_BMR; r++) {
                const __m512bh xx = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++)
                    s[r][v] = _mm512_dpbf16_ps(s[r][v], wv[v], xx);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < CYF_BMR; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[r][v] = _mm512_add_ps(acc[r][v], s[r][v]);
    }
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(c + r * CYF_BNR + 16 * v, acc[r][v]);
}

__attribute__((target("avx512bf16")))
static void cyf_bf16_btile(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows, const unsigned int *strip,
                           ptrdiff_t np, int bpp)
{
    cyf_btile_(c, xp, ldx, rows, strip, np, bpp);
}

static const cyf_bgemm cyf_bf16_bgemm = {cyf_bf16_bpack_t, cyf_bf16_btile, CYF_BMR};

/* ---- The tile with AMX (btile_amx.h): its model, then the instructions -- */
#include "amx.h"
#define CYF_AMX_MODEL 1
#include "amx_ops.h"
#define CYF_AMX_TILE_ cyf_btile_amx_model_
#include "btile_amx.h"
#undef CYF_AMX_TILE_
#undef CYF_AMX_MODEL
#define CYF_AMX_MODEL 0
#include "amx_ops.h"
#define CYF_AMX_TILE_ cyf_btile_amx_
#include "btile_amx.h"
#undef CYF_AMX_TILE_
#undef CYF_AMX_MODEL

__attribute__((target("avx512f")))
static void cyf_bf16_btile_amx(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows, const unsigned int *strip,
                               ptrdiff_t np, int bpp)
{
    cyf_btile_amx_(c, xp, ldx, rows, strip, np, bpp);
}

__attribute__((target("avx512f")))
static void cyf_bf16_btile_amx_model(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows,
                                     const unsigned int *strip, ptrdiff_t np, int bpp)
{
    cyf_btile_amx_model_(c, xp, ldx, rows, strip, np, bpp);
}

/* AMX, its model (tests); the AVX512-BF16 packer: the same strips */
static const cyf_bgemm cyf_bf16_bgemm_amx[2] = {{cyf_bf16_bpack_t, cyf_bf16_btile_amx, CYF_AMR},
                                                {cyf_bf16_bpack_t, cyf_bf16_btile_amx_model, CYF_AMR}};
#endif

#endif
