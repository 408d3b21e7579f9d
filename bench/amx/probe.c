/* AMX on the hardware: tdpbf16ps on recorded cases (cases.py writes them and
 * checks amx.h's model against what this writes), and the cost of the integer
 * tile's steps (ns per step, one core).
 *
 *     gcc -O2 -mavx512f -mavx512bw -mamx-tile -mamx-int8 -mamx-bf16 -o probe bench/amx/probe.c
 *     ./probe cases.bin out.bin      # the cases, then the step costs
 *     ./probe                        # the step costs only */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct { unsigned char palette, start_row, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; } cfg_t;
#define CFG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const cfg_t *)(c)) : "memory")
#define ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::: "memory")
#define LOAD(t, b, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(b), "r"((long)(s)) : "memory")
#define STORE(t, b, s) __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(b), "r"((long)(s)) : "memory")
#define DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define DPBF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define RELEASE() __asm__ volatile("tilerelease" ::: "memory")

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void setcfg(cfg_t *c, int rows_c, int colsb_a, int rows_b)
{   /* tiles 0,1,5,6: sums rows_c x 64; 2,7: a rows_c x colsb_a; 3,4: b rows_b x 64 */
    memset(c, 0, sizeof *c); c->palette = 1;
    int cs[8] = {0, 1, 5, 6};
    for (int i = 0; i < 4; i++) { c->rows[cs[i]] = rows_c; c->colsb[cs[i]] = 64; }
    c->rows[2] = c->rows[7] = rows_c; c->colsb[2] = c->colsb[7] = colsb_a;
    c->rows[3] = c->rows[4] = rows_b; c->colsb[3] = c->colsb[4] = 64;
}

static int bf16_cases(const char *in, const char *out)
{
    FILE *f = fopen(in, "rb"); if (!f) { perror(in); return 1; }
    fseek(f, 0, SEEK_END); long n = ftell(f) / 3072; fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(n * 3072); if (fread(buf, 3072, n, f) != (size_t)n) return 1; fclose(f);
    float *res = malloc(n * 1024);
    cfg_t c __attribute__((aligned(64))); memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 3; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    CFG(&c);
    for (long i = 0; i < n; i++) {
        unsigned char *a = buf + i * 3072, *b = a + 1024, *cc = a + 2048;
        LOAD(0, cc, 64); LOAD(1, a, 64); LOAD(2, b, 64);
        DPBF16(0, 1, 2);
        STORE(0, res + i * 256, 64);
    }
    RELEASE();
    f = fopen(out, "wb"); fwrite(res, 1024, n, f); fclose(f);
    printf("bf16 cases: %ld\n", n);
    return 0;
}

static unsigned char X[32 * 4096] __attribute__((aligned(64)));
static unsigned char W[4096 * 64] __attribute__((aligned(64)));
static int CS[8][16 * 32] __attribute__((aligned(64)));

int main(int argc, char **argv)
{
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX permission\n"); return 1; }
    if (argc > 2 && bf16_cases(argv[1], argv[2])) return 1;
    for (size_t i = 0; i < sizeof X; i++) X[i] = (unsigned char)(i * 7 + 3);
    for (size_t i = 0; i < sizeof W; i++) W[i] = (unsigned char)(i * 13 + 1);
    cfg_t c __attribute__((aligned(64)));
    const int K = 768, nblk = K / 32, REP = 20000;
    double t0, t;
    volatile float sink = 0;
    /* M1: ldtilecfg + tilerelease */
    setcfg(&c, 16, 32, 8);
    t0 = now(); for (int r = 0; r < REP; r++) { CFG(&c); ZERO(0); RELEASE(); } t = now() - t0;
    printf("M1 ldtilecfg+tilezero+tilerelease: %.1f ns\n", t / REP * 1e9);
    /* M2: the tile's block pattern (16 rows x 32 outputs, K=32 per block), no epilogue */
    CFG(&c);
    t0 = now();
    for (int r = 0; r < REP; r++)
        for (int b = 0; b < nblk; b++) {
            const unsigned char *w = W + b * 32 * 32;
            ZERO(0); ZERO(1); LOAD(2, X + b * 32, K); LOAD(3, w, 128); LOAD(4, w + 64, 128);
            DPBSUD(0, 2, 3); DPBSUD(1, 2, 4); STORE(0, CS[b & 3], 128); STORE(1, CS[b & 3] + 16, 128);
        }
    t = now() - t0; printf("M2 block (zero,load3,dp2,store2) 16x32x32: %.1f ns/block\n", t / REP / nblk * 1e9);
    /* M3: M2 + the epilogue's reads (convert and fma per row) every 4 blocks */
    t0 = now();
    for (int r = 0; r < REP; r++) {
        __m512 p0 = _mm512_setzero_ps(), p1 = p0;
        for (int b0 = 0; b0 < nblk; b0 += 4) {
            for (int b = b0; b < b0 + 4; b++) {
                const unsigned char *w = W + b * 32 * 32;
                ZERO(0); ZERO(1); LOAD(2, X + b * 32, K); LOAD(3, w, 128); LOAD(4, w + 64, 128);
                DPBSUD(0, 2, 3); DPBSUD(1, 2, 4); STORE(0, CS[b & 3], 128); STORE(1, CS[b & 3] + 16, 128);
            }
            for (int row = 0; row < 16; row++)
                for (int b = b0; b < b0 + 4; b++) {
                    __m512i s0 = _mm512_sub_epi32(_mm512_load_si512(CS[b & 3] + row * 32), _mm512_set1_epi32(b));
                    __m512i s1 = _mm512_sub_epi32(_mm512_load_si512(CS[b & 3] + row * 32 + 16), _mm512_set1_epi32(b));
                    p0 = _mm512_fmadd_ps(_mm512_set1_ps(1.5f), _mm512_cvtepi32_ps(s0), p0);
                    p1 = _mm512_fmadd_ps(_mm512_set1_ps(1.5f), _mm512_cvtepi32_ps(s1), p1);
                }
        }
        sink += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    }
    t = now() - t0; printf("M3 block + epilogue: %.1f ns/block\n", t / REP / nblk * 1e9);
    /* M4: 2x2: 32 rows x 32 outputs per block: sums 0,1,5,6; rows 2,7; strip halves 3,4 */
    t0 = now();
    for (int r = 0; r < REP / 2; r++)
        for (int b = 0; b < nblk; b++) {
            const unsigned char *w = W + b * 32 * 32;
            ZERO(0); ZERO(1); ZERO(5); ZERO(6);
            LOAD(2, X + b * 32, K); LOAD(7, X + 16 * K + b * 32, K); LOAD(3, w, 128); LOAD(4, w + 64, 128);
            DPBSUD(0, 2, 3); DPBSUD(1, 2, 4); DPBSUD(5, 7, 3); DPBSUD(6, 7, 4);
            STORE(0, CS[b & 3], 128); STORE(1, CS[b & 3] + 16, 128);
            STORE(5, CS[4 + (b & 3)], 128); STORE(6, CS[4 + (b & 3)] + 16, 128);
        }
    t = now() - t0; printf("M4 2x2 block 32x32x32: %.1f ns/block (per 16 rows: %.1f)\n", t / (REP / 2) / nblk * 1e9, t / (REP / 2) / nblk * 1e9 / 2);
    /* M5: dp throughput, 4 independent sums, K=32 bytes */
    t0 = now();
    for (int r = 0; r < REP * 4; r++) { DPBSUD(0, 2, 3); DPBSUD(1, 2, 4); DPBSUD(5, 7, 3); DPBSUD(6, 7, 4); }
    t = now() - t0; printf("M5 tdpbsud 16x16x8 dwords, 4 chains: %.2f ns each\n", t / (REP * 16) * 1e9);
    /* M6: one chain */
    t0 = now();
    for (int r = 0; r < REP * 4; r++) { DPBSUD(0, 2, 3); DPBSUD(0, 2, 4); DPBSUD(0, 7, 3); DPBSUD(0, 7, 4); }
    t = now() - t0; printf("M6 tdpbsud one chain: %.2f ns each\n", t / (REP * 16) * 1e9);
    /* M7: store then reload latency: store 2 tiles and read one value */
    t0 = now();
    for (int r = 0; r < REP * 4; r++) { STORE(0, CS[0], 128); sink += (float)CS[0][r & 255]; LOAD(0, CS[0], 128); }
    t = now() - t0; printf("M7 store/scalar read/load round trip: %.1f ns\n", t / (REP * 4) * 1e9);
    /* M8: K=64 full tiles, 16x32 outputs, 12 blocks of 64 */
    setcfg(&c, 16, 64, 16); CFG(&c);
    t0 = now();
    for (int r = 0; r < REP; r++)
        for (int b = 0; b < K / 64; b++) {
            const unsigned char *w = W + b * 64 * 32;
            ZERO(0); ZERO(1); LOAD(2, X + b * 64, K); LOAD(3, w, 128); LOAD(4, w + 64, 128);
            DPBSUD(0, 2, 3); DPBSUD(1, 2, 4); STORE(0, CS[b & 3], 128); STORE(1, CS[b & 3] + 16, 128);
        }
    t = now() - t0; printf("M8 block K=64 (zero,load3,dp2,store2): %.1f ns/block\n", t / REP / (K / 64) * 1e9);
    /* M9: K=64, sums kept in tiles over K (no store per block) */
    t0 = now();
    for (int r = 0; r < REP; r++) {
        ZERO(0); ZERO(1);
        for (int b = 0; b < K / 64; b++) {
            const unsigned char *w = W + b * 64 * 32;
            LOAD(2, X + b * 64, K); LOAD(3, w, 128); LOAD(4, w + 64, 128);
            DPBSUD(0, 2, 3); DPBSUD(1, 2, 4);
        }
        STORE(0, CS[0], 128); STORE(1, CS[0] + 16, 128);
    }
    t = now() - t0; printf("M9 K=64 sums in tiles: %.1f ns/block\n", t / REP / (K / 64) * 1e9);
    RELEASE();
    printf("sink %g\n", (double)sink);
    return 0;
}
