/* The int4 [N, K] decode kernel on 256-bit vectors, included by formats.h
 * three times: CYF_D2_ names each function (its suffix), CYF_D2_ATTR its
 * target; with CYF_D2_DPBUSD (vpdpbusd on 8 lanes: AVX-VNNI, or
 * AVX512-VNNI's EVEX form for tests) each lane sums the nibbles against the
 * codes from its correction, as the 512-bit VNNI kernel; without it,
 * AVX2's vpmaddubsw + vpmaddwd.  The same int32 lanes and float steps
 * either way, so the same bits.  (int8's AVX2 kernel has no such form:
 * with vpdpbusd it read 3072 x 768 from DRAM at 12.8-14.8 GB/s on one Zen 4
 * core, in AVX512-VNNI's encoding, against 18.6-19.0 with AVX2's, while
 * int4's read the same either way.) */

/* int4 [N, K] (a row per output) with AVX2: cyf_i4q_row_dot_t's 16 lanes as
 * two ymm registers per row of x.  vpmaddubsw multiplies the unsigned
 * nibbles by the signed codes (pair sums at most 2 * 15 * 127, the even and
 * odd inputs' added in 16 bits), vpmaddwd by ones gives each lane's 8
 * products, plus its correction: the same integers and float steps as the
 * VNNI kernel, so the same bits.  The last chunk's bytes and scales are
 * copied into zeroed buffers (no masked byte loads in AVX2).  Each row of
 * W serves up to 4 rows of x. */
CYF_D2_ATTR __attribute__((always_inline))
static inline void CYF_D2_(cyf_i4q_dot_t_row_)(float *acc, ptrdiff_t ldacc, const unsigned char *w, const float *sc,
                                             ptrdiff_t ng, const unsigned char *xp, ptrdiff_t ldxp, const int MX,
                                             ptrdiff_t nch, ptrdiff_t K)
{
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    (void)ones;
    const __m256i sa = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), sb = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const ptrdiff_t nbytes = (K + 1) / 2, full = nbytes / 64;
    __m256 f[4][2];
    for (int r = 0; r < MX; r++)
        f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (ptrdiff_t c = 0; c < nch; c++) {
        const unsigned char *wc = w + c * 64;
        const float *s4 = sc + 4 * c;
        unsigned char wbuf[64];
        float sbuf[4];
        if (c >= full) {  /* the last, partial chunk */
            memset(wbuf, 0, sizeof wbuf);
            memcpy(wbuf, wc, (size_t)(nbytes - c * 64));
            sbuf[0] = sbuf[1] = sbuf[2] = sbuf[3] = 0.0f;
            memcpy(sbuf, s4, (size_t)(ng - 4 * c) * sizeof(float));
            wc = wbuf;
            s4 = sbuf;
        }
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wc), w1 = _mm256_loadu_si256((const __m256i *)(wc + 32));
        const __m256i l0 = _mm256_and_si256(w0, nib), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nib);
        const __m256i l1 = _mm256_and_si256(w1, nib), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nib);
        const __m256 sv = _mm256_castps128_ps256(_mm_loadu_ps(s4));
        const __m256 s0 = _mm256_permutevar8x32_ps(sv, sa), s1 = _mm256_permutevar8x32_ps(sv, sb);
        for (int r = 0; r < MX; r++) {
            const unsigned char *xr = xp + r * ldxp;
            const signed char *e = CYF_I4Q_QE(xr) + c * 64, *o = CYF_I4Q_QO(xr, nch) + c * 64;
            const int *k = CYF_I4Q_CORR(xr, nch) + c * 16;
            const float *d = CYF_I4Q_DL(xr, nch) + c * 16;
#ifdef CYF_D2_DPBUSD  /* the correction, then the even codes' products, then the odd ones' */
            const __m256i i0 = CYF_D2_DPBUSD(CYF_D2_DPBUSD(_mm256_loadu_si256((const __m256i *)k), l0,
                                                           _mm256_loadu_si256((const __m256i *)e)),
                                             h0, _mm256_loadu_si256((const __m256i *)o));
            const __m256i i1 = CYF_D2_DPBUSD(CYF_D2_DPBUSD(_mm256_loadu_si256((const __m256i *)(k + 8)), l1,
                                                           _mm256_loadu_si256((const __m256i *)(e + 32))),
                                             h1, _mm256_loadu_si256((const __m256i *)(o + 32)));
#else
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, _mm256_loadu_si256((const __m256i *)e)),
                                                _mm256_maddubs_epi16(h0, _mm256_loadu_si256((const __m256i *)o)));
            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, _mm256_loadu_si256((const __m256i *)(e + 32))),
                                                _mm256_maddubs_epi16(h1, _mm256_loadu_si256((const __m256i *)(o + 32))));
            const __m256i i0 = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_loadu_si256((const __m256i *)k));
            const __m256i i1 = _mm256_add_epi32(_mm256_madd_epi16(p1, ones), _mm256_loadu_si256((const __m256i *)(k + 8)));
#endif
            f[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d), s0), _mm256_cvtepi32_ps(i0), f[r][0]);
            f[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d + 8), s1), _mm256_cvtepi32_ps(i1), f[r][1]);
        }
    }
    for (int r = 0; r < MX; r++)
        acc[r * ldacc] = cyf_tree16_ps(f[r][0], f[r][1]);
}

/* dot_t of prepared rows (ldxp bytes apart), each row of W serving 4 rows of x */
CYF_D2_ATTR
static void CYF_D2_(cyf_i4q_dot_tp_rows_)(float *acc, const void *xp, ptrdiff_t ldxp, int nr, const cyf_wt *W,
                                     ptrdiff_t a, ptrdiff_t nw, ptrdiff_t K)
{
    const ptrdiff_t nch = (K + CYF_Q4C - 1) / CYF_Q4C, ng = (K + CYF_GROUP - 1) / CYF_GROUP;
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int m = nr - r0 < 4 ? nr - r0 : 4;
        const unsigned char *x0 = (const unsigned char *)xp + r0 * ldxp;
        for (ptrdiff_t j = 0; j < nw; j++) {
            const unsigned char *w = (const unsigned char *)W->data + (a + j) * W->ld;
            const float *sc = W->scale + (a + j) * ng;
            float *o = acc + r0 * nw + j;
            switch (m) {  /* a constant row count, so the sums stay in registers */
            case 4: CYF_D2_(cyf_i4q_dot_t_row_)(o, nw, w, sc, ng, x0, ldxp, 4, nch, K); break;
            case 3: CYF_D2_(cyf_i4q_dot_t_row_)(o, nw, w, sc, ng, x0, ldxp, 3, nch, K); break;
            case 2: CYF_D2_(cyf_i4q_dot_t_row_)(o, nw, w, sc, ng, x0, ldxp, 2, nch, K); break;
            default: CYF_D2_(cyf_i4q_dot_t_row_)(o, nw, w, sc, ng, x0, ldxp, 1, nch, K); break;
            }
        }
    }
}
