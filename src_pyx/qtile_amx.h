/* The integer GEMM's tile with AMX, included twice by qgemm.h: once with
 * the tile instructions, once with amx.h's model of them (CYF_AMX_TILE_
 * names the function; amx_ops.h's CYF_T_* the instructions, each a
 * compiler barrier, so the sums the tile stores are read after it).
 *
 * Up to CYF_AMR rows of x by a strip's 32 outputs.  Per block of CYF_QB
 * inputs, one tdpbsud per 16 outputs multiplies the rows' codes (signed,
 * rows Kp bytes apart) by the strip's codes w + 128 (tiles 3, 4: the strip
 * is tileloadd's layout already, 4 inputs of one output per dword, 16
 * outputs a 64-byte half of each 128-byte row) into two int32 tiles, which
 * go to memory.  The float steps are the VNNI tile's, term by term
 * (s = sum - bsum, p = fma(d or d * scale, s, p) from 0 per run of bpp
 * blocks, runs added in order), so the same bits.  A row's partial and
 * its sum of runs stay in registers through a chunk of blocks; a run's
 * partial is added where the run ends, and only a run that goes on past
 * the chunk leaves its partial in memory (p).
 *
 * Software pipelined, so the tile unit and the vector units work at once:
 * the blocks go in chunks of CHUNK, and while the vector code turns one
 * chunk's stored sums into floats, the tile instructions of the next chunk
 * go out between its rows into the other half of a two-chunk buffer.  Even
 * blocks use sum tiles 0, 1 and x tile 2, odd ones 5, 6 and 7, so a block's
 * tilezero and tileloadd need not wait for the previous block's stores and
 * products; and the sums a row reads were stored a chunk earlier, not just
 * before the read. */

/* Block b's int32 sums into dst (rows x 32, rows CYF_QNR dwords apart):
 * sum tiles S0, S1 and x tile X; the strip's halves always tiles 3, 4. */
#define CYF_QAMX_BLOCK_(S0, S1, X, b, dst)                         \
    do {                                                           \
        const unsigned char *w_ = strip + (b) * CYF_QB * CYF_QNR;  \
        CYF_T_ZERO(S0);                                            \
        CYF_T_ZERO(S1);                                            \
        CYF_T_LOAD(X, q + (b) * CYF_QB, Kp);                       \
        CYF_T_LOAD(3, w_, 4 * CYF_QNR);                            \
        CYF_T_LOAD(4, w_ + 64, 4 * CYF_QNR);                       \
        CYF_T_DPBSUD(S0, X, 3);                                    \
        CYF_T_DPBSUD(S1, X, 4);                                    \
        CYF_T_STORE(S0, (dst), 4 * CYF_QNR);                       \
        CYF_T_STORE(S1, (dst) + 16, 4 * CYF_QNR);                  \
    } while (0)
#define CYF_QAMX_ISSUE_(b, dst)                                    \
    do {                                                           \
        if ((b) & 1)                                               \
            CYF_QAMX_BLOCK_(5, 6, 7, b, dst);                      \
        else                                                       \
            CYF_QAMX_BLOCK_(0, 1, 2, b, dst);                      \
    } while (0)

__attribute__((target("avx512vnni"), always_inline))
static inline void CYF_AMX_TILE_(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                 const unsigned char *strip, ptrdiff_t nblk, int bpp, int grouped)
{
    enum { CHUNK = 4 };  /* blocks per pass of the float steps: a row's partials loaded and stored once per chunk */
    const ptrdiff_t Kp = nblk * CYF_QB;
    const float *sc = (const float *)(strip + Kp * CYF_QNR);
    int cs[2][CHUNK][CYF_AMR * CYF_QNR] __attribute__((aligned(64)));  /* this chunk's sums, and the next's */
    /* acc: the runs added so far; p: the partial of a run that goes on into the next chunk */
    float acc[CYF_AMR * CYF_QNR] __attribute__((aligned(64))), p[CYF_AMR * CYF_QNR] __attribute__((aligned(64)));
    cyf_tilecfg cfg __attribute__((aligned(64)));
    cyf_amx_gemm_cfg(&cfg, rows, CYF_QB / 4);  /* a block of 4-code dwords per step */
    CYF_T_STATE
    CYF_T_CFG(&cfg);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < CYF_QNR; j += 16)
            _mm512_store_ps(acc + r * CYF_QNR + j, _mm512_set1_ps(-0.0f));  /* -0 + p is p */
    for (ptrdiff_t b = 0; b < CHUNK && b < nblk; b++)
        CYF_QAMX_ISSUE_(b, cs[0][b]);
    for (ptrdiff_t c0 = 0; c0 < nblk; c0 += CHUNK) {
        const ptrdiff_t c1 = c0 + CHUNK < nblk ? c0 + CHUNK : nblk, n1 = c1 + CHUNK < nblk ? c1 + CHUNK : nblk;
        int (*cur)[CYF_AMR * CYF_QNR] = cs[(c0 / CHUNK) & 1], (*nxt)[CYF_AMR * CYF_QNR] = cs[(c0 / CHUNK + 1) & 1];
        unsigned ends = 0;  /* bit b - c0: block b ends a run, whose partial then goes into acc */
        for (ptrdiff_t b = c0; b < c1; b++)
            if ((b + 1) % bpp == 0 || b + 1 == nblk)
                ends |= 1u << (b - c0);
        const int p_in = c0 % bpp != 0, p_out = !(ends >> (c1 - 1 - c0) & 1);
        ptrdiff_t nx = c1;  /* the next chunk's block to issue */
        for (int r = 0; r < rows; r++) {
            /* a block every other row: early in the pass, not all before it */
            if (nx < n1 && 2 * (nx - c1) <= r) {
                CYF_QAMX_ISSUE_(nx, nxt[nx - c1]);
                nx++;
            }
            __m512 a0 = _mm512_load_ps(acc + r * CYF_QNR), a1 = _mm512_load_ps(acc + r * CYF_QNR + 16);
            __m512 p0 = _mm512_setzero_ps(), p1 = p0;
            if (p_in) {
                p0 = _mm512_load_ps(p + r * CYF_QNR);
                p1 = _mm512_load_ps(p + r * CYF_QNR + 16);
            }
#pragma GCC unroll 4
            for (ptrdiff_t b = c0; b < c1; b++) {
                const __m512i bs = _mm512_set1_epi32(bsum[r * nblk + b]);
                const __m512i s0 = _mm512_sub_epi32(_mm512_load_si512(cur[b - c0] + r * CYF_QNR), bs);
                const __m512i s1 = _mm512_sub_epi32(_mm512_load_si512(cur[b - c0] + r * CYF_QNR + 16), bs);
                const __m512 db = _mm512_set1_ps(d[r * nblk + b]);
                const __m512 t0 = grouped ? _mm512_mul_ps(db, _mm512_loadu_ps(sc + b * CYF_QNR)) : db;
                const __m512 t1 = grouped ? _mm512_mul_ps(db, _mm512_loadu_ps(sc + b * CYF_QNR + 16)) : db;
                p0 = _mm512_fmadd_ps(t0, _mm512_cvtepi32_ps(s0), p0);
                p1 = _mm512_fmadd_ps(t1, _mm512_cvtepi32_ps(s1), p1);
                if (ends >> (b - c0) & 1) {
                    a0 = _mm512_add_ps(a0, p0);
                    a1 = _mm512_add_ps(a1, p1);
                    p0 = p1 = _mm512_setzero_ps();
                }
            }
            _mm512_store_ps(acc + r * CYF_QNR, a0);
            _mm512_store_ps(acc + r * CYF_QNR + 16, a1);
            if (p_out) {
                _mm512_store_ps(p + r * CYF_QNR, p0);
                _mm512_store_ps(p + r * CYF_QNR + 16, p1);
            }
        }
        for (; nx < n1; nx++)  /* fewer rows than the next chunk's blocks wanted */
            CYF_QAMX_ISSUE_(nx, nxt[nx - c1]);
    }
    CYF_T_END(acc, rows * CYF_QNR)
    memcpy(c, acc, (size_t)rows * CYF_QNR * sizeof(float));
}

#undef CYF_QAMX_ISSUE_
#undef CYF_QAMX_BLOCK_
