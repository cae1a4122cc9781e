/* The layer kernels' portable path: plain C, one value at a time -- the readable statement of their orders
 * (kernels.h); the AVX2 path runs the same operations per lane. */
#include "kernels.h"

#define P f1
#define LM static inline
#include "layer_math.h"
#undef LM
#undef P

/* ---- RMSNorm ---- */
static float sumsq(const float *x, int64_t d) {   /* 32 lanes, zero padding, reduce32 */
    float acc[32] = {0};
    for (int64_t k = 0; k < d; k++) acc[k % 32] = acc[k % 32] + x[k] * x[k];
    return reduce32(acc);   /* a padded lane would add 0 * 0: acc + 0 = acc (acc >= +0) */
}

static void rms_row(const float *x, const float *w, const float *res, float inv, int64_t d, float *out) {
    for (int64_t k = 0; k < d; k++) out[k] = res ? f1_rms_add_out(x[k], inv, w[k], res[k]) : f1_rms_out(x[k], inv, w[k]);
}

/* ---- RoPE: row t, every head ---- */
static void rope_row(const rope_job *j, int64_t t) {
    const float *c = j->cos + t * j->cos_s, *s = j->sin + t * j->sin_s;
    const int64_t half = j->rope_dim / 2;
    for (int64_t h = 0; h < j->H; h++) {
        const float *x = j->x.p + t * j->x.s0 + h * j->x.s1;
        float *o = (float *)j->out.p + t * j->out.s0 + h * j->out.s1;
        for (int64_t i = 0; i < half; i++) {
            int64_t a = j->mode ? i : 2 * i, b = j->mode ? i + half : 2 * i + 1;   /* neox : adjacent */
            f1_rot(x[a], x[b], c[a], s[a], c[b], s[b], &o[a], &o[b]);
        }
        if (o != x) memmove(o + j->rope_dim, x + j->rope_dim, (size_t)(j->hd - j->rope_dim) * sizeof(float));
    }
}

/* ---- attention: query row t, heads h0.., in the parts layer.c runs ---- */
static inline float kv_at(const void *base, int f16, int64_t i) {
    return f16 ? half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* the loops run in the order memory is laid out (the Cache's keys: positions adjacent; values: dims adjacent), the
 * chains unchanged: each score over the dims in order, each output dim over the keys in order */
static void attend_scores(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t i0, int64_t i1, float *s,
                          int64_t s_s, float *scratch) {
    const int64_t hd = j->hd, k0 = j->spans[2 * t], kvh = h0 / (j->H / j->Hkv);
    const int64_t kb = kvh * j->k_sh + k0 * j->k_sl;   /* items */
    float *qs = scratch;
    if (j->q8) {   /* the query's blocks in the tile, then each key's integer dot products */
        float *qb = scratch + 2 * nh * up8(hd);
        q8_query(j->q.p + t * j->q.s0 + h0 * j->q.s1, j->q.s1, nh, hd, j->scale, qb);
        for (int64_t h = 0; h < nh; h++)
            for (int64_t i = i0; i < i1; i++)
                s[h * s_s + i] = q8_score((const uint8_t *)j->k + kb + i * j->k_sl, qb + h * j->nb * 9,
                                          (const int8_t *)(qb + h * j->nb * 9 + j->nb), j->nb);
        return;
    }
    for (int64_t h = 0; h < nh; h++) {
        const float *q = j->q.p + t * j->q.s0 + (h0 + h) * j->q.s1;
        float *sh = s + h * s_s;
        for (int64_t d = 0; d < hd; d++) qs[d] = q[d] * j->scale;
        for (int64_t i = i0; i < i1; i++) sh[i] = 0.0f;   /* s_i = s_i + qs[d] * k_j[d] for d = 0..hd-1 */
        for (int64_t d = 0; d < hd; d++) {
            const int64_t at = kb + d * j->k_sd;
            if (!j->f16 && j->k_sl == 1)
                for (int64_t i = i0; i < i1; i++) sh[i] = sh[i] + qs[d] * ((const float *)j->k)[at + i];
            else
                for (int64_t i = i0; i < i1; i++) sh[i] = sh[i] + qs[d] * kv_at(j->k, j->f16, at + i * j->k_sl);
        }
    }
}

static void lane_max(const float *s, int64_t n, lanes8 *r) {
    for (int l = 0; l < 8; l++) r->mx[l] = -__builtin_inff(), r->nan[l] = 0;
    for (int64_t i = 0; i < n; i++) {
        r->mx[i % 8] = f1_max(r->mx[i % 8], s[i]);
        r->nan[i % 8] |= s[i] != s[i];
    }
}

static void exps(float *s, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++) s[i] = f1_exp(s[i] - m);
}

static float lane_sum(const float *p, int64_t n) {
    float lane[8] = {0};
    for (int64_t i = 0; i < n; i++) lane[i % 8] = lane[i % 8] + p[i];
    return lanes8_sum(lane);
}

static void weighted(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t d0, int64_t d1, const float *p,
                     int64_t p_s, float *scratch) {
    const int64_t k0 = j->spans[2 * t], n = j->spans[2 * t + 1] - k0, kvh = h0 / (j->H / j->Hkv);
    const int64_t vb = kvh * j->v_sh + k0 * j->v_sl;   /* items */
    float *acc = scratch + nh * up8(j->hd);
    for (int64_t h = 0; h < nh; h++) {
        const float *ph = p + h * p_s, sum = lane_sum(ph, n);
        for (int64_t d = d0; d < d1; d++) acc[d] = 0.0f;   /* acc[d] = acc[d] + p_i * v_j[d] for i = 0..n-1 */
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = vb + i * j->v_sl;
            if (j->q8)   /* acc[d] = acc[d] + (p_i * dv) * qv[d] */
                for (int64_t d = d0; d < d1; d++) {
                    const uint8_t *blk = (const uint8_t *)j->v + at + d / 32 * Q8_BYTES;
                    acc[d] = acc[d] + (ph[i] * half_to_float(rd16(blk))) * (float)(int8_t)blk[2 + d % 32];
                }
            else if (!j->f16)
                for (int64_t d = d0; d < d1; d++) acc[d] = acc[d] + ph[i] * ((const float *)j->v)[at + d];
            else
                for (int64_t d = d0; d < d1; d++) acc[d] = acc[d] + ph[i] * kv_at(j->v, 1, at + d);
        }
        float *o = j->out + t * j->out_s + (h0 + h) * j->hd;
        for (int64_t d = d0; d < d1; d++) o[d] = acc[d] / sum;   /* the division last */
    }
}

/* ---- act(a) * b, value by value ---- */

static void map_row(int act, const float *a, const float *b, int64_t n, float *out) {
    for (int64_t k = 0; k < n; k++) out[k] = b ? f1_act(act, a[k]) * b[k] : f1_act(act, a[k]);
}

static void f16_row(const float *x, int64_t xs, int64_t n, uint16_t *out, int64_t os) {
    for (int64_t i = 0; i < n; i++) out[i * os] = half_from_float(x[i * xs]);
}

const layer_ops portable_layer = {sumsq, rms_row, rope_row, attend_scores, lane_max, exps, weighted, map_row,
                                  f16_row};
