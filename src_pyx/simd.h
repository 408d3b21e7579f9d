/* Register-blocked inner loops that Cython cannot express.
 *
 * Cython has no SIMD vector type, and gcc does not keep a 2-D accumulator
 * array in registers, so the two innermost loops that need explicit register
 * blocking are written here with GCC/Clang vector extensions.  The type is 8
 * floats wide; the compiler lowers it to one AVX register (x86-64-v3/v4), two
 * SSE registers (x86-64-v2) or NEON pairs, so the same source serves every
 * kernel level built by setup.py.  Everything around these loops (packing,
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

#define CYF_MR 6   /* rows of x per tile: 6 x 2 accumulators + 2 loads + 1 broadcast = 15 ymm */
#define CYF_NR 16  /* columns per packed strip */

/* tile[r][j] = sum_k x[r][k] * wp[k][j] for a CYF_MR x CYF_NR tile.
 * x: rows of length >= K with stride ldx; rows >= nrows repeat the last valid
 * row (their results are discarded by the caller).  wp: a packed strip,
 * K rows of CYF_NR contiguous floats. */
static inline void cyf_gemm_tile(const float *x, ptrdiff_t ldx, int nrows,
                                 const float *wp, ptrdiff_t K, float *tile)
{
    const float *x0 = x;
    const float *x1 = x + (nrows > 1 ? 1 : 0) * ldx;
    const float *x2 = x + (nrows > 2 ? 2 : nrows - 1) * ldx;
    const float *x3 = x + (nrows > 3 ? 3 : nrows - 1) * ldx;
    const float *x4 = x + (nrows > 4 ? 4 : nrows - 1) * ldx;
    const float *x5 = x + (nrows > 5 ? 5 : nrows - 1) * ldx;
    cyf_v8f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
    cyf_v8f a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
    for (ptrdiff_t k = 0; k < K; k++) {
        const cyf_v8f w0 = cyf_load8(wp + k * CYF_NR);
        const cyf_v8f w1 = cyf_load8(wp + k * CYF_NR + 8);
        float s;
        s = x0[k]; a00 += s * w0; a01 += s * w1;
        s = x1[k]; a10 += s * w0; a11 += s * w1;
        s = x2[k]; a20 += s * w0; a21 += s * w1;
        s = x3[k]; a30 += s * w0; a31 += s * w1;
        s = x4[k]; a40 += s * w0; a41 += s * w1;
        s = x5[k]; a50 += s * w0; a51 += s * w1;
    }
    cyf_store8(tile + 0 * CYF_NR, a00); cyf_store8(tile + 0 * CYF_NR + 8, a01);
    cyf_store8(tile + 1 * CYF_NR, a10); cyf_store8(tile + 1 * CYF_NR + 8, a11);
    cyf_store8(tile + 2 * CYF_NR, a20); cyf_store8(tile + 2 * CYF_NR + 8, a21);
    cyf_store8(tile + 3 * CYF_NR, a30); cyf_store8(tile + 3 * CYF_NR + 8, a31);
    cyf_store8(tile + 4 * CYF_NR, a40); cyf_store8(tile + 4 * CYF_NR + 8, a41);
    cyf_store8(tile + 5 * CYF_NR, a50); cyf_store8(tile + 5 * CYF_NR + 8, a51);
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
    float lanes[16];
    cyf_store8(lanes, s0);
    cyf_store8(lanes + 8, s1);
    for (ptrdiff_t j = 0; i < n; i++, j++)
        lanes[j] += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            lanes[j] += lanes[j + w];
    return lanes[0];
}

#endif
