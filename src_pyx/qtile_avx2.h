/* The integer GEMM's 256-bit tile, included by qgemm.h three times:
 * CYF_Q2_TILE_ names it, CYF_Q2_ATTR its target; with CYF_Q2_DPBUSD
 * (vpdpbusd on 8 lanes: AVX-VNNI's VEX form, or AVX512-VNNI's EVEX one
 * with AVX512VL, the same instruction) each block sums w + 128 against the
 * codes from -bsum, as the 512-bit VNNI tile does; without it, AVX2's
 * vpmaddubsw + vpmaddwd on |w| and the codes with w's sign give the block
 * sums outright.  The same int32 either way, and the same float steps. */

CYF_Q2_ATTR
static inline void CYF_Q2_TILE_(float *c, const signed char *q, const float *d, const int *bsum, int rows,
                                   const unsigned char *strip, ptrdiff_t nblk, int bpp, int grouped)
{
    const ptrdiff_t Kp = nblk * CYF_QB;
    const float *sc = (const float *)(strip + Kp * CYF_QNR);
    const signed char *qr[CYF_QMR];
    const float *dr[CYF_QMR];
    const int *br[CYF_QMR];
    cyf_qtile_rows_(q, d, bsum, rows, nblk, qr, dr, br);
    float acc[CYF_QMR * CYF_QNR] __attribute__((aligned(32)));
#ifndef CYF_Q2_DPBUSD
    (void)br;  /* the block sums come out whole: no correction */
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
#endif
    for (int j0 = 0; j0 < CYF_QNR; j0 += 8) {
        __m256 a[CYF_QMR];
#pragma GCC unroll 6
        for (int r = 0; r < CYF_QMR; r++)
            a[r] = _mm256_set1_ps(-0.0f);  /* -0 + p is p: the first partial as it is */
        for (ptrdiff_t b0 = 0; b0 < nblk; b0 += bpp) {
            const ptrdiff_t b1 = b0 + bpp < nblk ? b0 + bpp : nblk;
            __m256 p[CYF_QMR];
#pragma GCC unroll 6
            for (int r = 0; r < CYF_QMR; r++)
                p[r] = _mm256_setzero_ps();
            for (ptrdiff_t b = b0; b < b1; b++) {
                __m256i s[CYF_QMR];
                const unsigned char *w = strip + b * CYF_QB * CYF_QNR + 4 * j0;
#ifdef CYF_Q2_DPBUSD
#pragma GCC unroll 6
                for (int r = 0; r < CYF_QMR; r++)
                    s[r] = _mm256_set1_epi32(-br[r][b]);
#pragma GCC unroll 8
                for (int g = 0; g < CYF_QB / 4; g++) {
                    const __m256i wu = _mm256_loadu_si256((const __m256i *)(w + g * 4 * CYF_QNR));
#pragma GCC unroll 6
                    for (int r = 0; r < CYF_QMR; r++) {
                        int v;
                        memcpy(&v, qr[r] + b * CYF_QB + 4 * g, 4);
                        s[r] = CYF_Q2_DPBUSD(s[r], wu, _mm256_set1_epi32(v));
                    }
                }
#else
#pragma GCC unroll 6
                for (int r = 0; r < CYF_QMR; r++)
                    s[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < CYF_QB / 4; g++) {
                    const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + g * 4 * CYF_QNR)), flip);
                    const __m256i wa = _mm256_abs_epi8(ws);
#pragma GCC unroll 6
                    for (int r = 0; r < CYF_QMR; r++) {
                        int v;
                        memcpy(&v, qr[r] + b * CYF_QB + 4 * g, 4);
                        const __m256i qs = _mm256_sign_epi8(_mm256_set1_epi32(v), ws);
                        /* int4 and q4_0 (grouped 1): |w| <= 8, so the block's 8 pair sums per
                         * 16-bit lane add to at most 8 * 2 * 8 * 127 < 2^15: one vpmaddwd per
                         * block; int8 and q8_0 (grouped 0, 2) widen every step */
                        s[r] = grouped == 1
                                   ? _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wa, qs))
                                   : _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, qs), ones));
                    }
                }
                if (grouped == 1) {
#pragma GCC unroll 6
                    for (int r = 0; r < CYF_QMR; r++)
                        s[r] = _mm256_madd_epi16(s[r], ones);
                }
#endif
                const __m256 s0 = grouped ? _mm256_loadu_ps(sc + b * CYF_QNR + j0) : _mm256_setzero_ps();
#pragma GCC unroll 6
                for (int r = 0; r < CYF_QMR; r++) {
                    const __m256 db = _mm256_set1_ps(dr[r][b]);
                    p[r] = _mm256_fmadd_ps(grouped ? _mm256_mul_ps(db, s0) : db, _mm256_cvtepi32_ps(s[r]), p[r]);
                }
            }
#pragma GCC unroll 6
            for (int r = 0; r < CYF_QMR; r++)
                a[r] = _mm256_add_ps(a[r], p[r]);
        }
#pragma GCC unroll 6
        for (int r = 0; r < CYF_QMR; r++)
            _mm256_store_ps(acc + r * CYF_QNR + j0, a[r]);
    }
    memcpy(c, acc, (size_t)rows * CYF_QNR * sizeof(float));
}

