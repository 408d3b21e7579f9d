/* AMX tiles: the tile configuration, and a C model of the tile instructions
 * the GEMMs use (ldtilecfg, tilezero, tileloadd, tilestored, tdpbsud,
 * tdpbf16ps), written from the instruction set reference's pseudocode, but
 * for tdpbf16ps's sums: those are fitted to the hardware's outputs.
 *
 * The AMX tiles (qtile_amx.h, btile_amx.h) are written once against the
 * CYF_T_* names and compiled twice: with the instructions (CPUs with AMX)
 * and with this model, which any AVX-512 CPU runs, so each tile's layout,
 * configuration and arithmetic are tested bit for bit where there is no
 * AMX.  The model
 * also checks what the hardware faults on (a bad palette, shapes that do
 * not chain) and flags it, so a configuration error fails a test instead of
 * waiting for a machine that has the instructions. */
#ifndef CYFORMER_AMX_H
#define CYFORMER_AMX_H

#include <string.h>

/* ldtilecfg's 64-byte operand, palette 1: 8 tiles of at most 16 rows of 64 bytes */
typedef struct cyf_tilecfg {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} cyf_tilecfg;
_Static_assert(sizeof(cyf_tilecfg) == 64, "ldtilecfg reads 64 bytes");

/* The GEMM tiles' shapes: 0 and 1 the sums (rows x 16 dwords), 2 the rows
 * of x (rows x k4 dwords), 3 and 4 a strip's two halves of 16 outputs (k4
 * rows of 16 dwords): a product of k4 dwords of inputs per step.  5, 6 and
 * 7 are 0, 1 and 2 again: a second set, so that a software-pipelined tile
 * can start one product before the previous one's sums are stored. */
static inline void cyf_amx_gemm_cfg(cyf_tilecfg *cfg, int rows, int k4)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int s = 0; s < 2; s++) {
        const int t = 5 * s;  /* the set's first sum tile */
        cfg->rows[t] = cfg->rows[t + 1] = cfg->rows[t + 2] = (unsigned char)rows;
        cfg->colsb[t] = cfg->colsb[t + 1] = 64;
        cfg->colsb[t + 2] = (unsigned short)(4 * k4);
    }
    cfg->rows[3] = cfg->rows[4] = (unsigned char)k4;
    cfg->colsb[3] = cfg->colsb[4] = 64;
}

typedef struct cyf_amx_model {
    cyf_tilecfg cfg;
    int bad;  /* something the hardware would fault on */
    unsigned char t[8][16][64];
} cyf_amx_model;

static inline int cyf_amx_model_tile_ok(const cyf_amx_model *m, int t)
{
    return t >= 0 && t < 8 && m->cfg.rows[t] > 0 && m->cfg.rows[t] <= 16 && m->cfg.colsb[t] > 0
           && m->cfg.colsb[t] <= 64;
}

/* ldtilecfg: checks palette 1's limits; every tile starts zeroed */
static inline void cyf_amx_model_cfg(cyf_amx_model *m, const cyf_tilecfg *c)
{
    m->cfg = *c;
    m->bad = c->palette != 1 || c->start_row != 0;
    for (int i = 0; i < 14; i++)
        m->bad |= c->reserved[i] != 0;
    for (int t = 0; t < 16; t++) {
        const int unused = c->rows[t] == 0 && c->colsb[t] == 0;
        m->bad |= t >= 8 ? !unused : !unused && !cyf_amx_model_tile_ok(m, t);
    }
    memset(m->t, 0, sizeof m->t);
}

static inline void cyf_amx_model_zero(cyf_amx_model *m, int t)
{
    m->bad |= !cyf_amx_model_tile_ok(m, t);
    if (t >= 0 && t < 8)
        memset(m->t[t], 0, sizeof m->t[t]);
}

/* tileloadd: rows x colsb bytes, stride bytes apart; the rest of the tile zeroed */
static inline void cyf_amx_model_load(cyf_amx_model *m, int t, const void *base, ptrdiff_t stride)
{
    if (!cyf_amx_model_tile_ok(m, t)) {
        m->bad = 1;
        return;
    }
    memset(m->t[t], 0, sizeof m->t[t]);
    for (int r = 0; r < m->cfg.rows[t]; r++)
        memcpy(m->t[t][r], (const unsigned char *)base + r * stride, m->cfg.colsb[t]);
}

static inline void cyf_amx_model_store(cyf_amx_model *m, int t, void *base, ptrdiff_t stride)
{
    if (!cyf_amx_model_tile_ok(m, t)) {
        m->bad = 1;
        return;
    }
    for (int r = 0; r < m->cfg.rows[t]; r++)
        memcpy((unsigned char *)base + r * stride, m->t[t][r], m->cfg.colsb[t]);
}

/* A product's tiles: three distinct configured tiles whose shapes chain (a
 * and c the same rows, a's dwords b's rows, b and c the same columns);
 * flags a fault otherwise. */
static inline int cyf_amx_model_chain_ok(cyf_amx_model *m, int c, int a, int b)
{
    const int ok = cyf_amx_model_tile_ok(m, c) && cyf_amx_model_tile_ok(m, a) && cyf_amx_model_tile_ok(m, b)
                   && c != a && c != b && a != b && m->cfg.rows[c] == m->cfg.rows[a] && m->cfg.colsb[a] % 4 == 0
                   && m->cfg.colsb[a] / 4 == m->cfg.rows[b] && m->cfg.colsb[c] == m->cfg.colsb[b]
                   && m->cfg.colsb[c] % 4 == 0;
    m->bad |= !ok;
    return ok;
}

/* tdpbsud c += a (signed bytes) . b (unsigned bytes): for each row i of c
 * and dword j, the dot products of a's row i, 4 bytes at a time, with the
 * dwords j of b's rows, added in 32 bits. */
static inline void cyf_amx_model_dpbsud(cyf_amx_model *m, int c, int a, int b)
{
    if (!cyf_amx_model_chain_ok(m, c, a, b))
        return;
    for (int i = 0; i < m->cfg.rows[c]; i++)
        for (int k = 0; k < m->cfg.colsb[a] / 4; k++)
            for (int j = 0; j < m->cfg.colsb[c] / 4; j++) {
                unsigned int s;
                memcpy(&s, &m->t[c][i][4 * j], 4);
                for (int e = 0; e < 4; e++)
                    s += (unsigned int)((int)(signed char)m->t[a][i][4 * k + e] * (int)m->t[b][k][4 * j + e]);
                memcpy(&m->t[c][i][4 * j], &s, 4);
            }
}

/* bf16 -> float32 with a denormal read as zero (of its sign) */
static inline float cyf_amx_model_bf16(const unsigned char *p)
{
    unsigned int u = (unsigned int)p[0] | (unsigned int)p[1] << 8;
    if ((u & 0x7F80u) == 0)
        u &= 0x8000u;
    u <<= 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 denormals as zero (of their sign): inputs read so, results flushed so */
static inline float cyf_amx_model_ftz(float v)
{
    unsigned int u;
    memcpy(&u, &v, 4);
    if ((u & 0x7F800000u) == 0)
        u &= 0x80000000u;
    memcpy(&v, &u, 4);
    return v;
}

/* c + a * b rounded once (nearest even), a denormal result flushed to zero */
static inline float cyf_amx_model_fma_ftz(float a, float b, float c)
{
    return cyf_amx_model_ftz(__builtin_fmaf(a, b, c));
}

/* tdpbf16ps c += a . b on bf16 pairs, as a Sapphire Rapids-class Xeon sums them (fitted
 * bit for bit to its outputs; the reference's pseudocode, one running sum
 * taking each pair's two products in turn, is not what it does).  For each
 * row i of c and dword j, two float32 chains run from +0 over a's dwords k
 * in order: one sums the even products, one the odd ones, each product
 * added with one rounding (fused) and the chain flushed to zero if denormal;
 * then c + (even + odd), each addition rounded once, c read with denormals
 * as zero and the results flushed.  bf16 inputs: denormals read as zero. */
static inline void cyf_amx_model_dpbf16ps(cyf_amx_model *m, int c, int a, int b)
{
    if (!cyf_amx_model_chain_ok(m, c, a, b))
        return;
    for (int i = 0; i < m->cfg.rows[c]; i++)
        for (int j = 0; j < m->cfg.colsb[c] / 4; j++) {
            float chain[2] = {0.0f, 0.0f}, s;
            for (int k = 0; k < m->cfg.colsb[a] / 4; k++)
                for (int e = 0; e < 2; e++)
                    chain[e] = cyf_amx_model_fma_ftz(cyf_amx_model_bf16(&m->t[a][i][4 * k + 2 * e]),
                                                     cyf_amx_model_bf16(&m->t[b][k][4 * j + 2 * e]), chain[e]);
            memcpy(&s, &m->t[c][i][4 * j], 4);
            s = cyf_amx_model_fma_ftz(1.0f, cyf_amx_model_ftz(s), cyf_amx_model_fma_ftz(1.0f, chain[0], chain[1]));
            memcpy(&m->t[c][i][4 * j], &s, 4);
        }
}

/* One full-shape tdpbf16ps on the model, c [16][16] += a [16][32] . b [16][32]
 * (bf16 codes; b's row k holds the pairs of the 16 outputs): the test hook
 * that pins the model to outputs recorded on hardware. */
static inline void cyf_amx_model_tdpbf16ps_16(float *c, const unsigned short *a, const unsigned short *b)
{
    cyf_amx_model m;
    cyf_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    cyf_amx_model_cfg(&m, &cfg);
    cyf_amx_model_load(&m, 0, c, 64);
    cyf_amx_model_load(&m, 1, a, 64);
    cyf_amx_model_load(&m, 2, b, 64);
    cyf_amx_model_dpbf16ps(&m, 0, 1, 2);
    cyf_amx_model_store(&m, 0, c, 64);
}

#endif
