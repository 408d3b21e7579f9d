/* The bfloat16 GEMM's tile with AMX, included twice by bgemm.h: once with
 * the tile instructions, once with amx.h's model of them (CYF_AMX_TILE_
 * names the function; amx_ops.h's CYF_T_* the instructions).
 *
 * Up to CYF_AMR rows of x by a strip's 32 outputs.  The strip already is
 * tileloadd's layout for tdpbf16ps (a dword per output holding a pair of
 * consecutive inputs; 16 outputs a 64-byte half of each 128-byte row), and
 * so are the rows' pairs (ldx dwords apart).  Per run of bpp pairs, float32
 * tiles 0 and 1 start at zero and each step of up to 16 pairs adds tile 2
 * (the rows' pairs) times tiles 3 and 4 (the strip's halves); the run's
 * sums go through memory into the running sums, the runs added in order
 * from -0 as the AVX512-BF16 tile does.  Within a step, tdpbf16ps sums the
 * even and the odd products apart and then adds both to the tile (amx.h's
 * model), not vdpbf16ps's order, so this tile's reference is
 * numpy_ref.bf16amx_gemm.  A
 * step of fewer than 16 pairs (K's last) needs its own tile shapes, and a
 * new configuration clears the tiles: the run's sums wait in memory. */

__attribute__((target("avx512f"), always_inline))
static inline void CYF_AMX_TILE_(float *c, const unsigned int *xp, ptrdiff_t ldx, int rows,
                                 const unsigned int *strip, ptrdiff_t np, int bpp)
{
    float acc[CYF_AMR * CYF_BNR] __attribute__((aligned(64))), run[CYF_AMR * CYF_BNR] __attribute__((aligned(64)));
    cyf_tilecfg cfg __attribute__((aligned(64)));
    int shape = 16;  /* the pairs per step the tiles are shaped for */
    CYF_T_STATE
    cyf_amx_gemm_cfg(&cfg, rows, shape);
    CYF_T_CFG(&cfg);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < CYF_BNR; j += 16)
            _mm512_store_ps(acc + r * CYF_BNR + j, _mm512_set1_ps(-0.0f));  /* -0 + s is s */
    for (ptrdiff_t p0 = 0; p0 < np; p0 += bpp) {
        const ptrdiff_t p1 = p0 + bpp < np ? p0 + bpp : np;
        CYF_T_ZERO(0);
        CYF_T_ZERO(1);
        for (ptrdiff_t p = p0; p < p1; p += 16) {
            const int n = p1 - p < 16 ? (int)(p1 - p) : 16;
            if (n != shape) {  /* keep the run's sums across the new shapes */
                CYF_T_STORE(0, run, 4 * CYF_BNR);
                CYF_T_STORE(1, run + 16, 4 * CYF_BNR);
                shape = n;
                cyf_amx_gemm_cfg(&cfg, rows, shape);
                CYF_T_CFG(&cfg);
                CYF_T_LOAD(0, run, 4 * CYF_BNR);
                CYF_T_LOAD(1, run + 16, 4 * CYF_BNR);
            }
            CYF_T_LOAD(2, xp + p, 4 * ldx);
            CYF_T_LOAD(3, strip + p * CYF_BNR, 4 * CYF_BNR);
            CYF_T_LOAD(4, strip + p * CYF_BNR + 16, 4 * CYF_BNR);
            CYF_T_DPBF16PS(0, 2, 3);
            CYF_T_DPBF16PS(1, 2, 4);
        }
        CYF_T_STORE(0, run, 4 * CYF_BNR);
        CYF_T_STORE(1, run + 16, 4 * CYF_BNR);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < CYF_BNR; j += 16)
                _mm512_store_ps(acc + r * CYF_BNR + j, _mm512_add_ps(_mm512_load_ps(acc + r * CYF_BNR + j),
                                                                      _mm512_load_ps(run + r * CYF_BNR + j)));
    }
    CYF_T_END(acc, rows * CYF_BNR)
    memcpy(c, acc, (size_t)rows * CYF_BNR * sizeof(float));
}
