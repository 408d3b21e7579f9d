/* Register-blocked inner loops that Cython cannot express.
 *
 * Cython has no SIMD vector type, and gcc does not keep a 2-D accumulator
 * array in registers, so the two innermost loops that need explicit register
 * blocking are written here with GCC/Clang vector extensions.  cyf_v8f is 8
 * floats wide; the compiler lowers it to one AVX register (x86-64-v3/v4), two
 * SSE registers (x86-64-v2) or NEON pairs, so the same source serves every
 * kernel level built by setup.py.  cyf_vt (the GEMM tile, exp, GELU) is 16
 * floats wide where AVX-512 is on.  Everything around these loops (packing,
 * threading, epilogues) is Cython.
 *
 * Summation order is fixed by the code, never by the thread count or the
 * vector width: every output is a sequential k = 0..K-1 chain of
 * multiply-adds (contracted to FMA where the target has it).
 */
#ifndef CYFORMER_SIMD_H
#define CYFORMER_SIMD_H

#include <stddef.h>
#include <string.h>

typedef float cyf_v8f __attribute__((vector_size(32)));

static inline cyf_v8f cyf_load8(const float *p) { cyf_v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void cyf_store8(float *p, cyf_v8f v) { memcpy(p, &v, sizeof v); }

/* The GEMM register tile: CYF_MR rows of x by CYF_NR = 2 vectors of
 * columns.  With AVX-512 a vector is 16 floats and there are 32 registers:
 * 12 x 32 takes 24 accumulators + 2 loads + 1 broadcast, and reuses every
 * loaded weight 12 times.  Elsewhere a vector is 8 floats in 16 registers
 * (AVX2; SSE pairs at v2): 6 x 16 takes 12 + 2 + 1.  Row counts that keep
 * the tile below the register file but reuse weights more were measured
 * (x86-64-v4, one core, GPT-2-small shapes at T = 512: 6 rows 134 GFLOP/s,
 * 8 rows 143, 12 rows 147, 14 rows 150); 12 wastes fewer rows of a
 * T = 128 prompt than 14. */
#if defined(__AVX512F__)
#define CYF_VW 16
#define CYF_MR 12
#else
#define CYF_VW 8
#define CYF_MR 6
#endif
#define CYF_NR (2 * CYF_VW)

typedef float cyf_vt __attribute__((vector_size(CYF_VW * sizeof(float))));

static inline cyf_vt cyf_load_t(const float *p) { cyf_vt v; memcpy(&v, p, sizeof v); return v; }
static inline void cyf_store_t(float *p, cyf_vt v) { memcpy(p, &v, sizeof v); }

/* tile[r * ldt + j] = sum_k x[r][k] * wp[k * ldw + j] for a CYF_MR x CYF_NR
 * tile.  x: rows of length >= K with stride ldx; rows >= nrows repeat the
 * last valid row (all CYF_MR rows are stored; the caller discards the extra
 * ones).  wp: K rows of CYF_NR contiguous floats, ldw apart (CYF_NR for a
 * packed strip).  The loops over rows have constant bounds and are unrolled
 * completely, so the accumulators live in registers. */
static inline void cyf_gemm_tile(const float *x, ptrdiff_t ldx, int nrows,
                                 const float *wp, ptrdiff_t ldw, ptrdiff_t K,
                                 float *tile, ptrdiff_t ldt)
{
    const float *xr[CYF_MR];
    cyf_vt acc0[CYF_MR], acc1[CYF_MR];
#pragma GCC unroll 16
    for (int r = 0; r < CYF_MR; r++) {
        xr[r] = x + (r < nrows ? r : nrows - 1) * ldx;
        acc0[r] = (cyf_vt){0};
        acc1[r] = (cyf_vt){0};
    }
    for (ptrdiff_t k = 0; k < K; k++) {
        const cyf_vt w0 = cyf_load_t(wp + k * ldw);
        const cyf_vt w1 = cyf_load_t(wp + k * ldw + CYF_VW);
#pragma GCC unroll 16
        for (int r = 0; r < CYF_MR; r++) {
            const float s = xr[r][k];
            acc0[r] += s * w0;
            acc1[r] += s * w1;
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < CYF_MR; r++) {
        cyf_store_t(tile + r * ldt, acc0[r]);
        cyf_store_t(tile + r * ldt + CYF_VW, acc1[r]);
    }
}

/* out[j] = sum_k x[k] * W[k * ldw + j] for j < n <= 64: a 64-column strip of
 * a matrix-vector product, accumulated in 8 registers while the rows of W
 * stream past (decode's linear layers, attention's scores and values).  A
 * narrower strip runs the same k-ordered multiply-adds through memory. */
static inline void cyf_gemv_strip(const float *x, const float *W, ptrdiff_t ldw,
                                  ptrdiff_t K, ptrdiff_t n, float *out)
{
    if (n == 64) {
        cyf_v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (ptrdiff_t k = 0; k < K; k++) {
            const float *w = W + k * ldw;
            const float s = x[k];
            a0 += s * cyf_load8(w);      a1 += s * cyf_load8(w + 8);
            a2 += s * cyf_load8(w + 16); a3 += s * cyf_load8(w + 24);
            a4 += s * cyf_load8(w + 32); a5 += s * cyf_load8(w + 40);
            a6 += s * cyf_load8(w + 48); a7 += s * cyf_load8(w + 56);
        }
        cyf_store8(out, a0);      cyf_store8(out + 8, a1);
        cyf_store8(out + 16, a2); cyf_store8(out + 24, a3);
        cyf_store8(out + 32, a4); cyf_store8(out + 40, a5);
        cyf_store8(out + 48, a6); cyf_store8(out + 56, a7);
        return;
    }
    for (ptrdiff_t j = 0; j < n; j++)
        out[j] = 0.0f;
    for (ptrdiff_t k = 0; k < K; k++) {
        const float *w = W + k * ldw;
        const float s = x[k];
        for (ptrdiff_t j = 0; j < n; j++)
            out[j] += s * w[j];
    }
}

/* out[j] = sum_k x[k] * W[k * ldw + j] for j < n, reading W row by row:
 * each row segment is one contiguous run, the access pattern that streams
 * best from DRAM when W is far larger than the caches (decode).  out (n
 * floats, meant to sit in L1) is updated four rows of W at a time; every
 * element is still one k-ordered chain of multiply-adds, from zero. */
static inline void cyf_gemv_rows(const float *x, const float *W, ptrdiff_t ldw,
                                 ptrdiff_t K, ptrdiff_t n, float *out)
{
    /* Every step is acc += s * w with the accumulator starting at zero:
     * an add of two products (s0 * w0 + s1 * w1) would leave the compiler
     * free to fuse either one, and cyf_gemv_rows_b must make the same
     * choice as this function. */
    const cyf_v8f zero = {0};
    ptrdiff_t k = 0, j;
    for (; k < K; k += 4) {
        const ptrdiff_t m = K - k;  /* rows in this group: 4, or the last 1-3 */
        const float *w0 = W + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        const float s0 = x[k], s1 = m > 1 ? x[k + 1] : 0, s2 = m > 2 ? x[k + 2] : 0,
                    s3 = m > 3 ? x[k + 3] : 0;
        for (j = 0; j + 8 <= n; j += 8) {
            cyf_v8f a = k ? cyf_load8(out + j) : zero;
            a += s0 * cyf_load8(w0 + j);
            if (m > 1) a += s1 * cyf_load8(w1 + j);
            if (m > 2) a += s2 * cyf_load8(w2 + j);
            if (m > 3) a += s3 * cyf_load8(w3 + j);
            cyf_store8(out + j, a);
        }
        for (; j < n; j++) {
            float a = k ? out[j] : 0.0f;
            a += s0 * w0[j];
            if (m > 1) a += s1 * w1[j];
            if (m > 2) a += s2 * w2[j];
            if (m > 3) a += s3 * w3[j];
            out[j] = a;
        }
    }
    if (K <= 0)
        for (j = 0; j < n; j++)
            out[j] = 0.0f;
}

/* ---- a few rows of x against one weight matrix (batched decode) --------
 * Up to CYF_RB rows share each weight vector loaded: CYF_RB x 2 vectors of
 * accumulators (16 of AVX-512's 32 registers, 8 of AVX2's 16).  Every output
 * is the chain of cyf_gemv_rows / cyf_dot, so a row's result is the same
 * bits whichever batch it is in. */
#if defined(__AVX512F__)
#define CYF_RB 8
#else
#define CYF_RB 4
#endif

/* Rows of W per pass of cyf_gemv_rows_b's tiles: a whole block of the
 * matrix-vector path (GEMV_ROWS), so each output's chain stays in registers
 * from its first multiply-add to its last. */
#define CYF_KG 64
/* Columns per piece of cyf_gemv_rows_b: the tiles compute one piece from
 * the cache while they prefetch the next (64 rows x 128 floats, 32 KB;
 * pieces of 64, 256 and 512 were slower). */
#define CYF_PIECE 128
#define CYF_PIECE_LINES (CYF_PIECE / 16)  /* 64-byte lines per row of a piece */

/* out_r[j] (+)= sum_{k0 <= k < k0 + kn} x_r[k] W[k, j], j < 2 * CYF_VW, for NR
 * (a constant once inlined) rows: k-ordered multiply-adds continuing the
 * chain left in out (from zero when k0 = 0), as cyf_gemv_rows.  Meanwhile
 * lines l0 .. l1-1 of the next piece (pf: its first row, ldw apart) are
 * prefetched, npk per row of W, so the loads spread over the products. */
static inline __attribute__((always_inline)) void
cyf_rows_tile(const float *x, ptrdiff_t ldx, const int NR, const float *W, ptrdiff_t ldw,
              ptrdiff_t k0, ptrdiff_t kn, float *out, ptrdiff_t ldo,
              const float *pf, ptrdiff_t l0, ptrdiff_t l1, int npk)
{
    cyf_vt a0[CYF_RB], a1[CYF_RB];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        a0[r] = k0 ? cyf_load_t(out + r * ldo) : (cyf_vt){0};
        a1[r] = k0 ? cyf_load_t(out + r * ldo + CYF_VW) : (cyf_vt){0};
    }
    ptrdiff_t l = l0;
    for (ptrdiff_t k = k0; k < k0 + kn; k++) {
        for (int q = 0; q < npk && l < l1; q++, l++)
            __builtin_prefetch(pf + (l / CYF_PIECE_LINES) * ldw + (l % CYF_PIECE_LINES) * 16, 0, 1);
        const cyf_vt w0 = cyf_load_t(W + k * ldw);
        const cyf_vt w1 = cyf_load_t(W + k * ldw + CYF_VW);
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const float s = x[r * ldx + k];
            a0[r] += s * w0;
            a1[r] += s * w1;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        cyf_store_t(out + r * ldo, a0[r]);
        cyf_store_t(out + r * ldo + CYF_VW, a1[r]);
    }
}

/* The same for one column (the strip's ragged end), nr <= CYF_RB.  The
 * loop over k is outermost: as an inner loop it would be a reduction, which
 * gcc vectorizes as separate multiplies and in-order adds, unfused. */
static inline void cyf_rows_col(const float *x, ptrdiff_t ldx, int nr, const float *W, ptrdiff_t ldw,
                                ptrdiff_t k0, ptrdiff_t kn, float *out, ptrdiff_t ldo)
{
    float a[CYF_RB];
    for (int r = 0; r < nr; r++)
        a[r] = k0 ? out[r * ldo] : 0.0f;
    for (ptrdiff_t k = k0; k < k0 + kn; k++) {
        const float w = W[k * ldw];
        for (int r = 0; r < nr; r++)
            a[r] += x[r * ldx + k] * w;
    }
    for (int r = 0; r < nr; r++)
        out[r * ldo] = a[r];
}

/* cyf_gemv_rows for nr rows of x (ldx apart) into nr rows of out (ldo
 * apart): out_r[j] = sum_k x_r[k] W[k * ldw + j], j < n. */
static inline void cyf_gemv_rows_b(const float *x, ptrdiff_t ldx, int nr, const float *W, ptrdiff_t ldw,
                                   ptrdiff_t K, ptrdiff_t n, float *out, ptrdiff_t ldo)
{
    /* A tile walks its strip down the whole block, its sums in registers,
     * reading rows of W ldw apart: as a stream from DRAM that pattern
     * starves the tiles, but from the cache it is free.  So the columns go
     * in pieces, and the tiles computing one piece prefetch the next, row by
     * row, each row a contiguous run. */
    if (K <= 0) {
        for (int r = 0; r < nr; r++)
            for (ptrdiff_t j = 0; j < n; j++)
                out[r * ldo + j] = 0.0f;
        return;
    }
    const int ntiles = (nr + CYF_RB - 1) / CYF_RB;
    for (ptrdiff_t k0 = 0; k0 < K; k0 += CYF_KG) {
        const ptrdiff_t kn = K - k0 < CYF_KG ? K - k0 : CYF_KG;
        for (ptrdiff_t p0 = 0; p0 < n; p0 += CYF_PIECE) {
            const ptrdiff_t pe = n - p0 < CYF_PIECE ? n : p0 + CYF_PIECE;
            /* the next piece's lines, shared out among this piece's tiles */
            const ptrdiff_t nl = kn * CYF_PIECE_LINES;
            const ptrdiff_t ncalls = (pe - p0) / CYF_NR * ntiles;
            const ptrdiff_t per = ncalls ? (nl + ncalls - 1) / ncalls : 0;
            const int npk = (int)((per + kn - 1) / kn);
            const float *pf = pe < n ? W + k0 * ldw + pe : W + (k0 + kn) * ldw;
            ptrdiff_t l0 = 0;
            ptrdiff_t j = p0;
            for (; j + CYF_NR <= pe; j += CYF_NR)
                for (int r0 = 0; r0 < nr; r0 += CYF_RB) {  /* the strip's lines serve every row from L1 */
                    const int m = nr - r0 < CYF_RB ? nr - r0 : CYF_RB;
                    const float *xr = x + r0 * ldx;
                    float *o = out + r0 * ldo + j;
                    const ptrdiff_t l1 = l0 + per < nl ? l0 + per : nl;
                    switch (m) {  /* a constant row count, so each case keeps its tile in registers */
#if CYF_RB > 4
                    case 8: cyf_rows_tile(xr, ldx, 8, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    case 7: cyf_rows_tile(xr, ldx, 7, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    case 6: cyf_rows_tile(xr, ldx, 6, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    case 5: cyf_rows_tile(xr, ldx, 5, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
#endif
                    case 4: cyf_rows_tile(xr, ldx, 4, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    case 3: cyf_rows_tile(xr, ldx, 3, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    case 2: cyf_rows_tile(xr, ldx, 2, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    default: cyf_rows_tile(xr, ldx, 1, W + j, ldw, k0, kn, o, ldo, pf, l0, l1, npk); break;
                    }
                    l0 = l1;
                }
            for (; j < pe; j++)
                for (int r0 = 0; r0 < nr; r0 += CYF_RB)
                    cyf_rows_col(x + r0 * ldx, ldx, nr - r0 < CYF_RB ? nr - r0 : CYF_RB, W + j, ldw, k0, kn,
                                 out + r0 * ldo + j, ldo);
        }
    }
}

/* A dot product's fixed pairwise tree over its 16 lanes */
static inline float cyf_tree16(float *lanes)
{
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            lanes[j] += lanes[j + w];
    return lanes[0];
}

#if defined(__x86_64__)
#include <immintrin.h>
/* cyf_tree16 in registers: the 16 lanes as two halves (lo: lanes 0-7, hi:
 * 8-15), the same additions in the same order (the dot-product kernels'
 * last step, whatever their vector width). */
__attribute__((target("avx2"), always_inline))
static inline float cyf_tree16_ps(__m256 lo, __m256 hi)
{
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) float cyf_tree16_512(__m512 v)
{
    return cyf_tree16_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

/* The 16 lanes of a dot product (s0, s1) with the tail x[i..n) . w[i..n)
 * added lane by lane, combined in the tree: the end of cyf_dot. */
static inline float cyf_lanes_sum(cyf_v8f s0, cyf_v8f s1, const float *x, const float *w,
                                  ptrdiff_t i, ptrdiff_t n)
{
    float lanes[16];
    cyf_store8(lanes, s0);
    cyf_store8(lanes + 8, s1);
    for (ptrdiff_t j = 0; i < n; i++, j++)
        lanes[j] += x[i] * w[i];
    return cyf_tree16(lanes);
}

/* cyf_dot(x_r, w, n) for nr rows of x (ldx apart) against one row w:
 * out[r * ldo], each over cyf_dot's 16 lanes and tree, four rows of x at
 * a time (8 accumulators: AVX2's 16 registers; AVX-512 runs
 * cyf_dot_tile16).  Its loads, 10 per 8 multiply-adds, leave no room for
 * cyf_dot_tile16's prefetches (5 % slower with them at 16 rows). */
static inline void cyf_dot_tile(const float *x, ptrdiff_t ldx, int nr, const float *w, ptrdiff_t n, float *out,
                                ptrdiff_t ldo)
{
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int m = nr - r0 < 4 ? nr - r0 : 4;
        const float *xr = x + r0 * ldx;
        cyf_v8f s0[4] = {{0}}, s1[4] = {{0}};
        ptrdiff_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const cyf_v8f w0 = cyf_load8(w + i), w1 = cyf_load8(w + i + 8);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                if (r < m) {
                    s0[r] += cyf_load8(xr + r * ldx + i) * w0;
                    s1[r] += cyf_load8(xr + r * ldx + i + 8) * w1;
                }
            }
        }
        for (int r = 0; r < m; r++)
            out[(r0 + r) * ldo] = cyf_lanes_sum(s0[r], s1[r], xr + r * ldx, w, i, n);
    }
}

#if CYF_VW == 16
/* cyf_dot_tile with each dot product's 16 lanes in one AVX-512 register
 * (lane l: inputs i = l mod 16, as s0 / s1's lanes 0-7 / 8-15) and NW (a
 * constant once inlined, up to 4) rows of w against 4 rows of x: 16
 * accumulators and 8 loads per 16 multiply-adds, so the rows of x, which a
 * batch of 8 or 16 no longer keeps in L1, are read half as often.  Same
 * products, lanes and tree: the same bits.  Meanwhile the next NW rows of
 * w (pf, ldw apart) are prefetched, npk lines per step: the rows of w are
 * read from DRAM once and then serve every row of x from the cache, so
 * without it the memory would wait while the later rows of x compute. */
static inline __attribute__((always_inline)) void
cyf_dot_tile16(const float *x, ptrdiff_t ldx, int nr, const float *w, ptrdiff_t ldw, const int NW,
               ptrdiff_t n, float *out, ptrdiff_t ldo, const float *pf, int npk)
{
    const ptrdiff_t lpr = (n + 15) / 16;  /* lines per row of w */
    ptrdiff_t pc = 0;
    int prow = 0;
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int m = nr - r0 < 4 ? nr - r0 : 4;
        const float *xr = x + r0 * ldx;
        cyf_vt s[4][4];
#pragma GCC unroll 4
        for (int c = 0; c < NW; c++)
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                s[c][r] = (cyf_vt){0};
        ptrdiff_t i = 0;
        for (; i + 16 <= n; i += 16) {
            for (int q = 0; q < npk && prow < NW; q++) {
                __builtin_prefetch(pf + prow * ldw + pc * 16, 0, 1);
                if (++pc == lpr) {
                    pc = 0;
                    prow++;
                }
            }
            cyf_vt wv[4];
#pragma GCC unroll 4
            for (int c = 0; c < NW; c++)
                wv[c] = cyf_load_t(w + c * ldw + i);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                if (r < m) {
                    const cyf_vt xv = cyf_load_t(xr + r * ldx + i);
#pragma GCC unroll 4
                    for (int c = 0; c < NW; c++)
                        s[c][r] += xv * wv[c];
                }
            }
        }
        if (i == n) {  /* no tail: the tree in registers */
            for (int c = 0; c < NW; c++)
                for (int r = 0; r < m; r++)
                    out[c + (r0 + r) * ldo] = cyf_tree16_512(s[c][r]);
            continue;
        }
        for (int c = 0; c < NW; c++)
            for (int r = 0; r < m; r++) {
                float lanes[16];
                cyf_store_t(lanes, s[c][r]);
                const float *xa = xr + r * ldx, *wa = w + c * ldw;
                for (ptrdiff_t t = i, j = 0; t < n; t++, j++)
                    lanes[j] += xa[t] * wa[t];
                out[c + (r0 + r) * ldo] = cyf_tree16(lanes);
            }
    }
}
#endif

/* cyf_dot(x_r, w_c, n) for nr rows of x against nw rows of w:
 * out[c + r * ldo]. */
static inline void cyf_dot_rows(const float *x, ptrdiff_t ldx, int nr, const float *w, ptrdiff_t ldw,
                                int nw, ptrdiff_t n, float *out, ptrdiff_t ldo)
{
    int c = 0;
#if CYF_VW == 16
    /* a group's steps share out the next group's lines (the 4 rows after
     * the last group too: most often the same thread's next piece) */
    const ptrdiff_t steps = (nr + 3) / 4 * (n / 16);
    const int npk = steps ? (int)((4 * ((n + 15) / 16) + steps - 1) / steps) : 0;
    for (; c + 4 <= nw; c += 4)
        cyf_dot_tile16(x, ldx, nr, w + c * ldw, ldw, 4, n, out + c, ldo, w + (c + 4) * ldw, npk);
    switch (nw - c) {
    case 3: cyf_dot_tile16(x, ldx, nr, w + c * ldw, ldw, 3, n, out + c, ldo, w, 0); break;
    case 2: cyf_dot_tile16(x, ldx, nr, w + c * ldw, ldw, 2, n, out + c, ldo, w, 0); break;
    case 1: cyf_dot_tile16(x, ldx, nr, w + c * ldw, ldw, 1, n, out + c, ldo, w, 0); break;
    }
#else
    for (; c < nw; c++)
        cyf_dot_tile(x, ldx, nr, w + c * ldw, n, out + c, ldo);
#endif
}

/* ---- weights in fewer bytes ---------------------------------------------
 * Formats (cyformer/formats.py): bfloat16 (the top half of a float32),
 * int8 (one float32 scale per output), int4 (two weights a byte, one scale
 * per output and group of CYF_GROUP inputs; a nibble q holds q - 8).  A
 * weight becomes float32 in registers, exactly (q * 1.0f, or bf16 << 16),
 * and the scale multiplies a sum of such products: the arithmetic is IEEE
 * float32 in a fixed order, as for float32 weights. */
#define CYF_F32 0
#define CYF_BF16 1
#define CYF_I8 2
#define CYF_I4 3
#define CYF_GROUP 32

typedef unsigned short cyf_v8h __attribute__((vector_size(16)));
typedef unsigned int cyf_v8u __attribute__((vector_size(32)));
typedef signed char cyf_v8b __attribute__((vector_size(8)));
typedef unsigned char cyf_v8ub __attribute__((vector_size(8)));
typedef int cyf_v8i __attribute__((vector_size(32)));

/* Widening 8 weights to float32.  gcc lowers __builtin_convertvector from
 * 8- or 16-bit elements one element at a time (a load and an insert each:
 * int8 decode ran at a tenth of the read bandwidth), so on x86 the widening
 * is written with the instructions meant for it; the values are the same. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline cyf_v8f cyf_m256(__m256 v) { cyf_v8f f; memcpy(&f, &v, sizeof f); return f; }

static inline cyf_v8f cyf_bf16_8(const unsigned short *p)
{
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return cyf_m256(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
}

static inline cyf_v8f cyf_i8_8(const signed char *p)
{
    return cyf_m256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}

/* int4 pairs: byte j of a packed row holds rows 2i (low nibble) and 2i+1 (high) */
static inline cyf_v8f cyf_i4_8(const unsigned char *p, int high)
{
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    b = high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    return cyf_m256(_mm256_cvtepi32_ps(_mm256_sub_epi32(b, _mm256_set1_epi32(8))));
}
#elif defined(__SSE4_1__)
#include <immintrin.h>
static inline cyf_v8f cyf_m128x2(__m128 lo, __m128 hi)
{
    cyf_v8f f;
    memcpy(&f, &lo, sizeof lo);
    memcpy((char *)&f + sizeof lo, &hi, sizeof hi);
    return f;
}

static inline cyf_v8f cyf_bf16_8(const unsigned short *p)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    /* (0, h) pairs of 16-bit halves: each 32-bit lane is h << 16 */
    return cyf_m128x2(_mm_castsi128_ps(_mm_unpacklo_epi16(z, h)), _mm_castsi128_ps(_mm_unpackhi_epi16(z, h)));
}

static inline cyf_v8f cyf_i8_8(const signed char *p)
{
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return cyf_m128x2(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(b)), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(b, 4))));
}

static inline cyf_v8f cyf_i4_8(const unsigned char *p, int high)
{
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i lo = _mm_cvtepu8_epi32(b), hi = _mm_cvtepu8_epi32(_mm_srli_si128(b, 4));
    const __m128i m = _mm_set1_epi32(15), e = _mm_set1_epi32(8);
    lo = high ? _mm_srli_epi32(lo, 4) : _mm_and_si128(lo, m);
    hi = high ? _mm_srli_epi32(hi, 4) : _mm_and_si128(hi, m);
    return cyf_m128x2(_mm_cvtepi32_ps(_mm_sub_epi32(lo, e)), _mm_cvtepi32_ps(_mm_sub_epi32(hi, e)));
}
#else
static inline cyf_v8f cyf_bf16_8(const unsigned short *p)
{
    cyf_v8h h;
    memcpy(&h, p, sizeof h);
    cyf_v8u u = __builtin_convertvector(h, cyf_v8u) << 16;
    cyf_v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline cyf_v8f cyf_i8_8(const signed char *p)
{
    cyf_v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, cyf_v8f);
}

/* int4 pairs: byte j of a packed row holds rows 2i (low nibble) and 2i+1 (high) */
static inline cyf_v8f cyf_i4_8(const unsigned char *p, int high)
{
    cyf_v8ub b;
    memcpy(&b, p, sizeof b);
    cyf_v8ub q = high ? (b >> 4) : (b & 15);
    return __builtin_convertvector(__builtin_convertvector(q, cyf_v8i) - 8, cyf_v8f);
}
#endif

static inline float cyf_bf16_1(unsigned short h)
{
    unsigned int u = (unsigned int)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float cyf_i4_1(unsigned char b, int high)
{
    return (float)((int)(high ? b >> 4 : b & 15) - 8);
}

/* Row k, columns j..j+7 of a [K, N] matrix in format fmt (ld: elements
 * between rows; for int4, bytes between row pairs). */
static inline cyf_v8f cyf_row8(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t k, ptrdiff_t j)
{
    switch (fmt) {
    case CYF_BF16: return cyf_bf16_8((const unsigned short *)W + k * ld + j);
    case CYF_I8: return cyf_i8_8((const signed char *)W + k * ld + j);
    case CYF_I4: return cyf_i4_8((const unsigned char *)W + (k >> 1) * ld + j, (int)(k & 1));
    default: return cyf_load8((const float *)W + k * ld + j);
    }
}

static inline float cyf_row1(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t k, ptrdiff_t j)
{
    switch (fmt) {
    case CYF_BF16: return cyf_bf16_1(((const unsigned short *)W)[k * ld + j]);
    case CYF_I8: return (float)((const signed char *)W)[k * ld + j];
    case CYF_I4: return cyf_i4_1(((const unsigned char *)W)[(k >> 1) * ld + j], (int)(k & 1));
    default: return ((const float *)W)[k * ld + j];
    }
}

/* CYF_VW consecutive weights of row k of a [K, N] matrix in format fmt, from
 * column j, as float32: one AVX-512 widening instruction for 16 weights
 * where the build has it, cyf_row8 otherwise. */
#if CYF_VW == 16
static inline cyf_vt cyf_m512(__m512 v) { cyf_vt f; memcpy(&f, &v, sizeof f); return f; }

static inline cyf_vt cyf_wide16(const void *p, int fmt, int high)
{
    switch (fmt) {
    case CYF_BF16: {
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        return cyf_m512(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
    }
    case CYF_I8:
        return cyf_m512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
    case CYF_I4: {
        /* the nibble indexes a table of the 16 values q - 8: vpermps reads
         * only an index's low 4 bits, so the low nibble needs no mask and
         * neither needs the subtract and the conversion: the same floats
         * in two instructions fewer (one core, 768x3072 from cache 1.2x,
         * from DRAM 1.3x) */
        const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        if (high)
            b = _mm512_srli_epi32(b, 4);
        return cyf_m512(_mm512_permutexvar_ps(b, q));
    }
    default:
        return cyf_load_t((const float *)p);
    }
}

static inline cyf_vt cyf_row_t(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t k, ptrdiff_t j)
{
    switch (fmt) {
    case CYF_BF16: return cyf_wide16((const unsigned short *)W + k * ld + j, fmt, 0);
    case CYF_I8: return cyf_wide16((const signed char *)W + k * ld + j, fmt, 0);
    case CYF_I4: return cyf_wide16((const unsigned char *)W + (k >> 1) * ld + j, fmt, (int)(k & 1));
    default: return cyf_load_t((const float *)W + k * ld + j);
    }
}
#else
static inline cyf_vt cyf_row_t(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t k, ptrdiff_t j)
{
    return cyf_row8(W, fmt, ld, k, j);
}
#endif

#if CYF_VW == 16
/* bfloat16 rows 32 columns at a time from one 64-byte load: each 32-bit
 * lane holds an even column in its low half and the next odd one in its
 * high half, so the odd weight is the lane with its low half cleared and the
 * even one the lane shifted up: 2 instructions per 16 weights where widening
 * 16 halves takes 3 (one core, 768x3072 from cache 1.3x; from DRAM the read
 * limits it as before).  The 32 outputs are kept
 * as 16 even then 16 odd columns between passes; cyf_bf16_unpair restores
 * their order.  W: row 0 of the pass, column 0; returns the columns done. */
static inline __attribute__((always_inline)) ptrdiff_t
cyf_bf16_pairs(const float *s, const unsigned short *W, ptrdiff_t ld, ptrdiff_t k, ptrdiff_t n, float *out)
{
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        cyf_vt ae = k ? cyf_load_t(out + j) : (cyf_vt){0};
        cyf_vt ao = k ? cyf_load_t(out + j + 16) : (cyf_vt){0};
        for (int i = 0; i < 8; i++) {
            const __m512i v = _mm512_loadu_si512((const void *)(W + i * ld + j));
            ae += s[i] * cyf_m512(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            ao += s[i] * cyf_m512(_mm512_castsi512_ps(_mm512_and_si512(v, odd)));
        }
        cyf_store_t(out + j, ae);
        cyf_store_t(out + j + 16, ao);
    }
    return j;
}

/* out's 32-column runs from cyf_bf16_pairs (16 even, 16 odd) back in order */
static inline void cyf_bf16_unpair(float *out, ptrdiff_t n)
{
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (ptrdiff_t j = 0; j + 32 <= n; j += 32) {
        const __m512 e = _mm512_loadu_ps(out + j), o = _mm512_loadu_ps(out + j + 16);
        _mm512_storeu_ps(out + j, _mm512_permutex2var_ps(e, lo, o));
        _mm512_storeu_ps(out + j + 16, _mm512_permutex2var_ps(e, hi, o));
    }
}
#endif

/* cyf_gemv_rows for W's rows k0 .. k0+K-1 (k0 even for int4) in format fmt,
 * unscaled: out[j] = sum_k x[k] W(k0 + k, j0 + j).  fmt is a constant in
 * each format's instantiation (formats.h), so each format gets its own loop
 * with no test on the format inside.  Eight rows of W per pass over out (half the loads and
 * stores of out that four rows cost); every output is still one k-ordered
 * chain acc += x[k] * w from zero, so the width and the rows per pass do
 * not change a bit of it. */
static inline __attribute__((always_inline)) void
cyf_gemv_rows_fmt(const float *x, const void *W, const int fmt, ptrdiff_t ld,
                  ptrdiff_t k0, ptrdiff_t j0, ptrdiff_t K, ptrdiff_t n, float *out)
{
    const cyf_vt zero = {0};
    ptrdiff_t k = 0, j;
    for (; k + 8 <= K; k += 8) {
        const float *s = x + k;
        /* k0 is even for int4: saying so makes each row's nibble a constant */
        const ptrdiff_t r = fmt == CYF_I4 ? (k0 + k) & ~(ptrdiff_t)1 : k0 + k;
        j = 0;
#if CYF_VW == 16
        if (fmt == CYF_BF16)
            j = cyf_bf16_pairs(s, (const unsigned short *)W + r * ld + j0, ld, k, n, out);
#endif
        for (; j + CYF_VW <= n; j += CYF_VW) {
            cyf_vt a = k ? cyf_load_t(out + j) : zero;
            for (int i = 0; i < 8; i++)
                a += s[i] * cyf_row_t(W, fmt, ld, r + i, j0 + j);
            cyf_store_t(out + j, a);
        }
        for (; j < n; j++) {
            float a = k ? out[j] : 0.0f;
            for (int i = 0; i < 8; i++)
                a += s[i] * cyf_row1(W, fmt, ld, r + i, j0 + j);
            out[j] = a;
        }
    }
#if CYF_VW == 16
    if (fmt == CYF_BF16 && k)
        cyf_bf16_unpair(out, n);
#endif
    for (; k < K; k++) {
        const float s = x[k];
        for (j = 0; j < n; j++) {
            float a = k ? out[j] : 0.0f;
            a += s * cyf_row1(W, fmt, ld, k0 + k, j0 + j);
            out[j] = a;
        }
    }
    if (K <= 0)
        for (j = 0; j < n; j++)
            out[j] = 0.0f;
}

/* dst[0:cnt] = row k, columns n .. n+cnt-1 of a [K, N] matrix in format fmt,
 * as float32 weights (times their scale: int8 per column, int4 per column and
 * group of CYF_GROUP rows).  The GEMM's panel packing. */
static inline void cyf_dequant_run(const void *W, int fmt, ptrdiff_t ld, const float *scale,
                                   ptrdiff_t N, ptrdiff_t k, ptrdiff_t n, ptrdiff_t cnt, float *dst)
{
    const float *s = fmt == CYF_I8 ? scale + n : fmt == CYF_I4 ? scale + (k / CYF_GROUP) * N + n : 0;
    ptrdiff_t j = 0;
    for (; j + 8 <= cnt; j += 8) {
        cyf_v8f v = cyf_row8(W, fmt, ld, k, n + j);
        cyf_store8(dst + j, s ? v * cyf_load8(s + j) : v);
    }
    for (; j < cnt; j++) {
        float v = cyf_row1(W, fmt, ld, k, n + j);
        dst[j] = s ? v * s[j] : v;
    }
}

/* Element (n, k) of an [N, K] matrix in format fmt, row stride ld (elements;
 * bytes for int4, where row n holds its K weights in pairs). */
static inline float cyf_elem_t(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t n, ptrdiff_t k)
{
    switch (fmt) {
    case CYF_BF16: return cyf_bf16_1(((const unsigned short *)W)[n * ld + k]);
    case CYF_I8: return (float)((const signed char *)W)[n * ld + k];
    case CYF_I4: return cyf_i4_1(((const unsigned char *)W)[n * ld + (k >> 1)], (int)(k & 1));
    default: return ((const float *)W)[n * ld + k];
    }
}

/* Weights k .. k+15 (k a multiple of 16) of row n of an [N, K] matrix in
 * format fmt, as float32 in k order, in two vectors of 8.  int4: byte m
 * holds k + 2m (low nibble) and k + 2m + 1 (high). */
static inline void cyf_trow16(const void *W, int fmt, ptrdiff_t ld, ptrdiff_t n, ptrdiff_t k,
                              cyf_v8f *w0, cyf_v8f *w1)
{
    switch (fmt) {
    case CYF_BF16:
        *w0 = cyf_bf16_8((const unsigned short *)W + n * ld + k);
        *w1 = cyf_bf16_8((const unsigned short *)W + n * ld + k + 8);
        break;
    case CYF_I8:
        *w0 = cyf_i8_8((const signed char *)W + n * ld + k);
        *w1 = cyf_i8_8((const signed char *)W + n * ld + k + 8);
        break;
    case CYF_I4: {
        const unsigned char *b = (const unsigned char *)W + n * ld + (k >> 1);
        const cyf_v8f lo = cyf_i4_8(b, 0), hi = cyf_i4_8(b, 1);
        *w0 = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
        *w1 = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
        break;
    }
    default:
        *w0 = cyf_load8((const float *)W + n * ld + k);
        *w1 = cyf_load8((const float *)W + n * ld + k + 8);
    }
}

/* x . row n of an [N, K] matrix in format fmt, K values from k0 (k0 a multiple
 * of 16), over 16 interleaved lanes and a fixed tree, as cyf_dot. */
static inline float cyf_dot_q(const float *x, const void *W, int fmt, ptrdiff_t ld, ptrdiff_t n,
                              ptrdiff_t k0, ptrdiff_t K)
{
    cyf_v8f s0 = {0}, s1 = {0}, w0, w1;
    float lanes[16];
    ptrdiff_t i = 0;
    for (; i + 16 <= K; i += 16) {
        cyf_trow16(W, fmt, ld, n, k0 + i, &w0, &w1);
        s0 += cyf_load8(x + i) * w0;
        s1 += cyf_load8(x + i + 8) * w1;
    }
    cyf_store8(lanes, s0);
    cyf_store8(lanes + 8, s1);
    for (ptrdiff_t j = 0; i < K; i++, j++)
        lanes[j] += x[i] * cyf_elem_t(W, fmt, ld, n, k0 + i);
    return cyf_tree16(lanes);
}

/* sum_i a[i] * b[i] over 16 interleaved lanes (i mod 16), then the lanes
 * combined in a fixed pairwise tree.  Deterministic for a given n. */
static inline float cyf_dot(const float *a, const float *b, ptrdiff_t n)
{
    cyf_v8f s0 = {0}, s1 = {0};
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 += cyf_load8(a + i) * cyf_load8(b + i);
        s1 += cyf_load8(a + i + 8) * cyf_load8(b + i + 8);
    }
    return cyf_lanes_sum(s0, s1, a, b, i, n);
}

/* sum of x[0..n) in 32 interleaved lanes (four independent vector chains,
 * so that the loop is bound by memory rather than by the adder): the
 * benchmark's probe of streaming read bandwidth.  Order-dependent; only
 * its speed matters. */
static inline float cyf_stream_sum(const float *x, ptrdiff_t n)
{
    cyf_v8f a = {0}, b = {0}, c = {0}, d = {0};
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a += cyf_load8(x + i);      b += cyf_load8(x + i + 8);
        c += cyf_load8(x + i + 16); d += cyf_load8(x + i + 24);
    }
    a = (a + b) + (c + d);
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += a[j];
    for (; i < n; i++) s += x[i];
    return s;
}

/* Sums in double over 8 interleaved lanes (i mod 8, two 4-double vectors),
 * the lanes then added in a fixed tree: eight independent add chains
 * instead of one (layer norm's statistics), in an order fixed for a given n. */
typedef double cyf_v4d __attribute__((vector_size(32)));
typedef float cyf_v4f __attribute__((vector_size(16)));

static inline cyf_v4d cyf_widen4(const float *p)
{
    cyf_v4f v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, cyf_v4d);
}

/* the lanes of a, b plus the tail x[i..n) (each term x - shift, squared
 * when `square`), combined in a fixed tree */
static inline double cyf_lanes8(cyf_v4d a, cyf_v4d b, const float *x, ptrdiff_t i, ptrdiff_t n,
                                double shift, int square)
{
    double l[8];
    memcpy(l, &a, sizeof a);
    memcpy(l + 4, &b, sizeof b);
    for (ptrdiff_t j = 0; i < n; i++, j++) {
        double d = (double)x[i] - shift;
        l[j] += square ? d * d : d;
    }
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* sum_i x[i] */
static inline double cyf_sum_f64(const float *x, ptrdiff_t n)
{
    cyf_v4d a = {0}, b = {0};
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a += cyf_widen4(x + i);
        b += cyf_widen4(x + i + 4);
    }
    return cyf_lanes8(a, b, x, i, n, 0.0, 0);
}

/* sum_i (x[i] - mean)^2 */
static inline double cyf_sqdev_f64(const float *x, ptrdiff_t n, double mean)
{
    cyf_v4d a = {0}, b = {0};
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        cyf_v4d d0 = cyf_widen4(x + i) - mean, d1 = cyf_widen4(x + i + 4) - mean;
        a += d0 * d0;
        b += d1 * d1;
    }
    return cyf_lanes8(a, b, x, i, n, mean, 1);
}

/* ---- exp and GELU, CYF_VW lanes at a time ------------------------------
 * glibc's expf/tanhf are scalar calls; without -ffast-math gcc will not
 * vectorise them.  This exp uses Cody-Waite range reduction x = n ln2 + r and
 * the Cephes minimax polynomial for e^r on [-ln2/2, ln2/2] (max error about
 * 1 ulp over the float range); 2^n is built in the exponent bits.  Pure IEEE
 * arithmetic lane by lane, so results do not depend on the vector width:
 * 16 lanes with AVX-512 halve the instruction count and give the same bits. */

typedef int cyf_vti __attribute__((vector_size(CYF_VW * sizeof(int))));

static inline cyf_vt cyf_select(cyf_vti mask, cyf_vt a, cyf_vt b)
{   /* mask lanes are 0 or -1: a where set, b elsewhere */
    cyf_vti ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    cyf_vti r = (ai & mask) | (bi & ~mask);
    cyf_vt out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline cyf_vt cyf_exp(cyf_vt x)
{
    const cyf_vt zero = {0};
    const cyf_vt hi = zero + 88.3762626647949f;
    const float lo = -87.3365478515625f;  /* below: e^x < FLT_MIN, return 0 */
    cyf_vti too_small = x < lo;
    cyf_vti too_big = x > hi;
    cyf_vti is_nan = x != x;
    cyf_vt xc = cyf_select(too_small | is_nan, zero, cyf_select(too_big, hi, x));
    /* n = round(x / ln2) by the 1.5 * 2^23 trick (exact for |n| < 2^22) */
    const float magic = 12582912.0f;
    cyf_vt n = (xc * 1.44269504088896341f + magic) - magic;
    cyf_vt r = xc - n * 0.693359375f;          /* ln2 split: exact high part */
    r = r - n * -2.12194440e-4f;                /* and the low part */
    cyf_vt r2 = r * r;
    cyf_vt p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    cyf_vti ni = __builtin_convertvector(n, cyf_vti);
    cyf_vti bits = (ni + 127) << 23;
    cyf_vt scale;
    memcpy(&scale, &bits, sizeof scale);
    cyf_vt y = p * scale;
    y = cyf_select(too_big, zero + __builtin_inff(), y);
    y = cyf_select(too_small, zero, y);
    return cyf_select(is_nan, x, y);
}

/* GPT-2's GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3),
 * computed as x / (1 + e^{-2u}) (the same function: 1 + tanh(u) = 2 / (1 + e^{-2u})),
 * which needs one exp and has no cancellation for negative x. */
static inline cyf_vt cyf_gelu_new_v(cyf_vt x)
{
    cyf_vt u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    cyf_vt y = x / (1.0f + cyf_exp(-2.0f * u));
    /* at x = -inf that is -inf / inf; the limit is 0 */
    return cyf_select(x == -__builtin_inff(), (cyf_vt){0}, y);
}

/* In place over n floats (tail padded through a small buffer, so every
 * element goes through the identical vector arithmetic). */
static inline void cyf_gelu_new_n(float *x, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + CYF_VW <= n; i += CYF_VW)
        cyf_store_t(x + i, cyf_gelu_new_v(cyf_load_t(x + i)));
    if (i < n) {
        float buf[CYF_VW] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(float));
        cyf_store_t(buf, cyf_gelu_new_v(cyf_load_t(buf)));
        memcpy(x + i, buf, (size_t)(n - i) * sizeof(float));
    }
}

/* SwiGLU's gate: out[i] = silu(g[i]) * u[i], silu(x) = x / (1 + e^-x), the
 * same lane arithmetic at every vector width (tail through a padded buffer). */
static inline cyf_vt cyf_silu_v(cyf_vt x)
{
    cyf_vt y = x / (1.0f + cyf_exp(-x));
    /* at x = -inf that is -inf / inf; the limit is 0 */
    return cyf_select(x == -__builtin_inff(), (cyf_vt){0}, y);
}

static inline void cyf_swiglu_n(float *out, const float *g, const float *u, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + CYF_VW <= n; i += CYF_VW)
        cyf_store_t(out + i, cyf_silu_v(cyf_load_t(g + i)) * cyf_load_t(u + i));
    if (i < n) {
        float bg[CYF_VW] = {0}, bu[CYF_VW] = {0};
        memcpy(bg, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(bu, u + i, (size_t)(n - i) * sizeof(float));
        cyf_store_t(bg, cyf_silu_v(cyf_load_t(bg)) * cyf_load_t(bu));
        memcpy(out + i, bg, (size_t)(n - i) * sizeof(float));
    }
}

/* max(init, x[0..n)), NaNs never chosen (as with a scalar `if (x > m)`
 * loop); two vector chains instead of one serial compare. */
static inline float cyf_max_n(const float *x, ptrdiff_t n, float init)
{
    cyf_vt a = (cyf_vt){0} + init, b = a;
    ptrdiff_t i = 0;
    for (; i + 2 * CYF_VW <= n; i += 2 * CYF_VW) {
        cyf_vt u = cyf_load_t(x + i), v = cyf_load_t(x + i + CYF_VW);
        a = cyf_select(u > a, u, a);
        b = cyf_select(v > b, v, b);
    }
    a = cyf_select(b > a, b, a);
    float m = init;
    for (int j = 0; j < CYF_VW; j++)
        if (a[j] > m) m = a[j];
    for (; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

/* x[i] = e^(x[i] - shift) in place; returns the sum of the results, added
 * in double over 8 interleaved lanes (i mod 8) and then a fixed tree:
 * deterministic, exact enough for softmax, and not one serial chain.  The
 * lanes take the terms in the same order at either vector width. */
typedef double cyf_v8d __attribute__((vector_size(64)));

static inline void cyf_add_lanes(cyf_v8d *acc, cyf_vt e, int ngroups)
{   /* the first ngroups groups of 8 floats of e, widened, into the 8 lanes
     * (one 8-double register with AVX-512, two 4-double ones with AVX2) */
    if (ngroups < 1) return;
    *acc += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7), cyf_v8d);
#if CYF_VW == 16
    if (ngroups < 2) return;
    *acc += __builtin_convertvector(__builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15), cyf_v8d);
#endif
}

static inline double cyf_exp_shift_n(float *x, ptrdiff_t n, float shift)
{
    cyf_v8d acc = {0};
    ptrdiff_t i = 0;
    for (; i + CYF_VW <= n; i += CYF_VW) {
        /* summed from registers: reading the stored floats back went
         * through a store-forwarding stall every 8 elements */
        const cyf_vt e = cyf_exp(cyf_load_t(x + i) - shift);
        cyf_store_t(x + i, e);
        cyf_add_lanes(&acc, e, CYF_VW / 8);
    }
    if (i < n) {  /* the tail through a padded buffer: the same vector arithmetic */
        float buf[CYF_VW];
        ptrdiff_t m = n - i;
        memcpy(buf, x + i, (size_t)m * sizeof(float));
        for (ptrdiff_t j = m; j < CYF_VW; j++) buf[j] = shift;
        const cyf_vt e = cyf_exp(cyf_load_t(buf) - shift);
        cyf_store_t(buf, e);
        memcpy(x + i, buf, (size_t)m * sizeof(float));
        cyf_add_lanes(&acc, e, (int)(m / 8));  /* whole groups of 8 */
        i += m / 8 * 8;
    }
    cyf_v4d a = __builtin_shufflevector(acc, acc, 0, 1, 2, 3);
    cyf_v4d b = __builtin_shufflevector(acc, acc, 4, 5, 6, 7);
    return cyf_lanes8(a, b, x, i, n, 0.0, 0);
}

/* A byte of each 64-byte line of rows rows apart (ld bytes apart, nb bytes
 * each), row after row: the GEMMs' packers do it before they read the
 * rows side by side, which from DRAM waited on the loads (the hardware
 * prefetchers follow a row at a time; software prefetches of every line
 * did not help). */
static inline void cyf_touch_rows(const void *base, ptrdiff_t ld, ptrdiff_t rows, ptrdiff_t nb)
{
    unsigned char t = 0;
    for (ptrdiff_t j = 0; j < rows; j++)
        for (ptrdiff_t o = 0; o < nb; o += 64)
            t ^= ((const unsigned char *)base)[j * ld + o];
    __asm__ volatile("" : : "r"(t));  /* the loads are the point: keep them */
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* r[i] (16 rows of 16 dwords) transposed in registers: r[e] becomes dword e
 * of rows 0 .. 15 (4 rounds of 32-bit, 64-bit and 128-bit lane shuffles).
 * The GEMMs' packers of rows-per-output matrices use it. */
__attribute__((always_inline))
static inline void cyf_transpose16_epi32(__m512i *r)
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + s], 128-bit lane L: element 4L + s of rows 4q .. 4q+3; then
     * the lanes are gathered so that r[e] is element e of rows 0 .. 15 */
    for (int i = 0; i < 8; i++) {
        const int a = (i & 3) + (i >> 2) * 8;  /* pairs (0,4) (1,5) (2,6) (3,7) (8,12) ... */
        t[a] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0x88);
        t[a + 4] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
}
#endif

#endif
