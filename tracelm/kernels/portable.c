/* The portable path: plain C, one output at a time. It is the readable statement of the fixed order (see
 * kernels.h); the AVX2 path computes the same integers and runs the same float operations per lane. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

/* ---- activations: d = amax/127, q = nearbyintf(x/d) per block of n values ---- */
static void quantize_block(const float *x, int n, float *d_out, int8_t *q) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        uint32_t a = bits_from_f32(x[i]) & 0x7fffffffu;
        if (a >= 0x7f800000u) finite = 0;
        float fa = f32_from_bits(a);
        if (fa > amax) amax = fa;
    }
    if (!finite || amax < TINY_AMAX) {
        *d_out = finite ? 0.0f : NAN;
        memset(q, 0, (size_t)n);
        return;
    }
    float d = amax / 127.0f, id = 1.0f / d;
    for (int i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * id);
        int iv = (int)v;
        q[i] = (int8_t)(iv > 127 ? 127 : iv < -127 ? -127 : iv);
    }
    *d_out = d;
}

/* one block of n values -> its hi block (d, q) and its lo block (the same quantizer on r = x - d*q) */
static void quantize_split(const float *x, int n, float *dh, int8_t *qh, float *dl, int8_t *ql) {
    float r[256];
    quantize_block(x, n, dh, qh);
    for (int i = 0; i < n; i++) r[i] = x[i] - *dh * (float)qh[i];
    quantize_block(r, n, dl, ql);
}

/* one block of n values -> hi (, lo), as `halves` asks */
static void quantize_halves(const float *x, int n, int halves, float *dh, int8_t *qh, float *dl, int8_t *ql) {
    if (halves == 2) quantize_split(x, n, dh, qh, dl, ql);
    else quantize_block(x, n, dh, qh);
}

static void quantize_row(int qtype, const float *x, int64_t K, void *xq, int halves) {
    if (type_block(qtype) == 32) {
        xblock32 *row = (xblock32 *)xq;   /* hi row, then (two halves) lo row */
        for (int64_t i = 0; i < K / 32; i++) {
            xblock32 *h = row + i, *l = row + K / 32 + i;
            quantize_halves(x + 32 * i, 32, halves, &h->d, h->q, &l->d, l->q);
            for (int k = 0; k < halves; k++) {
                xblock32 *b = k ? l : h;
                int32_t s = 0;
                for (int j = 0; j < 32; j++) s += b->q[j];
                b->sum = s;
            }
        }
    } else {
        xblock256 *row = (xblock256 *)xq;
        for (int64_t i = 0; i < K / 256; i++) {
            xblock256 *h = row + i, *l = row + K / 256 + i;
            quantize_halves(x + 256 * i, 256, halves, &h->d, h->q, &l->d, l->q);
            for (int k = 0; k < halves; k++) {
                xblock256 *b = k ? l : h;
                memset(b->pad, 0, sizeof b->pad);
                for (int g = 0; g < 16; g++) {
                    int s = 0;
                    for (int j = 0; j < 16; j++) s += b->q[16 * g + j];
                    b->bsum[g] = (int16_t)s;
                }
                for (int j = 0; j < 8; j++) b->bsum32[j] = (int16_t)(b->bsum[2 * j] + b->bsum[2 * j + 1]);
            }
        }
    }
}

/* ---- weight values as integers, element e of a block (the GGUF layouts) ---- */
static inline int q4(const uint8_t *qs, int e) { return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; }
static inline int q5(const uint8_t *qs, uint32_t qh, int e) { return q4(qs, e) | (int)(((qh >> e) & 1) << 4); }

/* one weight row (nb blocks) . one quantized x row, added block by block to acc (0, or the sum of the blocks before). Element j of a block is in the low nibble of qs[j], element
 * j + 16 in the high one; the loops pair them so they stay simple for the compiler. */
static float dot_q32(int t, const uint8_t *w, const xblock32 *x, int64_t nb, float acc) {
    const int tb = type_bytes(t);
    for (int64_t b = 0; b < nb; b++, x++) {
        const uint8_t *blk = w + tb * b;
        const int8_t *q = x->q;
        int32_t isum = 0;
        float d = half_to_float(rd16(blk));
        switch (t) {
        case T_Q4_0:
            for (int j = 0; j < 16; j++) isum += ((blk[2 + j] & 15) - 8) * q[j] + ((blk[2 + j] >> 4) - 8) * q[j + 16];
            COMBINE_D(f1, acc, d, x->d, isum);
            break;
        case T_Q4_1: {
            for (int j = 0; j < 16; j++) isum += (blk[4 + j] & 15) * q[j] + (blk[4 + j] >> 4) * q[j + 16];
            float m = half_to_float(rd16(blk + 2));
            COMBINE_DM(f1, acc, d, m, x->d, isum, x->sum);
            break;
        }
        case T_Q5_0: {
            uint32_t qh = rd32(blk + 2);
            for (int j = 0; j < 16; j++)
                isum += (((blk[6 + j] & 15) | (int)((qh >> j) & 1) << 4) - 16) * q[j] +
                        (((blk[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) - 16) * q[j + 16];
            COMBINE_D(f1, acc, d, x->d, isum);
            break;
        }
        case T_Q5_1: {
            uint32_t qh = rd32(blk + 4);
            for (int j = 0; j < 16; j++)
                isum += ((blk[8 + j] & 15) | (int)((qh >> j) & 1) << 4) * q[j] +
                        ((blk[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) * q[j + 16];
            float m = half_to_float(rd16(blk + 2));
            COMBINE_DM(f1, acc, d, m, x->d, isum, x->sum);
            break;
        }
        case T_Q8_0:
            for (int j = 0; j < 32; j++) isum += (int8_t)blk[2 + j] * q[j];
            COMBINE_D(f1, acc, d, x->d, isum);
            break;
        }
    }
    return acc;
}

/* K-quants: element e (0..255) of a super-block */
static inline int q4k(const uint8_t *qs, int e) {
    int c = e / 64, l = e % 32;
    return (e % 64) < 32 ? qs[32 * c + l] & 15 : qs[32 * c + l] >> 4;
}
static inline int q6k(const uint8_t *ql, const uint8_t *qh, int e) {
    int h = e / 128, p = e % 128, l = p % 32, s = p / 32;
    int lo = (ql[64 * h + p % 64] >> (4 * (p / 64))) & 15;
    int hi = (qh[32 * h + l] >> (2 * s)) & 3;
    return lo | (hi << 4);
}

/* K-quants, following the byte layout: Q4_K/Q5_K qs[32c + l] holds elements 64c + l (low nibble, sub-block 2c)
 * and 64c + 32 + l (high, 2c + 1), bit 2c / 2c + 1 of qh[l] their fifth bit; Q6_K, per half h of 128, ql[64h + l]
 * and ql[64h + 32 + l] hold the low 4 bits of elements l, l + 32 (low nibbles), l + 64, l + 96 (high), qh[32h + l]
 * their top 2 bits (bits 0-1, 2-3, 4-5, 6-7). */
static float dot_qk(int t, const uint8_t *w, const xblock256 *x, int64_t nb, float acc) {
    const int tb = type_bytes(t);
    for (int64_t b = 0; b < nb; b++, x++) {
        const uint8_t *blk = w + tb * b;
        const int8_t *q = x->q;
        if (t == T_Q6_K) {
            const uint8_t *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            int32_t s16[16] = {0}, A = 0;
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    int e = 128 * h + l, i = 8 * h + l / 16, hb = qh[32 * h + l];
                    s16[i] += ((ql[64 * h + l] & 15) | (hb & 3) << 4) * q[e];
                    s16[i + 2] += ((ql[64 * h + 32 + l] & 15) | ((hb >> 2) & 3) << 4) * q[e + 32];
                    s16[i + 4] += ((ql[64 * h + l] >> 4) | ((hb >> 4) & 3) << 4) * q[e + 64];
                    s16[i + 6] += ((ql[64 * h + 32 + l] >> 4) | ((hb >> 6) & 3) << 4) * q[e + 96];
                }
            for (int i = 0; i < 16; i++) A += sc[i] * (s16[i] - 32 * x->bsum[i]);   /* (q - 32) . x */
            float d = half_to_float(rd16(blk + 208));
            COMBINE_D(f1, acc, d, x->d, A);
        } else {
            const uint8_t *qh = blk + 16, *qs = blk + (t == T_Q4_K ? 16 : 48);
            uint8_t sc[8], mn[8];
            kscales(blk + 4, sc, mn);
            int32_t A = 0, B = 0;
            for (int c = 0; c < 4; c++) {
                int32_t lo = 0, hi = 0;
                for (int l = 0; l < 32; l++) {
                    int ql = qs[32 * c + l] & 15, qhi = qs[32 * c + l] >> 4;
                    if (t == T_Q5_K) {
                        ql |= ((qh[l] >> (2 * c)) & 1) << 4;
                        qhi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    lo += ql * q[64 * c + l];
                    hi += qhi * q[64 * c + 32 + l];
                }
                A += sc[2 * c] * lo + sc[2 * c + 1] * hi;
            }
            for (int j = 0; j < 8; j++) B += mn[j] * x->bsum32[j];
            float d = half_to_float(rd16(blk)), dmin = half_to_float(rd16(blk + 2));
            COMBINE_K(f1, acc, d, dmin, x->d, A, B);
        }
    }
    return acc;
}

/* F32 / F16 / BF16 weights: 32 lanes, zero padding, reduce32 */
static inline float wval(int t, const uint8_t *w, int64_t k) {
    if (t == T_F32) { float f; memcpy(&f, w + 4 * k, 4); return f; }
    uint16_t h = rd16(w + 2 * k);
    return t == T_F16 ? half_to_float(h) : bf16_to_float(h);
}

static float dot_f(int t, const uint8_t *w, const float *x, int64_t K) {
    float acc[32] = {0};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        for (int l = 0; l < 32; l++) acc[l] = acc[l] + wval(t, w, k + l) * x[k + l];
    if (k < K) {
        float wt[32] = {0}, xt[32] = {0};
        for (int l = 0; k + l < K; l++) { wt[l] = wval(t, w, k + l); xt[l] = x[k + l]; }
        for (int l = 0; l < 32; l++) acc[l] = acc[l] + wt[l] * xt[l];
    }
    return reduce32(acc);
}

#define MAX_TB 210   /* the largest block: Q6_K's */

/* x row m's quantized half (0: hi, 1: lo) */
static const char *xhalf(const mm_job *j, int64_t m, int half) {
    return (const char *)j->xq + (j->halves * m + half) * j->xq_row_bytes;
}

/* Blocks b0..b0+nb of weight row w (its block 0 at w) . x row m's half, added to acc */
static float dot_blocks(const mm_job *j, const uint8_t *w, int64_t m, int half, int64_t b0, int64_t nb, float acc) {
    int t = j->qtype;
    return type_block(t) == 32 ? dot_q32(t, w, (const xblock32 *)xhalf(j, m, half) + b0, nb, acc)
                               : dot_qk(t, w, (const xblock256 *)xhalf(j, m, half) + b0, nb, acc);
}

/* out = acc_hi + acc_lo: the two halves' sums, each from 0 (kernels.h) */
static void mm_group_rows(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    int t = j->qtype;
    int64_t n0 = group * GROUP, n1 = (group + 1) * GROUP < j->N ? (group + 1) * GROUP : j->N;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->w + n * j->row_bytes;
        for (int64_t m = m0; m < m1; m++) {
            float r;
            if (is_float_type(t)) {
                r = dot_f(t, w, j->x + m * j->K, j->K);
            } else {
                int64_t nb = j->K / type_block(t);
                r = dot_blocks(j, w, m, 0, 0, nb, 0.0f);
                if (j->halves == 2) {
                    float acc_lo = dot_blocks(j, w, m, 1, 0, nb, 0.0f);
                    r = r + acc_lo;
                }
            }
            j->out[m * j->ldo + n] = r;
        }
    }
}

/* A packed group (quantized types only: `packable`): back to the file's layout CHUNK blocks at a time, into a
 * buffer on the stack (no allocation in a kernel), each (row, x row, half) sum carried from chunk to chunk --
 * the blocks in the same order, so the same numbers as mm_group_rows. */
#define CHUNK 16
#define SUB 16
static void mm_group_packed(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    int t = j->qtype;
    const int64_t tb = type_bytes(t), nb = j->K / type_block(t);
    const uint8_t *base = j->w + group * GROUP * j->row_bytes;
    uint8_t buf[GROUP * CHUNK * MAX_TB], *rows[GROUP];
    float acc[2][SUB][GROUP];
    for (int r = 0; r < GROUP; r++) rows[r] = buf + r * CHUNK * tb;
    for (int64_t s0 = m0; s0 < m1; s0 += SUB) {   /* x rows SUB at a time: their sums fit on the stack */
        int64_t s1 = s0 + SUB < m1 ? s0 + SUB : m1;
        memset(acc, 0, sizeof acc);
        for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
            int64_t c = nb - b0 < CHUNK ? nb - b0 : CHUNK;
            unpack_group(t, base + b0 * GROUP * tb, c, rows);
            for (int r = 0; r < GROUP && group * GROUP + r < j->N; r++)
                for (int64_t m = s0; m < s1; m++)
                    for (int h = 0; h < j->halves; h++)
                        acc[h][m - s0][r] = dot_blocks(j, rows[r], m, h, b0, c, acc[h][m - s0][r]);
        }
        for (int r = 0; r < GROUP && group * GROUP + r < j->N; r++)
            for (int64_t m = s0; m < s1; m++)
                j->out[m * j->ldo + group * GROUP + r] = j->halves == 2 ? acc[0][m - s0][r] + acc[1][m - s0][r]
                                                                         : acc[0][m - s0][r];
    }
}

static void mm_group(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    (j->packed ? mm_group_packed : mm_group_rows)(j, group, m0, m1);
}

static void mm_task(const mm_job *j, int64_t g0, int64_t m0, int64_t m1) {   /* groups g0.. (gstep of them) */
    for (int64_t g = g0; g < g0 + j->gstep && g < j->n_groups; g++) mm_group(j, g, m0, m1);
}

static int task_groups(int qtype, int64_t rows) { (void)qtype; (void)rows; return 1; }

const kernel_path portable_path = {"portable", quantize_row, mm_task, task_groups, &portable_layer, 0, 0, 0};

/* ---- dequantization, the same float operations as gguf.quants ---- */
void dequantize_rows(int t, const uint8_t *w, int64_t row_bytes, int64_t K, float *out, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        float *y = out + r * K;
        if (is_float_type(t)) {
            for (int64_t k = 0; k < K; k++) y[k] = wval(t, row, k);
            continue;
        }
        int bs = type_block(t), tb = type_bytes(t);
        for (int64_t b = 0; b < K / bs; b++, y += bs) {
            const uint8_t *blk = row + b * tb;
            switch (t) {
            case T_Q4_0: {
                float d = half_to_float(rd16(blk));
                for (int e = 0; e < 32; e++) y[e] = d * (float)(q4(blk + 2, e) - 8);
                break;
            }
            case T_Q4_1: {
                float d = half_to_float(rd16(blk)), m = half_to_float(rd16(blk + 2));
                for (int e = 0; e < 32; e++) y[e] = d * (float)q4(blk + 4, e) + m;
                break;
            }
            case T_Q5_0: {
                float d = half_to_float(rd16(blk));
                uint32_t qh = rd32(blk + 2);
                for (int e = 0; e < 32; e++) y[e] = d * (float)(q5(blk + 6, qh, e) - 16);
                break;
            }
            case T_Q5_1: {
                float d = half_to_float(rd16(blk)), m = half_to_float(rd16(blk + 2));
                uint32_t qh = rd32(blk + 4);
                for (int e = 0; e < 32; e++) y[e] = d * (float)q5(blk + 8, qh, e) + m;
                break;
            }
            case T_Q8_0: {
                float d = half_to_float(rd16(blk));
                for (int e = 0; e < 32; e++) y[e] = (float)(int8_t)blk[2 + e] * d;
                break;
            }
            case T_Q4_K: case T_Q5_K: {
                const uint8_t *qh = blk + 16, *qs = blk + (t == T_Q4_K ? 16 : 48);
                uint8_t sc[8], mn[8];
                kscales(blk + 4, sc, mn);
                float d = half_to_float(rd16(blk)), dmin = half_to_float(rd16(blk + 2));
                for (int e = 0; e < 256; e++) {
                    int j = e / 32, q = q4k(qs, e);
                    if (t == T_Q5_K) q |= ((qh[e % 32] >> j) & 1) << 4;
                    float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
                    y[e] = ds * (float)q - dm;
                }
                break;
            }
            case T_Q6_K: {
                float d = half_to_float(rd16(blk + 208));
                const int8_t *sc = (const int8_t *)(blk + 192);
                for (int e = 0; e < 256; e++) y[e] = (d * (float)sc[e / 16]) * (float)(q6k(blk, blk + 128, e) - 32);
                break;
            }
            }
        }
    }
}

/* ---- packed weights (x8, kernels.h): where byte i of row r's block goes in the group's block ----
 * The block's fields in the file's order, each at 8 times its offset in the file's block, the 8 rows' units
 * side by side: f16 values (d, m, dmin) in units of 2 bytes, Q8_0's quants in one unit of 32, the rest in dwords.
 * f16 fields: the first 2 bytes (4 for Q4_1, Q5_1, Q4_K, Q5_K: d, m / dmin), and Q6_K's d, its last 2. */
static int packed_pos(int t, int r, int i) {
    const int head = t == T_Q6_K ? 0 : t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K ? 4 : 2;
    const int tail = t == T_Q6_K ? 208 : type_bytes(t);   /* f16 from here on */
    const int f0 = i < head ? 0 : i < tail ? head : tail;  /* where byte i's run of units starts */
    const int u = f0 == head ? (t == T_Q8_0 ? 32 : 4) : 2;
    return 8 * f0 + 8 * u * ((i - f0) / u) + u * r + (i - f0) % u;
}

/* Q5_0 / Q5_1 packed: qh's bits spread by quad, bit 8b + c = the file's bit 4c + b (kernels.h), and back, a byte
 * at a time through two tables: byte k of qh (quads 2k, 2k + 1) spreads to spread8[v] << 2k; byte b of the spread
 * dword (one bit of each quad) gathers to gather8[v] << b */
static uint32_t spread8[256], gather8[256];
__attribute__((constructor)) static void qh_tables(void) {
    for (uint32_t v = 0; v < 256; v++) {
        spread8[v] = gather8[v] = 0;
        for (int b = 0; b < 4; b++) spread8[v] |= ((v >> b) & 1u) << (8 * b) | ((v >> (b + 4)) & 1u) << (8 * b + 1);
        for (int c = 0; c < 8; c++) gather8[v] |= ((v >> c) & 1u) << (4 * c);
    }
}
static uint32_t qh_spread(uint32_t h) {
    uint32_t s = 0;
    for (int k = 0; k < 4; k++) s |= spread8[(h >> (8 * k)) & 255u] << (2 * k);
    return s;
}
static uint32_t qh_gather(uint32_t s) {
    uint32_t h = 0;
    for (int b = 0; b < 4; b++) h |= gather8[(s >> (8 * b)) & 255u] << b;
    return h;
}
static void wr32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }

/* Q6_K packed: the three bytes of 4 values (kernels.h) -- the file's a = ql[64h + l] (low nibble: value 128h + l,
 * high: + 64), b = ql[64h + 32 + l] (values + 32, + 96), c = qh[32h + l] (their top 2 bits, 2 each) -- regrouped
 * in place: a = value l's 6 bits | top bits of l + 64 << 6, b = l + 32's | top bits of l + 96 << 6, c = the low
 * nibbles of l + 64 | l + 96 << 4; and back */
static void q6_regroup(uint8_t *a, uint8_t *b, uint8_t *c) {
    const uint8_t A = *a, B = *b, C = *c;
    *a = (uint8_t)((A & 15) | (C & 0x03) << 4 | (C & 0x30) << 2);
    *b = (uint8_t)((B & 15) | (C & 0x0c) << 2 | (C & 0xc0));
    *c = (uint8_t)((A >> 4) | (B & 0xf0));
}
static void q6_ungroup(uint8_t *a, uint8_t *b, uint8_t *c) {
    const uint8_t A = *a, B = *b, C = *c;
    *a = (uint8_t)((A & 15) | (C & 15) << 4);
    *b = (uint8_t)((B & 15) | (C & 0xf0));
    *c = (uint8_t)((A >> 4 & 3) | (B >> 4 & 3) << 2 | (A >> 6) << 4 | (B >> 6) << 6);
}
/* a row's 64 triples of a Q6_K block, at the places pos gives them (the file's block: pos NULL) */
static void q6_triples(uint8_t *blk, const int *pos, void (*f)(uint8_t *, uint8_t *, uint8_t *)) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const int i = 64 * h + l, j = i + 32, k = 128 + 32 * h + l;
            f(blk + (pos ? pos[i] : i), blk + (pos ? pos[j] : j), blk + (pos ? pos[k] : k));
        }
}

/* packed_pos of every byte of a block of the 8 rows (a table: the loops below run over millions of blocks); qh_at:
 * where a row's qh starts in the file's block (Q5_0, Q5_1; -1: the type has none) */
static int qh_at(int t) { return t == T_Q5_0 ? 2 : t == T_Q5_1 ? 4 : -1; }
static void packed_table(int t, int pos[8][MAX_TB]) {
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < type_bytes(t); i++) pos[r][i] = packed_pos(t, r, i);
}

void pack_group(int t, const uint8_t *const rows[8], int64_t nb, uint8_t *out) {
    const int tb = type_bytes(t);
    const int at = qh_at(t);
    int pos[8][MAX_TB];
    packed_table(t, pos);
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            uint8_t *blk = out + b * 8 * tb;
            for (int i = 0; i < tb; i++) blk[pos[r][i]] = rows[r][b * tb + i];
            if (at >= 0) wr32(blk + pos[r][at], qh_spread(rd32(blk + pos[r][at])));
            if (t == T_Q6_K) q6_triples(blk, pos[r], q6_regroup);
        }
}

void unpack_group(int t, const uint8_t *group, int64_t nb, uint8_t *const rows[8]) {
    const int tb = type_bytes(t);
    const int at = qh_at(t);
    int pos[8][MAX_TB];
    packed_table(t, pos);
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 8; r++) {
            const uint8_t *blk = group + b * 8 * tb;
            for (int i = 0; i < tb; i++) rows[r][b * tb + i] = blk[pos[r][i]];
            if (at >= 0) wr32(rows[r] + b * tb + at, qh_gather(rd32(blk + pos[r][at])));
            if (t == T_Q6_K) q6_triples(rows[r] + b * tb, NULL, q6_ungroup);
        }
}
