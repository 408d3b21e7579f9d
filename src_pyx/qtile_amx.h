/* The integer GEMM's tile with AMX, included twice by qgemm.h: once with
 * the tile instructions, once with amx.h's model of them (CYF_AMX_TILE_
 * names the function; amx_ops.h's CYF_T_* the instructions, each a
 * compiler barrier, so the sums the tile stores are read after it).
 *
 * Up to CYF_AMR rows of x by a strip's 32 outputs.  Per block of CYF_QB
 * inputs, one tdpbsud per 16 outputs multiplies the rows' codes (tile 2,
 * signed, rows Kp bytes apart) by the strip's codes w + 128 (tiles 3, 4:
 * the strip is tileloadd's layout already, 4 inputs of one output per
 * dword, 16 outputs a 64-byte half of each 128-byte row) into int32 tiles
 * 0 and 1, which go to memory.  The float steps are the VNNI tile's, term
 * by term (s = sum - bsum, p = fma(d or d * scale, s, p) from 0 per run of
 * bpp blocks, runs added in order), so the same bits. */

__attribute__((target("avx512vnni"), always_inline))
static inline void CYF_AMX_TILE_(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                 const unsigned char *strip, ptrdiff_t nblk, int bpp, int grouped)
{
    enum { CHUNK = 4 };  /* blocks whose int32 sums are taken before their float steps */
    const ptrdiff_t Kp = nblk * CYF_QB;
    const float *sc = (const float *)(strip + Kp * CYF_QNR);
    int cs[CHUNK][CYF_AMR * CYF_QNR] __attribute__((aligned(64)));
    float acc[CYF_AMR * CYF_QNR] __attribute__((aligned(64))), p[CYF_AMR * CYF_QNR] __attribute__((aligned(64)));
    cyf_tilecfg cfg __attribute__((aligned(64)));
    cyf_amx_gemm_cfg(&cfg, rows, CYF_QB / 4);  /* a block of 4-code dwords per step */
    CYF_T_STATE
    CYF_T_CFG(&cfg);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < CYF_QNR; j += 16)
            _mm512_store_ps(acc + r * CYF_QNR + j, _mm512_set1_ps(-0.0f));  /* -0 + p is p */
    for (ptrdiff_t b0 = 0; b0 < nblk; b0 += bpp) {
        const ptrdiff_t b1 = b0 + bpp < nblk ? b0 + bpp : nblk;
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < CYF_QNR; j += 16)
                _mm512_store_ps(p + r * CYF_QNR + j, _mm512_setzero_ps());
        for (ptrdiff_t c0 = b0; c0 < b1; c0 += CHUNK) {
            const ptrdiff_t c1 = c0 + CHUNK < b1 ? c0 + CHUNK : b1;
            for (ptrdiff_t b = c0; b < c1; b++) {
                const unsigned char *w = strip + b * CYF_QB * CYF_QNR;
                CYF_T_ZERO(0);
                CYF_T_ZERO(1);
                CYF_T_LOAD(2, q + b * CYF_QB, Kp);
                CYF_T_LOAD(3, w, 4 * CYF_QNR);
                CYF_T_LOAD(4, w + 64, 4 * CYF_QNR);
                CYF_T_DPBSUD(0, 2, 3);
                CYF_T_DPBSUD(1, 2, 4);
                CYF_T_STORE(0, cs[b - c0], 4 * CYF_QNR);
                CYF_T_STORE(1, cs[b - c0] + 16, 4 * CYF_QNR);
            }
            for (int r = 0; r < rows; r++) {
                __m512 p0 = _mm512_load_ps(p + r * CYF_QNR), p1 = _mm512_load_ps(p + r * CYF_QNR + 16);
                for (ptrdiff_t b = c0; b < c1; b++) {
                    const __m512i bs = _mm512_set1_epi32(bsum[r * nblk + b]);
                    const __m512i s0 = _mm512_sub_epi32(_mm512_load_si512(cs[b - c0] + r * CYF_QNR), bs);
                    const __m512i s1 = _mm512_sub_epi32(_mm512_load_si512(cs[b - c0] + r * CYF_QNR + 16), bs);
                    const __m512 db = _mm512_set1_ps(d[r * nblk + b]);
                    const __m512 t0 = grouped ? _mm512_mul_ps(db, _mm512_loadu_ps(sc + b * CYF_QNR)) : db;
                    const __m512 t1 = grouped ? _mm512_mul_ps(db, _mm512_loadu_ps(sc + b * CYF_QNR + 16)) : db;
                    p0 = _mm512_fmadd_ps(t0, _mm512_cvtepi32_ps(s0), p0);
                    p1 = _mm512_fmadd_ps(t1, _mm512_cvtepi32_ps(s1), p1);
                }
                _mm512_store_ps(p + r * CYF_QNR, p0);
                _mm512_store_ps(p + r * CYF_QNR + 16, p1);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < CYF_QNR; j += 16)
                _mm512_store_ps(acc + r * CYF_QNR + j,
                                _mm512_add_ps(_mm512_load_ps(acc + r * CYF_QNR + j), _mm512_load_ps(p + r * CYF_QNR + j)));
    }
    CYF_T_END(acc, rows * CYF_QNR)
    memcpy(c, acc, (size_t)rows * CYF_QNR * sizeof(float));
}
