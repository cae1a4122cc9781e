/* A path is trusted only where it was checked. Before a path other than the portable one is used (core.c: at
 * import, and at use_path), it meets the portable path on a fixed battery, bit for bit: every type's product
 * (the file's rows and, for the quantized types, packed; 1 to 25 x rows, so the direct and the tiled kernels, the
 * two-group tiles and AMX's tiles of 16 half-rows run; one and two activation halves; rows that end mid-group), the
 * activations' quantizer (its bytes), and the layer kernels' row functions (sum of squares, RMSNorm's row, the activations and
 * exp, the max's lanes, the f16 rows) and attention's scores and weighted values on f32 and f16 keys. The data is
 * made here by a fixed generator (the same on every machine): random blocks with finite scales, x rows of several
 * magnitudes, a row of tiny values (all-zero blocks) and a row with a large one; and for each quantized type its
 * ends (every quant at 0 or its maximum against activations all +-127), where the int16 sums run closest to overflow.
 * Single-threaded, no pool; 292 cases, some 30-60 ms a path (AVX2 and Zen 3, November 30). */
#include "kernels.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct { uint64_t s; } rng;
static uint32_t next32(rng *r) {   /* xorshift64* */
    r->s ^= r->s >> 12; r->s ^= r->s << 25; r->s ^= r->s >> 27;
    return (uint32_t)((r->s * 0x2545F4914F6CDD1DULL) >> 32);
}
static float unit(rng *r) { return (float)((int32_t)next32(r)) * (1.0f / 2147483648.0f); }   /* [-1, 1) */
static uint16_t f16_scale(rng *r) {   /* +-[2^-8, 2^-6): a block scale of a real file's size */
    return (uint16_t)((next32(r) & 0x83ffu) | ((7u + next32(r) % 2u) << 10));
}
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* N rows of K values of type t, the file's layout: random quants, finite scales */
static void make_rows(int t, int64_t N, int64_t K, uint8_t *w, rng *r) {
    const int64_t nb = K / type_block(t), tb = type_bytes(t);
    if (is_float_type(t)) {
        for (int64_t i = 0; i < N * K; i++) {
            if (t == T_F32) { float v = unit(r); memcpy(w + 4 * i, &v, 4); }
            else if (t == T_F16) put16(w + 2 * i, (uint16_t)((next32(r) & 0x83ffu) | ((10u + next32(r) % 8u) << 10)));
            else put16(w + 2 * i, (uint16_t)((next32(r) & 0x807fu) | ((120u + next32(r) % 10u) << 7)));
        }
        return;
    }
    for (int64_t b = 0; b < N * nb; b++) {
        uint8_t *blk = w + b * tb;
        for (int64_t i = 0; i < tb; i++) blk[i] = (uint8_t)next32(r);
        if (t == T_Q6_K) put16(blk + 208, f16_scale(r));
        else put16(blk, f16_scale(r));
        if (t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K) put16(blk + 2, f16_scale(r));
    }
}

/* N rows of K values of quantized type t at their ends: row i's quant bytes all edge[i % 4] (every 4/5-bit quant 0 or
 * its maximum, Q8_0's 0, -1, -128 or 127), finite scales of either sign (the K-quants' sub-block scales and mins at 63,
 * Q6_K's at -128 or 127): with make_edge_x, the integer sums at the edge of what the kernels keep in int16 */
static void make_edge_rows(int t, int64_t N, int64_t K, uint8_t *w, rng *r) {
    static const uint8_t edge[4] = {0x00, 0xFF, 0x80, 0x7F};
    const int64_t nb = K / type_block(t), tb = type_bytes(t);
    for (int64_t i = 0; i < N; i++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = w + (i * nb + b) * tb;
            memset(blk, edge[i % 4], (size_t)tb);
            if (t == T_Q6_K) {
                for (int k = 0; k < 16; k++) blk[192 + k] = next32(r) & 1 ? 0x80 : 0x7F;
                put16(blk + 208, f16_scale(r));
                continue;
            }
            put16(blk, f16_scale(r));
            if (t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K) put16(blk + 2, f16_scale(r));
            if (t == T_Q4_K || t == T_Q5_K) memset(blk + 4, 0xFF, 12);
        }
}

/* M rows of K values +-1: every quantized activation +-127 (row m % 3: all +1, all -1, random signs) */
static void make_edge_x(int64_t M, int64_t K, float *x, rng *r) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            x[m * K + k] = m % 3 == 0 ? 1.0f : m % 3 == 1 ? -1.0f : next32(r) & 1 ? 1.0f : -1.0f;
}

/* M rows of K: magnitudes 1e-3..1e2 by row; row 3 tiny (below the quantizer's floor), row 4 one large value */
static void make_x(int64_t M, int64_t K, float *x, rng *r) {
    static const float mag[5] = {1.0f, 1e-3f, 1e2f, 1e-32f, 1.0f};
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) x[m * K + k] = mag[m % 5] * unit(r);
    if (M > 4) x[4 * K + K / 3] = 3e4f;
}

#define MAX_M 25
#define SK 512              /* values per row: 16 blocks of 32, 2 super-blocks */
#define FK 100              /* float weights: a row that ends mid-lane-block */
#define SN 24               /* weight rows: 3 groups (packed), or 21 (the file's rows: a last group of 5) */

/* a job's quantized rows made unsigned, where its path reads them (as matmul makes them); one check at a time */
static xblock32 xu_buf[2 * MAX_M * SK / 32];

static void run_mm(const kernel_path *p, mm_job *j) {
    mm_job_plan(p, j);
    if (j->xq)
        for (int64_t m = 0; m < j->M; m++)
            p->quantize_row(j->qtype, j->x + m * j->K, j->K, (char *)j->xq + j->halves * m * j->xq_row_bytes,
                            j->halves);
    j->xu = j->xq && wants_unsigned(p, j->qtype, j->M) ? xu_buf : NULL;   /* K = SK, M <= MAX_M: it fits */
    if (j->xu) made_unsigned(j->xq, j->xq_row_bytes, j->K, j->halves, (char *)xu_buf, 0, j->M);
    const int64_t n_gt = (j->n_groups + j->gstep - 1) / j->gstep;
    for (int64_t m0 = 0; m0 < j->M; m0 += j->mtile)
        for (int64_t g = 0; g < n_gt; g++)
            p->mm_task(j, g * j->gstep, m0, m0 + j->mtile < j->M ? m0 + j->mtile : j->M);
}


static const char *type_name(int t) {
    switch (t) {
    case T_F32: return "F32"; case T_F16: return "F16"; case T_BF16: return "BF16"; case T_Q4_0: return "Q4_0";
    case T_Q4_1: return "Q4_1"; case T_Q5_0: return "Q5_0"; case T_Q5_1: return "Q5_1"; case T_Q8_0: return "Q8_0";
    case T_Q4_K: return "Q4_K"; case T_Q5_K: return "Q5_K"; default: return "Q6_K";
    }
}

static int fail(char *msg, size_t n, const char *what, int t, int pk, int halves, int64_t M) {
    snprintf(msg, n, "%s differs from the portable path (%s, %s, %s, %lld x rows)", what, type_name(t),
             pk ? "packed" : "file rows", halves == 2 ? "2 halves" : "1 half", (long long)M);
    return -1;
}

/* the portable path's product of one job against p's, bit for bit (and the activations' quantized blocks) */
static int compare_mm(const kernel_path *p, mm_job j, float *o0, float *o1, char *q0, char *q1, int flip, int edge,
                      char *msg, size_t n, int *cases) {
    j.out = o0; j.xq = j.xq_row_bytes ? q0 : NULL;
    run_mm(&portable_path, &j);
    j.out = o1; j.xq = j.xq_row_bytes ? q1 : NULL;
    run_mm(p, &j);
    if (flip && *cases == 0) o1[0] = f32_from_bits(bits_from_f32(o1[0]) ^ 1u);   /* a fault, for tests */
    (*cases)++;
    const char *what = NULL;
    if (j.xq_row_bytes && memcmp(q0, q1, (size_t)(j.halves * j.M * j.xq_row_bytes)))
        what = edge ? "the activations' quantized blocks (values at their ends)" : "the activations' quantized blocks";
    else if (memcmp(o0, o1, sizeof(float) * (size_t)(j.M * j.N)))
        what = edge ? "the product (values at their ends)" : "the product";
    if (what) return fail(msg, n, what, j.qtype, j.packed, j.halves, j.M);
    return 0;
}

/* rows of w (N x K of type t) packed by groups into wp */
static void pack_rows(int t, int64_t N, int64_t K, const uint8_t *w, uint8_t *wp) {
    const int64_t rb = K / type_block(t) * type_bytes(t);
    for (int64_t g = 0; g < N / GROUP; g++) {
        const uint8_t *gr[GROUP];
        for (int i = 0; i < GROUP; i++) gr[i] = w + (g * GROUP + i) * rb;
        pack_group(t, gr, K / type_block(t), wp + g * GROUP * rb);
    }
}

static int check_products(const kernel_path *p, int flip, char *msg, size_t n, int *cases) {
    static const int types[] = {T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K, T_F32, T_F16, T_BF16};
    static const int64_t rows[] = {1, 2, 3, 4, 5, 9, 25};   /* 25: the amx path's tiles of 16 half-rows (one half
                                                                 * too), and with two halves the K-quants' passes of
                                                                 * 32 and 16 half-rows, 2 left over */
    static const int64_t edge_rows[] = {2, 17};   /* a direct kernel, and past every path's direct ones: the tiles */
    const size_t wbytes = (size_t)SN * SK * 4;   /* enough for any type */
    uint8_t *w = malloc(wbytes), *wp = malloc(wbytes);
    float *x = malloc(sizeof(float) * MAX_M * SK), *o0 = malloc(sizeof(float) * MAX_M * SN),
          *o1 = malloc(sizeof(float) * MAX_M * SN);
    const size_t xqb = (size_t)2 * MAX_M * xq_row_bytes(T_Q4_0, SK);   /* the larger of the two layouts */
    char *q0 = malloc(xqb), *q1 = malloc(xqb);
    int rc = 0;
    if (!w || !wp || !x || !o0 || !o1 || !q0 || !q1) { snprintf(msg, n, "out of memory"); rc = -1; goto done; }
    rng r = {0x9E3779B97F4A7C15ULL};
    for (size_t ti = 0; ti < sizeof types / sizeof *types && !rc; ti++) {
        const int t = types[ti], fl = is_float_type(t);
        const int64_t K = fl ? FK : SK, rb = K / type_block(t) * type_bytes(t);
        /* random values, then (quantized types) their ends */
        for (int edge = 0; edge <= !fl && !rc; edge++) {
            if (edge) make_edge_x(MAX_M, K, x, &r);
            else make_x(MAX_M, K, x, &r);
            for (int pk = 0; pk <= !fl && !rc; pk++) {
                const int64_t N = pk ? SN : SN - 3;
                if (edge) make_edge_rows(t, N, K, w, &r);
                else make_rows(t, N, K, w, &r);
                if (pk) pack_rows(t, N, K, w, wp);
                for (int halves = 1; halves <= 2 && !rc; halves++) {
                    if (fl && halves == 1) continue;
                    if (edge && halves == 2) continue;   /* the ends: one half (the second would be the residual, 0) */
                    const int64_t *ms = edge ? edge_rows : rows;
                    const size_t nm = edge ? sizeof edge_rows / sizeof *edge_rows : sizeof rows / sizeof *rows;
                    for (size_t mi = 0; mi < nm && !rc; mi++) {
                        const mm_job j = {.qtype = t, .M = ms[mi], .N = N, .K = K, .x = x, .w = pk ? wp : w,
                                          .row_bytes = rb, .ldo = N, .xq_row_bytes = xq_row_bytes(t, K),
                                          .halves = halves, .packed = pk};
                        rc = compare_mm(p, j, o0, o1, q0, q1, flip, edge, msg, n, cases);
                    }
                }
            }
        }
    }
done:
    free(w); free(wp); free(x); free(o0); free(o1); free(q0); free(q1);
    return rc;
}

/* attend's scores and weighted values of one query row: 3 heads of one kv head (a pair and one alone), hd 80 (64 + 16
 * dims), a span of 45 keys (vectors of 16, of 8, and the last 8 scored again); the keys in the Cache's layout (dim d
 * of key i at d * L + i), f32 and f16 */
static int check_attend(const layer_ops *a, char *msg, size_t n, int *cases, rng *r) {
    enum { NH = 3, HD = 80, L = 48, NK = 45 };
    static float q[NH * HD], kf[HD * L], vf[L * HD], p[NH * 48], out0[NH * HD], out1[NH * HD], s0[NH * 48],
        s1[NH * 48];
    static uint16_t kh[HD * L], vh[L * HD];
    float *scratch = (float *)malloc((size_t)attend_scratch_floats(HD, NK, NH) * sizeof(float));
    if (!scratch) { snprintf(msg, n, "no memory for attention's scratch"); return -1; }
    int rc = 0;
    const int64_t spans[2] = {1, 1 + NK};
    for (int i = 0; i < NH * HD; i++) q[i] = unit(r);
    for (int i = 0; i < HD * L; i++) {
        kf[i] = unit(r); vf[i] = unit(r);
        kh[i] = half_from_float(kf[i]); vh[i] = half_from_float(vf[i]);
    }
    for (int i = 0; i < NH * 48; i++) p[i] = 0.5f + 0.5f * unit(r);
    for (int f16 = 0; f16 < 2; f16++) {
        attend_job j = {1, NH, 1, HD, L, {q, NH * HD, HD}, f16 ? (const void *)kh : (const void *)kf,
                        f16 ? (const void *)vh : (const void *)vf, f16, 0, 0, HD * L, 1, L, L * HD, HD, spans, 0.125f,
                        out0, NH * HD};
        (*cases)++;
        portable_layer.attend_scores(&j, 0, 0, NH, 0, NK, s0, 48, scratch);
        a->attend_scores(&j, 0, 0, NH, 0, NK, s1, 48, scratch);
        for (int h = 0; h < NH && !rc; h++)
            if (memcmp(s0 + 48 * h, s1 + 48 * h, NK * sizeof(float))) rc = snprintf(msg, n, "attention's scores differ");
        if (rc) break;
        (*cases)++;
        portable_layer.weighted(&j, 0, 0, NH, 0, HD, p, 48, scratch);
        j.out = out1;
        a->weighted(&j, 0, 0, NH, 0, HD, p, 48, scratch);
        if (memcmp(out0, out1, sizeof out0)) { rc = snprintf(msg, n, "attention's weighted values differ"); break; }
    }
    free(scratch);
    return rc ? -1 : 0;
}

static int check_layer(const layer_ops *a, char *msg, size_t n, int *cases) {
    const layer_ops *b = &portable_layer;
    enum { D = 100 };
    float x[D], w[D], res[D], o0[D], o1[D], s0[D], s1[D];
    rng r = {0x2545F4914F6CDD1DULL};
    for (int i = 0; i < D; i++) { x[i] = 4.0f * unit(&r); w[i] = 1.0f + unit(&r); res[i] = unit(&r); }
    (*cases)++;
    const float ss0 = b->sumsq(x, D), ss1 = a->sumsq(x, D);
    if (bits_from_f32(ss0) != bits_from_f32(ss1)) { snprintf(msg, n, "rms_norm's sum of squares differs"); return -1; }
    const float inv = rms_inv(ss0, D, 1e-6f);
    for (int withres = 0; withres < 2; withres++) {
        (*cases)++;
        b->rms_row(x, w, withres ? res : NULL, inv, D, o0);
        a->rms_row(x, w, withres ? res : NULL, inv, D, o1);
        if (memcmp(o0, o1, sizeof o0)) { snprintf(msg, n, "rms_norm's row differs"); return -1; }
    }
    static const int acts[] = {ACT_SILU, ACT_GELU_TANH, FN_EXP, FN_TANH};
    for (int k = 0; k < 4; k++) {
        (*cases)++;
        const float *bb = acts[k] <= ACT_GELU_TANH ? res : NULL;
        b->map_row(acts[k], x, bb, D, o0);
        a->map_row(acts[k], x, bb, D, o1);
        if (memcmp(o0, o1, sizeof o0)) { snprintf(msg, n, "the elementwise function %d differs", acts[k]); return -1; }
    }
    (*cases)++;
    memcpy(s0, x, sizeof x); memcpy(s1, x, sizeof x);
    b->exps(s0, D, 3.0f);
    a->exps(s1, D, 3.0f);
    if (memcmp(s0, s1, sizeof s0)) { snprintf(msg, n, "attention's exps differ"); return -1; }
    (*cases)++;
    lanes8 l0, l1;
    memset(&l0, 0, sizeof l0); memset(&l1, 0, sizeof l1);
    b->lane_max(x, D, &l0);
    a->lane_max(x, D, &l1);
    if (memcmp(&l0, &l1, sizeof l0)) { snprintf(msg, n, "attention's max lanes differ"); return -1; }
    /* f16 keys and values: ties, subnormals, overflow, a NaN with a payload; contiguous and strided */
    static const uint32_t edge[] = {0x3f801000u, 0x3f803000u, 0x33800000u, 0x387fc000u, 0x477ff000u, 0x477fefffu,
                                    0x7fa00000u, 0xffc12345u, 0xff800000u, 0x00000001u};
    for (int i = 0; i < 10; i++) x[7 * i + 3] = f32_from_bits(edge[i]);
    uint16_t h0[D], h1[D];
    for (int xs = 1; xs <= 3; xs += 2) {   /* the rows a pass writes (out contiguous), a step's keys (out strided) */
        (*cases)++;
        memset(h0, 0, sizeof h0); memset(h1, 0, sizeof h1);
        b->f16_row(x, xs, D / 3, h0, 4 - xs);
        a->f16_row(x, xs, D / 3, h1, 4 - xs);
        if (memcmp(h0, h1, sizeof h0)) { snprintf(msg, n, "the f16 conversion differs"); return -1; }
    }
    return check_attend(a, msg, n, cases, &r);
}

int path_selftest(const kernel_path *p, int flip, char *msg, size_t n, int *cases) {
    *cases = 0;
    msg[0] = 0;
    if (check_products(p, flip, msg, n, cases)) return -1;
    return check_layer(p->layer, msg, n, cases);
}
