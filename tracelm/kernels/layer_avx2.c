/* The layer kernels' AVX2 path: 8 lanes, the operations of layer_portable.c per lane (target avx2,f16c, no fma).
 * layer_avx512.c compiles it again for the 512-bit paths (LAYER_512): there attend's streamed scores take 16 keys a
 * vector (then 8) and its weighted values 64 dims of two heads (or one) at a time, 16 a vector -- the same chains.
 *
 *  - elementwise (RMSNorm's output, RoPE, the activations): 8 values at a time through layer_math.h's v8_*
 *    functions, the tail through its f1_* ones -- the same operations either way;
 *  - rms_norm's ss: the 32 lanes as 4 vectors, the tail padded with zeros, reduce32's tree;
 *  - attend: a task is the query heads of one kv head (or a part of them), so each key and value is read once for
 *    all of them. Scores: one key per lane, each its own chain over the dims as in the portable loop; keys whose
 *    positions are adjacent (the Cache's layout, [Hkv, hd, n] transposed) are streamed in place, a few rows at a
 *    time, the partial scores kept in memory between rows, the last n % 8 keys as the 8 that end the span (read
 *    masked when the span is shorter); other layouts are first copied into a tile [hd][32] (8 x 8 transposes when
 *    the dims are adjacent). The max and the sum over the span in 8 lanes (vector i / 8 holds keys i..i+7; a
 *    partial last vector on the lanes stored to memory). The weighted sum of values 32 dims of two heads (or 64,
 *    32, 8 of one) at a time, one chain per dim over the keys, in blocks of keys that meet every head while in L1.
 *    A span of 512 keys or more streams from memory, and a decode step's keys and values are cold at any span: then
 *    the key rows 8 dims on (past the last dim, the next block's first) and the values 64 positions on are
 *    prefetched. Each part takes a range (of keys, of dims) for
 *    layer.c's phases.
 *    q8_0 keys and values (kv_cache q8_0): scores 8 keys a vector, each block's integer dot products by
 *    maddubs/madd/hadd (exact), then the float steps; values 16 dims at a time, each key's int8 converted once in
 *    registers for up to 4 heads; both prefetch the positions ahead (the Cache's rows stream from memory). */
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#ifndef LAYER_512
#define LAYER_512 0
#endif
#if LAYER_512   /* layer_avx512.c */
#define LTARGET "avx2,f16c,avx512f"
#define LAYER_SYM avx512_layer
#else
#define LTARGET "avx2,f16c"
#define LAYER_SYM avx2_layer
#endif
#define AVX2 __attribute__((target(LTARGET)))
#define INL static inline __attribute__((always_inline, target(LTARGET)))

#define P f1
#define LM static inline
#include "layer_math.h"
#undef LM
#undef P

#define v8_t __m256
#define v8_i __m256i
#define v8_c(k) _mm256_set1_ps(k)
#define v8_ic(k) _mm256_set1_epi32(k)
#define v8_add(a, b) _mm256_add_ps(a, b)
#define v8_sub(a, b) _mm256_sub_ps(a, b)
#define v8_mul(a, b) _mm256_mul_ps(a, b)
#define v8_div(a, b) _mm256_div_ps(a, b)
#define v8_min(a, b) _mm256_min_ps(a, b)
#define v8_max(a, b) _mm256_max_ps(a, b)
#define v8_ibits(a) _mm256_castps_si256(a)
#define v8_fbits(i) _mm256_castsi256_ps(i)
#define v8_iadd(a, b) _mm256_add_epi32(a, b)
#define v8_isub(a, b) _mm256_sub_epi32(a, b)
#define v8_sra1(a) _mm256_srai_epi32(a, 1)
#define v8_shl23(a) _mm256_slli_epi32(a, 23)
#define SIGN _mm256_set1_ps(-0.0f)
#define v8_neg(a) _mm256_xor_ps(a, SIGN)
#define v8_abs(a) _mm256_andnot_ps(SIGN, a)
#define v8_orsign(a, b) _mm256_or_ps(a, _mm256_and_ps(b, SIGN))

#define P v8
#define LM INL
#include "layer_math.h"
#undef LM
#undef P

#define LD(p) _mm256_loadu_ps(p)
#define ST(p, v) _mm256_storeu_ps(p, v)

#if LAYER_512   /* the same math on 16 lanes (AVX-512 F: the sign bit by integer ops) */
#define v16_t __m512
#define v16_i __m512i
#define v16_c(k) _mm512_set1_ps(k)
#define v16_ic(k) _mm512_set1_epi32(k)
#define v16_add(a, b) _mm512_add_ps(a, b)
#define v16_sub(a, b) _mm512_sub_ps(a, b)
#define v16_mul(a, b) _mm512_mul_ps(a, b)
#define v16_div(a, b) _mm512_div_ps(a, b)
#define v16_min(a, b) _mm512_min_ps(a, b)
#define v16_max(a, b) _mm512_max_ps(a, b)
#define v16_ibits(a) _mm512_castps_si512(a)
#define v16_fbits(i) _mm512_castsi512_ps(i)
#define v16_iadd(a, b) _mm512_add_epi32(a, b)
#define v16_isub(a, b) _mm512_sub_epi32(a, b)
#define v16_sra1(a) _mm512_srai_epi32(a, 1)
#define v16_shl23(a) _mm512_slli_epi32(a, 23)
#define SIGN16 _mm512_set1_epi32((int)0x80000000u)
#define v16_neg(a) v16_fbits(_mm512_xor_si512(v16_ibits(a), SIGN16))
#define v16_abs(a) v16_fbits(_mm512_andnot_si512(SIGN16, v16_ibits(a)))
#define v16_orsign(a, b) v16_fbits(_mm512_or_si512(v16_ibits(a), _mm512_and_si512(v16_ibits(b), SIGN16)))
#define P v16
#define LM INL
#include "layer_math.h"
#undef LM
#undef P
#define LD16(p) _mm512_loadu_ps(p)
#define ST16(p, v) _mm512_storeu_ps(p, v)
#endif
INL __m256 ldh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }   /* 8 f16 */

/* ======================================================================================================
 * RMSNorm
 * ==================================================================================================== */
INL float reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {   /* = reduce32 (lanes 8i.. in a_i) */
    __m256 u = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

AVX2 static float sumsq(const float *x, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define SQ(p)                                                                                                 \
    {                                                                                                         \
        __m256 v0 = LD(p), v1 = LD((p) + 8), v2 = LD((p) + 16), v3 = LD((p) + 24);                            \
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));                                                        \
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));                                                        \
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(v2, v2));                                                        \
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(v3, v3));                                                        \
    }
    int64_t k = 0;
    for (; k + 32 <= d; k += 32) SQ(x + k)
    if (k < d) {
        float t[32] = {0};
        memcpy(t, x + k, (size_t)(d - k) * sizeof(float));
        SQ(t)
    }
#undef SQ
    return reduce4(a0, a1, a2, a3);
}

AVX2 static void rms_row(const float *x, const float *w, const float *res, float inv, int64_t d, float *out) {
    const __m256 vi = _mm256_set1_ps(inv);
    int64_t k = 0;
    if (res)
        for (; k + 8 <= d; k += 8) ST(out + k, v8_rms_add_out(LD(x + k), vi, LD(w + k), LD(res + k)));
    else
        for (; k + 8 <= d; k += 8) ST(out + k, v8_rms_out(LD(x + k), vi, LD(w + k)));
    for (; k < d; k++) out[k] = res ? f1_rms_add_out(x[k], inv, w[k], res[k]) : f1_rms_out(x[k], inv, w[k]);
}

/* ======================================================================================================
 * RoPE
 * ==================================================================================================== */
AVX2 static void rope_row(const rope_job *j, int64_t t) {
    const float *c = j->cos + t * j->cos_s, *s = j->sin + t * j->sin_s;
    const int64_t half = j->rope_dim / 2;
    /* adjacent pairs: partner = the pair swapped, the first of each pair negated -- v8_rot's operations */
    const __m256 neg_even = _mm256_setr_ps(-0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f);
    for (int64_t h = 0; h < j->H; h++) {
        const float *x = j->x.p + t * j->x.s0 + h * j->x.s1;
        float *o = (float *)j->out.p + t * j->out.s0 + h * j->out.s1;
        int64_t i = 0;
        if (j->mode == 0) {
            for (; 2 * i + 8 <= j->rope_dim; i += 4) {
                __m256 v = LD(x + 2 * i), partner = _mm256_xor_ps(_mm256_permute_ps(v, 0xb1), neg_even);
                ST(o + 2 * i, _mm256_add_ps(_mm256_mul_ps(v, LD(c + 2 * i)), _mm256_mul_ps(partner, LD(s + 2 * i))));
            }
            for (; i < half; i++)
                f1_rot(x[2 * i], x[2 * i + 1], c[2 * i], s[2 * i], c[2 * i + 1], s[2 * i + 1], &o[2 * i], &o[2 * i + 1]);
        } else {
            for (; i + 8 <= half; i += 8) {
                __m256 a, b;
                v8_rot(LD(x + i), LD(x + half + i), LD(c + i), LD(s + i), LD(c + half + i), LD(s + half + i), &a, &b);
                ST(o + i, a);
                ST(o + half + i, b);
            }
            for (; i < half; i++) f1_rot(x[i], x[half + i], c[i], s[i], c[half + i], s[half + i], &o[i], &o[half + i]);
        }
        if (o != x) memmove(o + j->rope_dim, x + j->rope_dim, (size_t)(j->hd - j->rope_dim) * sizeof(float));
    }
}

/* ======================================================================================================
 * attention: one task = nh query heads of one kv head; every key and value is read once for all of them
 * ==================================================================================================== */
/* Keys whose positions are adjacent (dim d of keys i.. is the row base + d * ld, the Cache's layout): blocks of
 * SB keys; in a block, 4 dims at a time stream their rows side by side (the block's scores in L1), met by two
 * heads at a time whose 4 q values wait in registers: s = s + qs[d] * k[d] for the 4 dims in order, s kept in
 * memory between groups of dims -- one chain per key and head over d = 0..hd-1 from 0, as ever. */
#define SB 256
#define STREAM_KEYS 512   /* a span this long streams from memory: prefetch (shorter ones: measured, it costs) */
/* A part of this many query rows or fewer is a decode step (or a draft's check): its keys and values are cold, a
 * whole pass of weights having gone through the caches since the step before, so they are prefetched at any span
 * (measured, `tracelm bench server --streams 1,8`, SmolLM2: 4-10 % more tok/s at 1 stream, 5 % at 8) */
#define COLD_ROWS 8
#define PF_DIMS 8   /* key rows prefetched ahead (measured at 2000 keys, with PV_AHEAD 16 -> 64: ~10 % less time) */
/* keys i.. of the block, W a vector (P: the _mm256 or _mm512 ops, V their type), the 4 dims' rows at r: one chain
 * per key, s = s + q[d] k[d] in order, head a's q values in registers A0..A3 and its scores at sa, head b's (sb NULL:
 * none) likewise */
#define CHAIN4(P, a, q0, q1, q2, q3)                                                                          \
    a = P##_add_ps(a, P##_mul_ps(q0, k0));                                                                    \
    a = P##_add_ps(a, P##_mul_ps(q1, k1));                                                                    \
    a = P##_add_ps(a, P##_mul_ps(q2, k2));                                                                    \
    a = P##_add_ps(a, P##_mul_ps(q3, k3));
#define KEY_LOOP(W, V, P, LOADK, A, B)                                                                        \
    for (; i + W <= nb; i += W) {                                                                             \
        const V k0 = LOADK(r + i), k1 = LOADK(r + ld + i), k2 = LOADK(r + 2 * ld + i), k3 = LOADK(r + 3 * ld + i); \
        V x = P##_loadu_ps(sa + i);                                                                           \
        CHAIN4(P, x, A##0, A##1, A##2, A##3)                                                                  \
        P##_storeu_ps(sa + i, x);                                                                             \
        if (sb) {                                                                                             \
            V y = P##_loadu_ps(sb + i);                                                                       \
            CHAIN4(P, y, B##0, B##1, B##2, B##3)                                                              \
            P##_storeu_ps(sb + i, y);                                                                         \
        }                                                                                                     \
    }
#if LAYER_512
INL __m512 ldh16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }   /* 16 f16 */
/* STREAM_SCORES' keys i.. 16 at a time (then 8) */
#define KEYS16(LOAD16)                                                                                        \
    {                                                                                                         \
        const __m512 A0 = _mm512_set1_ps(qa[0]), A1 = _mm512_set1_ps(qa[1]), A2 = _mm512_set1_ps(qa[2]),     \
                     A3 = _mm512_set1_ps(qa[3]);                                                              \
        const __m512 B0 = _mm512_set1_ps(qb[0]), B1 = _mm512_set1_ps(qb[1]), B2 = _mm512_set1_ps(qb[2]),     \
                     B3 = _mm512_set1_ps(qb[3]);                                                              \
        KEY_LOOP(16, __m512, _mm512, LOAD16, A, B)                                                            \
    }
#else
#define KEYS16(LOAD16)
#endif
#define STREAM_SCORES(T, LOAD, LOAD16)                                                                        \
    INL void stream_scores_##T(const float *qs, int64_t qs_s, int64_t nh, int64_t hd, const T *base, int64_t ld, \
                               int64_t n, float *s, int64_t s_s, int pf) {                                    \
        for (int64_t b = 0; b < n; b += SB) {                                                                 \
            const int64_t nb = n - b < SB ? n - b : SB;                                                       \
            for (int64_t h = 0; h < nh; h++) memset(s + h * s_s + b, 0, (size_t)nb * sizeof(float));          \
            int64_t d = 0;                                                                                    \
            for (; d + 4 <= hd; d += 4) {                                                                     \
                const T *r = base + d * ld + b;                                                               \
                /* the 4 rows PF_DIMS dims on (past the last dim, the next block's first): a stream from memory */ \
                const int64_t pd = d + PF_DIMS < hd ? d + PF_DIMS : d + PF_DIMS - hd, pb = d + PF_DIMS < hd ? b : b + SB; \
                const int64_t np = pf && pd + 4 <= hd ? (n - pb < SB ? n - pb : SB) : 0;                      \
                for (int64_t c = 0; c < np * (int64_t)sizeof(T); c += 64)                                     \
                    for (int e = 0; e < 4; e++) _mm_prefetch((const char *)(base + (pd + e) * ld + pb) + c, _MM_HINT_T0); \
                for (int64_t h = 0; h < nh; h += 2) {                                                         \
                    const float *qa = qs + h * qs_s + d, *qb = h + 1 < nh ? qa + qs_s : qa;                   \
                    const __m256 a0 = _mm256_set1_ps(qa[0]), a1 = _mm256_set1_ps(qa[1]),                     \
                                 a2 = _mm256_set1_ps(qa[2]), a3 = _mm256_set1_ps(qa[3]);                      \
                    const __m256 b0 = _mm256_set1_ps(qb[0]), b1 = _mm256_set1_ps(qb[1]),                     \
                                 b2 = _mm256_set1_ps(qb[2]), b3 = _mm256_set1_ps(qb[3]);                      \
                    float *sa = s + h * s_s + b, *sb = h + 1 < nh ? sa + s_s : NULL;                          \
                    int64_t i = 0;                                                                            \
                    KEYS16(LOAD16)                                                                            \
                    KEY_LOOP(8, __m256, _mm256, LOAD, a, b)   /* nb: a multiple of 8 */                       \
                }                                                                                             \
            }                                                                                                 \
            for (; d < hd; d++) {                                                                             \
                const T *r = base + d * ld + b;                                                               \
                for (int64_t h = 0; h < nh; h++) {                                                            \
                    const __m256 q = _mm256_set1_ps(qs[h * qs_s + d]);                                        \
                    float *sp = s + h * s_s + b;                                                              \
                    for (int64_t i = 0; i < nb; i += 8)                                                       \
                        ST(sp + i, _mm256_add_ps(LD(sp + i), _mm256_mul_ps(q, LOAD(r + i))));                 \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
STREAM_SCORES(float, LD, LD16)
STREAM_SCORES(uint16_t, ldh, ldh16)
#undef STREAM_SCORES
#undef KEYS16
#undef KEY_LOOP
#undef CHAIN4

/* the last nt < 8 adjacent keys (base: their row at dim 0): each row's nt values read alone (masked), s at the
 * keys' place in each head's scores (which have room for 8) */
INL void tail_scores(const attend_job *j, const float *qs, int64_t qs_s, int64_t nh, const void *base, int64_t nt,
                     float *s, int64_t s_s) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t h = 0; h < nh; h++) ST(s + h * s_s, _mm256_setzero_ps());
    for (int64_t d = 0; d < j->hd; d++) {
        __m256 k;
        if (j->f16) {
            uint16_t t[8] = {0};
            memcpy(t, (const uint16_t *)base + d * j->k_sd, (size_t)nt * sizeof(uint16_t));
            k = ldh(t);
        } else {
            k = _mm256_maskload_ps((const float *)base + d * j->k_sd, mask);
        }
        for (int64_t h = 0; h < nh; h++) {
            float *sp = s + h * s_s;
            ST(sp, _mm256_add_ps(LD(sp), _mm256_mul_ps(_mm256_set1_ps(qs[h * qs_s + d]), k)));
        }
    }
}

/* the scores of the first 32 (or 8: one = 1) keys of a tile (dim d of key c at tile[d * ATT_TILE + c]): one chain
 * per key */
INL void tile_scores(const float *qs, int64_t hd, const float *tile, int one, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < hd; d++, tile += ATT_TILE) {
        const __m256 q = _mm256_broadcast_ss(qs + d);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(q, LD(tile)));
        if (one) continue;
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(q, LD(tile + 8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(q, LD(tile + 16)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(q, LD(tile + 24)));
    }
    ST(s, a0); ST(s + 8, a1); ST(s + 16, a2); ST(s + 24, a3);
}

/* 8 rows r0..r7 (key c's dims d0..d0+7) -> 8 columns at tile[d * ATT_TILE + c0]: dim d of keys c0..c0+7 */
INL void transpose8_store(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6, __m256 r7,
                          float *tile) {
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);   /* dims 0|4, 1|5 */
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);   /* dims 2|6, 3|7 */
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    ST(tile + 0 * ATT_TILE, _mm256_permute2f128_ps(u0, u4, 0x20));
    ST(tile + 1 * ATT_TILE, _mm256_permute2f128_ps(u1, u5, 0x20));
    ST(tile + 2 * ATT_TILE, _mm256_permute2f128_ps(u2, u6, 0x20));
    ST(tile + 3 * ATT_TILE, _mm256_permute2f128_ps(u3, u7, 0x20));
    ST(tile + 4 * ATT_TILE, _mm256_permute2f128_ps(u0, u4, 0x31));
    ST(tile + 5 * ATT_TILE, _mm256_permute2f128_ps(u1, u5, 0x31));
    ST(tile + 6 * ATT_TILE, _mm256_permute2f128_ps(u2, u6, 0x31));
    ST(tile + 7 * ATT_TILE, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* keys k..k+nk-1 (nk <= 32) of the kv head at kb (items) -> tile[d * ATT_TILE + c] as f32, columns nk.. up to a
 * tile_scores reads (8 or 32) zero */
INL void pack_keys(const attend_job *j, int64_t kb, int64_t k, int64_t nk, float *tile) {
    const int64_t hd = j->hd, sl = j->k_sl;
    int64_t c = 0;
    if (j->k_sd == 1 && hd % 8 == 0) {   /* dims adjacent: 8 keys x 8 dims at a time */
        for (; c + 8 <= nk; c += 8)
            for (int64_t d = 0; d < hd; d += 8) {
                const int64_t e = kb + (k + c) * sl + d;
#define R(r) (j->f16 ? ldh((const uint16_t *)j->k + e + (r) * sl) : LD((const float *)j->k + e + (r) * sl))
                transpose8_store(R(0), R(1), R(2), R(3), R(4), R(5), R(6), R(7), tile + d * ATT_TILE + c);
#undef R
            }
    }
    for (int64_t d = 0; d < hd; d++) {
        float *row = tile + d * ATT_TILE;
        const int64_t e = kb + k * sl + d * j->k_sd;
        for (int64_t cc = c; cc < nk; cc++)
            row[cc] = j->f16 ? half_to_float(((const uint16_t *)j->k)[e + cc * sl]) : ((const float *)j->k)[e + cc * sl];
        for (int64_t cc = nk; cc < (nk <= 8 ? 8 : ATT_TILE); cc++) row[cc] = 0.0f;
    }
}

/* s[h][i] = qs[h] . key k0 + i: adjacent positions streamed in place, other layouts through tiles */
INL void scores(const attend_job *j, int64_t kvh, int64_t k0, int64_t n, int64_t nh, const float *qs, float *tile,
                float *s, int64_t s_s, int pf) {
    const int64_t hd = j->hd, kb = kvh * j->k_sh, qs_s = up8(hd);
    if (j->k_sl == 1) {   /* positions adjacent: streamed in place */
        const int64_t nv = n / 8 * 8;
#define STREAM(o, m) (j->f16 ? stream_scores_uint16_t(qs, qs_s, nh, hd, (const uint16_t *)j->k + kb + k0 + (o), j->k_sd, m, \
                                                      s + (o), s_s, pf)                                                   \
                             : stream_scores_float(qs, qs_s, nh, hd, (const float *)j->k + kb + k0 + (o), j->k_sd, m,     \
                                                   s + (o), s_s, pf))
        STREAM(0, nv);
        /* the last n % 8 keys: the 8 keys that end the span (the first of them scored again, to the same bits) */
        if (nv < n && n >= 8) STREAM(n - 8, 8);
        else if (nv < n)
            tail_scores(j, qs, qs_s, nh, (const char *)j->k + (kb + k0 + nv) * (j->f16 ? 2 : 4), n - nv, s + nv, s_s);
#undef STREAM
        return;
    }
    for (int64_t i = 0; i < n; i += ATT_TILE) {
        const int64_t nk = n - i < ATT_TILE ? n - i : ATT_TILE;
        float st[ATT_TILE];
        pack_keys(j, kb, k0 + i, nk, tile);
        for (int64_t h = 0; h < nh; h++) {
            if (nk <= 8) tile_scores(qs + h * qs_s, hd, tile, 1, st);
            else tile_scores(qs + h * qs_s, hd, tile, 0, st);
            memcpy(s + h * s_s + i, st, (size_t)nk * sizeof(float));
        }
    }
}

AVX2 static void lane_max(const float *s, int64_t n, lanes8 *r) {
    const int64_t nv = n / 8 * 8;
    __m256 mx = _mm256_set1_ps(-__builtin_inff()), nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; i += 8) {
        const __m256 v = LD(s + i);
        mx = _mm256_max_ps(mx, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    ST(r->mx, mx);
    _mm256_storeu_si256((__m256i *)r->nan, _mm256_castps_si256(nan));
    for (int64_t i = nv; i < n; i++) {
        r->mx[i - nv] = f1_max(r->mx[i - nv], s[i]);
        r->nan[i - nv] |= s[i] != s[i];
    }
}

AVX2 static void exps(float *s, int64_t n, float m) {
    const int64_t nv = n / 8 * 8;
    const __m256 vm = _mm256_set1_ps(m);
    int64_t i = 0;
#if LAYER_512
    for (; i + 16 <= nv; i += 16) ST16(s + i, v16_exp(_mm512_sub_ps(LD16(s + i), _mm512_set1_ps(m))));
#endif
    for (; i < nv; i += 8) ST(s + i, v8_exp(_mm256_sub_ps(LD(s + i), vm)));
    for (int64_t i = nv; i < n; i++) s[i] = f1_exp(s[i] - m);
}

/* sum_i p_i in 8 lanes (i mod 8), kernels.h's order */
INL float lane_sum(const float *p, int64_t n) {
    const int64_t nv = n / 8 * 8;
    float lane[8];
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; i += 8) sum = _mm256_add_ps(sum, LD(p + i));
    ST(lane, sum);
    for (int64_t i = nv; i < n; i++) lane[i - nv] = lane[i - nv] + p[i];
    return lanes8_sum(lane);
}

/* acc[0..8V) = acc + sum_i p_i v_i[0..8V) over n keys in order (V = 8, 4 or 1 vectors of dims); v: key 0's first
 * dim. pf: the values PV_AHEAD keys on are prefetched (a long span's stream; a hint past the end is harmless) */
#define PV_AHEAD 64
#define PV(V, T, LOAD)                                                                                        \
    INL void pv##V##_##T(const T *v, int64_t sl, const float *p, int64_t n, float *acc, int pf) {             \
        __m256 a0 = LD(acc), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;                   \
        if (V >= 4) { a1 = LD(acc + 8); a2 = LD(acc + 16); a3 = LD(acc + 24); }                                \
        if (V == 8) { a4 = LD(acc + 32); a5 = LD(acc + 40); a6 = LD(acc + 48); a7 = LD(acc + 56); }            \
        for (int64_t i = 0; i < n; i++, v += sl) {                                                            \
            const __m256 w = _mm256_broadcast_ss(p + i);                                                      \
            if (pf) _mm_prefetch((const char *)(v + PV_AHEAD * sl), _MM_HINT_T0);                            \
            if (pf && V * 8 * sizeof(T) > 64) _mm_prefetch((const char *)(v + PV_AHEAD * sl) + 64, _MM_HINT_T0); \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, LOAD(v)));                                                \
            if (V >= 4) {                                                                                     \
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, LOAD(v + 8)));                                        \
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, LOAD(v + 16)));                                       \
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(w, LOAD(v + 24)));                                       \
            }                                                                                                 \
            if (V == 8) {                                                                                     \
                a4 = _mm256_add_ps(a4, _mm256_mul_ps(w, LOAD(v + 32)));                                       \
                a5 = _mm256_add_ps(a5, _mm256_mul_ps(w, LOAD(v + 40)));                                       \
                a6 = _mm256_add_ps(a6, _mm256_mul_ps(w, LOAD(v + 48)));                                       \
                a7 = _mm256_add_ps(a7, _mm256_mul_ps(w, LOAD(v + 56)));                                       \
            }                                                                                                 \
        }                                                                                                     \
        ST(acc, a0);                                                                                          \
        if (V >= 4) { ST(acc + 8, a1); ST(acc + 16, a2); ST(acc + 24, a3); }                                   \
        if (V == 8) { ST(acc + 32, a4); ST(acc + 40, a5); ST(acc + 48, a6); ST(acc + 56, a7); }                \
    }
PV(8, float, LD)
PV(4, float, LD)
PV(1, float, LD)
PV(8, uint16_t, ldh)
PV(4, uint16_t, ldh)
PV(1, uint16_t, ldh)
#undef PV
/* the same for two heads (p, q; acc, bcc) and 32 dims: each value vector loaded once for both */
#define PV2(T, LOAD)                                                                                          \
    INL void pv2_##T(const T *v, int64_t sl, const float *p, const float *q, int64_t n, float *acc, float *bcc, \
                     int pf) {                                                                                \
        __m256 a0 = LD(acc), a1 = LD(acc + 8), a2 = LD(acc + 16), a3 = LD(acc + 24);                          \
        __m256 b0 = LD(bcc), b1 = LD(bcc + 8), b2 = LD(bcc + 16), b3 = LD(bcc + 24);                          \
        for (int64_t i = 0; i < n; i++, v += sl) {                                                            \
            const __m256 w = _mm256_broadcast_ss(p + i), x = _mm256_broadcast_ss(q + i);                      \
            if (pf) _mm_prefetch((const char *)(v + PV_AHEAD * sl), _MM_HINT_T0);                            \
            __m256 e = LOAD(v);                                                                               \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, e)); b0 = _mm256_add_ps(b0, _mm256_mul_ps(x, e));         \
            e = LOAD(v + 8);                                                                                  \
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, e)); b1 = _mm256_add_ps(b1, _mm256_mul_ps(x, e));         \
            e = LOAD(v + 16);                                                                                 \
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, e)); b2 = _mm256_add_ps(b2, _mm256_mul_ps(x, e));         \
            e = LOAD(v + 24);                                                                                 \
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(w, e)); b3 = _mm256_add_ps(b3, _mm256_mul_ps(x, e));         \
        }                                                                                                     \
        ST(acc, a0); ST(acc + 8, a1); ST(acc + 16, a2); ST(acc + 24, a3);                                     \
        ST(bcc, b0); ST(bcc + 8, b1); ST(bcc + 16, b2); ST(bcc + 24, b3);                                     \
    }
PV2(float, LD)
PV2(uint16_t, ldh)
#undef PV2

#if LAYER_512
/* 64 dims (4 vectors of 16) of two heads (p, q; acc, bcc; q NULL: one head), each value vector loaded once */
#define PVW(T, LOAD16)                                                                                        \
    INL void pvw_##T(const T *v, int64_t sl, const float *p, const float *q, int64_t n, float *acc, float *bcc, \
                     int pf) {                                                                                \
        __m512 a0 = LD16(acc), a1 = LD16(acc + 16), a2 = LD16(acc + 32), a3 = LD16(acc + 48);                 \
        __m512 b0 = a0, b1 = a1, b2 = a2, b3 = a3;                                                            \
        if (q) { b0 = LD16(bcc); b1 = LD16(bcc + 16); b2 = LD16(bcc + 32); b3 = LD16(bcc + 48); }              \
        for (int64_t i = 0; i < n; i++, v += sl) {                                                            \
            const __m512 w = _mm512_set1_ps(p[i]), x = _mm512_set1_ps(q ? q[i] : 0.0f);                      \
            if (pf)                                                                                           \
                for (int c = 0; c < 64 * (int)sizeof(T); c += 64)                                             \
                    _mm_prefetch((const char *)(v + PV_AHEAD * sl) + c, _MM_HINT_T0);                         \
            const __m512 e0 = LOAD16(v), e1 = LOAD16(v + 16), e2 = LOAD16(v + 32), e3 = LOAD16(v + 48);       \
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(w, e0)); a1 = _mm512_add_ps(a1, _mm512_mul_ps(w, e1));       \
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(w, e2)); a3 = _mm512_add_ps(a3, _mm512_mul_ps(w, e3));       \
            if (q) {                                                                                          \
                b0 = _mm512_add_ps(b0, _mm512_mul_ps(x, e0)); b1 = _mm512_add_ps(b1, _mm512_mul_ps(x, e1));   \
                b2 = _mm512_add_ps(b2, _mm512_mul_ps(x, e2)); b3 = _mm512_add_ps(b3, _mm512_mul_ps(x, e3));   \
            }                                                                                                 \
        }                                                                                                     \
        ST16(acc, a0); ST16(acc + 16, a1); ST16(acc + 32, a2); ST16(acc + 48, a3);                            \
        if (q) { ST16(bcc, b0); ST16(bcc + 16, b1); ST16(bcc + 32, b2); ST16(bcc + 48, b3); }                  \
    }
PVW(float, LD16)
PVW(uint16_t, ldh16)
#undef PVW
#endif

/* acc[h][d] = sum_i p[h][i] v_i[d] for dims d0..d1-1, keys in order: blocks of VB keys, in a block 32 dims of two
 * heads at a time (then 64, 32, 8 dims of one; the 512-bit twin first 64 dims of two heads, or of a last one), each
 * meeting every head while the block's values are in L1 */
#define VB 64
#define PV_STEP(V)                                                                                            \
    for (; d + 8 * V <= d1; d += 8 * V)                                                                       \
        for (int64_t h = 0; h < nh; h++) {                                                                    \
            if (j->f16) pv##V##_uint16_t(vh + b * sl + d, sl, p + h * p_s + b, nb, acc + h * a_s + d, pf);    \
            else pv##V##_float(vf + b * sl + d, sl, p + h * p_s + b, nb, acc + h * a_s + d, pf);              \
        }
INL void weighted_values(const attend_job *j, int64_t kvh, int64_t k0, int64_t n, int64_t nh, int64_t d0,
                         int64_t d1, const float *p, int64_t p_s, float *acc) {
    const int64_t sl = j->v_sl, e = kvh * j->v_sh + k0 * sl, a_s = up8(j->hd);
    const int pf = n >= STREAM_KEYS || j->T <= COLD_ROWS;   /* the whole span's n */
    const float *vf = (const float *)j->v + e;
    const uint16_t *vh = (const uint16_t *)j->v + e;
    for (int64_t h = 0; h < nh; h++) memset(acc + h * a_s + d0, 0, (size_t)(d1 - d0) * sizeof(float));
    for (int64_t b = 0; b < n; b += VB) {
        const int64_t nb = n - b < VB ? n - b : VB;
        int64_t d = d0;
#if LAYER_512
        for (; d + 64 <= d1; d += 64)   /* 16 lanes: two heads at a time, then a last one alone */
            for (int64_t h = 0; h < nh; h += 2) {
                const float *pa = p + h * p_s + b, *pb = h + 1 < nh ? pa + p_s : NULL;
                float *aa = acc + h * a_s + d, *ab = aa + a_s;
                if (j->f16) pvw_uint16_t(vh + b * sl + d, sl, pa, pb, nb, aa, ab, pf);
                else pvw_float(vf + b * sl + d, sl, pa, pb, nb, aa, ab, pf);
            }
#endif
        for (; nh > 1 && d + 32 <= d1; d += 32) {   /* two heads at a time (each value vector loaded once) */
            int64_t h = 0;
            for (; h + 2 <= nh; h += 2) {
                const float *pa = p + h * p_s + b, *pb = pa + p_s;
                float *aa = acc + h * a_s + d, *ab = aa + a_s;
                if (j->f16) pv2_uint16_t(vh + b * sl + d, sl, pa, pb, nb, aa, ab, pf);
                else pv2_float(vf + b * sl + d, sl, pa, pb, nb, aa, ab, pf);
            }
            if (h < nh) {
                if (j->f16) pv4_uint16_t(vh + b * sl + d, sl, p + h * p_s + b, nb, acc + h * a_s + d, pf);
                else pv4_float(vf + b * sl + d, sl, p + h * p_s + b, nb, acc + h * a_s + d, pf);
            }
        }
        PV_STEP(8)
        PV_STEP(4)
        PV_STEP(1)
        for (; d < d1; d++)
            for (int64_t h = 0; h < nh; h++) {
                float a = acc[h * a_s + d];
                for (int64_t i = b; i < b + nb; i++)
                    a = a + p[h * p_s + i] * (j->f16 ? half_to_float(vh[i * sl + d]) : vf[i * sl + d]);
                acc[h * a_s + d] = a;
            }
    }
}
#undef PV_STEP

/* ---- kv_cache q8_0 ---- */
/* the f16 at p, p + st, .., p + 7 st (bytes) as 8 floats (the first n of them; the rest 0) */
INL __m256 ldh_strided(const uint8_t *p, int64_t st, int64_t n) {
    if (n >= 8)
        return _mm256_cvtph_ps(_mm_setr_epi16((short)rd16(p), (short)rd16(p + st), (short)rd16(p + 2 * st),
                                              (short)rd16(p + 3 * st), (short)rd16(p + 4 * st), (short)rd16(p + 5 * st),
                                              (short)rd16(p + 6 * st), (short)rd16(p + 7 * st)));
    uint16_t h[8] = {0};
    for (int64_t e = 0; e < n; e++) h[e] = rd16(p + e * st);
    return ldh(h);
}

/* s[h][i] for keys k0 + i, i = 0..n-1, against the query heads' blocks qb (q8_query): 8 keys at a time, per block
 * and head each key's integer dot product (|qq| x sign(k, qq) by maddubs, pairs by madd: 8 ints, then summed by
 * hadds: exact), then q8_score's f32 steps on the 8 keys' lanes, acc kept in s between blocks; the last n % 8 keys
 * by q8_score itself */
#define Q8_AHEAD 32   /* keys (values) prefetched ahead of the ones read (harmless past the end: a hint) */
#define Q8_DOT(c) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(r + (c) * sl + 2)), qq)), ones)
INL void q8_scores(const attend_job *j, int64_t kvh, int64_t k0, int64_t n, int64_t nh, const float *qb, float *s,
                   int64_t s_s) {
    const int64_t nb = j->nb, sl = j->k_sl, nv = n / 8 * 8;
    const uint8_t *kb = (const uint8_t *)j->k + kvh * j->k_sh + k0 * sl;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nv; i += 8)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *r = kb + i * sl + b * Q8_BYTES;
            if (b == 0)
                for (int c = 0; c < 8; c++) _mm_prefetch((const char *)(r + (Q8_AHEAD + c) * sl), _MM_HINT_T0);
            const __m256 dk = ldh_strided(r, sl, 8);
            for (int64_t h = 0; h < nh; h++) {
                const float *qd = qb + h * nb * 9;
                const __m256i qq = _mm256_loadu_si256((const __m256i *)((const int8_t *)(qd + nb) + 32 * b));
                const __m256i aq = _mm256_sign_epi8(qq, qq);
                const __m256i t0 = _mm256_hadd_epi32(Q8_DOT(0), Q8_DOT(1)), t1 = _mm256_hadd_epi32(Q8_DOT(2), Q8_DOT(3));
                const __m256i t2 = _mm256_hadd_epi32(Q8_DOT(4), Q8_DOT(5)), t3 = _mm256_hadd_epi32(Q8_DOT(6), Q8_DOT(7));
                const __m256i ab = _mm256_hadd_epi32(t0, t1), cd = _mm256_hadd_epi32(t2, t3);   /* keys 0-3 | 4-7 halves */
                const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                                                      _mm256_permute2x128_si256(ab, cd, 0x31));
                float *sp = s + h * s_s + i;
                const __m256 acc = b ? LD(sp) : _mm256_setzero_ps();
                ST(sp, _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(qd[b]), dk), _mm256_cvtepi32_ps(isum))));
            }
        }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t i = nv; i < n; i++)
            s[h * s_s + i] = q8_score(kb + i * sl, qb + h * nb * 9, (const int8_t *)(qb + h * nb * 9 + nb), nb);
}
#undef Q8_DOT

/* acc[h][d] = sum_i (p[h][i] dv_i) qv_i[d] for dims d0..d1-1 (d0 a multiple of 8), keys in order: ATT_TILE keys at a
 * time, first their scales dv and every head's weights w = p dv ([head][block][key] in the tile), then 16 dims (or
 * 8; then 1) at a time: each key's int8 converted once and met by up to 4 heads, one chain per dim and head */
#define Q8_W(k) _mm256_broadcast_ss(wt + (k) * wh + c)
#define Q8_SLAB(M, V)                                                                                         \
    {                                                                                                         \
        float *a0p = acc + (hg + 0) * a_s + d, *a1p = acc + (hg + (M > 1)) * a_s + d;                          \
        float *a2p = acc + (hg + (M > 2) * 2) * a_s + d, *a3p = acc + (hg + (M > 3) * 3) * a_s + d;            \
        __m256 x0 = LD(a0p), y0 = V > 1 ? LD(a0p + 8) : x0, x1 = x0, y1 = y0, x2 = x0, y2 = y0, x3 = x0, y3 = y0; \
        if (M > 1) { x1 = LD(a1p); if (V > 1) y1 = LD(a1p + 8); }                                               \
        if (M > 2) { x2 = LD(a2p); if (V > 1) y2 = LD(a2p + 8); }                                               \
        if (M > 3) { x3 = LD(a3p); if (V > 1) y3 = LD(a3p + 8); }                                               \
        const float *wt = w + (hg * nbt + b - b0) * ATT_TILE;                                                 \
        const uint8_t *q = v + i * sl + b * Q8_BYTES + 2 + d % 32;                                            \
        for (int64_t c = 0; c < nk; c++, q += sl) {                                                           \
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));  \
            const __m256 q1 = V > 1 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))) : q0; \
            __m256 wk = Q8_W(0);                                                                              \
            x0 = _mm256_add_ps(x0, _mm256_mul_ps(wk, q0));                                                    \
            if (V > 1) y0 = _mm256_add_ps(y0, _mm256_mul_ps(wk, q1));                                         \
            if (M > 1) { wk = Q8_W(1); x1 = _mm256_add_ps(x1, _mm256_mul_ps(wk, q0));                         \
                         if (V > 1) y1 = _mm256_add_ps(y1, _mm256_mul_ps(wk, q1)); }                          \
            if (M > 2) { wk = Q8_W(2); x2 = _mm256_add_ps(x2, _mm256_mul_ps(wk, q0));                         \
                         if (V > 1) y2 = _mm256_add_ps(y2, _mm256_mul_ps(wk, q1)); }                          \
            if (M > 3) { wk = Q8_W(3); x3 = _mm256_add_ps(x3, _mm256_mul_ps(wk, q0));                         \
                         if (V > 1) y3 = _mm256_add_ps(y3, _mm256_mul_ps(wk, q1)); }                          \
        }                                                                                                     \
        ST(a0p, x0); if (V > 1) ST(a0p + 8, y0);                                                              \
        if (M > 1) { ST(a1p, x1); if (V > 1) ST(a1p + 8, y1); }                                                \
        if (M > 2) { ST(a2p, x2); if (V > 1) ST(a2p + 8, y2); }                                                \
        if (M > 3) { ST(a3p, x3); if (V > 1) ST(a3p + 8, y3); }                                                \
    }
#define Q8_HEADS(V)                                                                                           \
    for (int64_t hg = 0; hg < nh; hg += 4) {                                                                  \
        switch (nh - hg < 4 ? nh - hg : 4) {                                                                  \
        case 1: Q8_SLAB(1, V) break;                                                                          \
        case 2: Q8_SLAB(2, V) break;                                                                          \
        case 3: Q8_SLAB(3, V) break;                                                                          \
        default: Q8_SLAB(4, V) break;                                                                         \
        }                                                                                                     \
    }
INL void q8_weighted_values(const attend_job *j, int64_t kvh, int64_t k0, int64_t n, int64_t nh, int64_t d0,
                            int64_t d1, const float *p, int64_t p_s, float *acc, float *tile) {
    const int64_t sl = j->v_sl, a_s = up8(j->hd), b0 = d0 / 32, b1 = (d1 + 31) / 32, nbt = b1 - b0;
    const int64_t wh = nbt * ATT_TILE;   /* w: [head][block b0..][key] */
    const uint8_t *v = (const uint8_t *)j->v + kvh * j->v_sh + k0 * sl;
    float *dv = tile, *w = dv + nbt * ATT_TILE;
    for (int64_t h = 0; h < nh; h++) memset(acc + h * a_s + d0, 0, (size_t)(d1 - d0) * sizeof(float));
    for (int64_t i = 0; i < n; i += ATT_TILE) {
        const int64_t nk = n - i < ATT_TILE ? n - i : ATT_TILE;
        for (int64_t c = 0; c < nk; c++) _mm_prefetch((const char *)(v + (i + c + Q8_AHEAD) * sl), _MM_HINT_T0);
        for (int64_t b = b0; b < b1; b++)
            for (int64_t c = 0; c < nk; c += 8)
                ST(dv + (b - b0) * ATT_TILE + c, ldh_strided(v + (i + c) * sl + b * Q8_BYTES, sl, nk - c));
        for (int64_t h = 0; h < nh; h++)   /* w = p dv, 8 keys at a time (lanes past nk unread) */
            for (int64_t b = 0; b < nbt; b++)
                for (int64_t c = 0; c < nk; c += 8) {
                    const float *ph = p + h * p_s + i + c;
                    const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nk - c)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                    const __m256 pc = nk - c >= 8 ? LD(ph) : _mm256_maskload_ps(ph, in);
                    ST(w + h * wh + b * ATT_TILE + c, _mm256_mul_ps(pc, LD(dv + b * ATT_TILE + c)));
                }
        int64_t d = d0;
        for (; d + 16 <= d1; d += 16) {
            const int64_t b = d / 32;
            Q8_HEADS(2)
        }
        for (; d + 8 <= d1; d += 8) {
            const int64_t b = d / 32;
            Q8_HEADS(1)
        }
        for (; d < d1; d++)
            for (int64_t h = 0; h < nh; h++) {
                float a = acc[h * a_s + d];
                for (int64_t c = 0; c < nk; c++)
                    a = a + w[h * wh + (d / 32 - b0) * ATT_TILE + c] * (float)(int8_t)v[(i + c) * sl + d / 32 * Q8_BYTES + 2 + d % 32];
                acc[h * a_s + d] = a;
            }
    }
}
#undef Q8_HEADS
#undef Q8_SLAB
#undef Q8_W

AVX2 static void attend_scores(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t i0, int64_t i1,
                               float *s, int64_t s_s, float *scratch) {
    const int64_t hd = j->hd, hd8 = up8(hd), kvh = h0 / (j->H / j->Hkv);
    float *qs = scratch, *tile = qs + 2 * nh * hd8;
    if (j->q8) {   /* the query's blocks in the tile */
        q8_query(j->q.p + t * j->q.s0 + h0 * j->q.s1, j->q.s1, nh, hd, j->scale, tile);
        q8_scores(j, kvh, j->spans[2 * t] + i0, i1 - i0, nh, tile, s + i0, s_s);
        return;
    }
    const __m256 vscale = _mm256_set1_ps(j->scale);
    for (int64_t h = 0; h < nh; h++) {
        const float *q = j->q.p + t * j->q.s0 + (h0 + h) * j->q.s1;
        int64_t d = 0;
        for (; d + 8 <= hd; d += 8) ST(qs + h * hd8 + d, _mm256_mul_ps(LD(q + d), vscale));
        for (; d < hd; d++) qs[h * hd8 + d] = q[d] * j->scale;
    }
    const int pf = j->spans[2 * t + 1] - j->spans[2 * t] >= STREAM_KEYS || j->T <= COLD_ROWS;   /* the whole span's n */
    scores(j, kvh, j->spans[2 * t] + i0, i1 - i0, nh, qs, tile, s + i0, s_s, pf);
}

AVX2 static void weighted(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t d0, int64_t d1,
                          const float *p, int64_t p_s, float *scratch) {
    const int64_t hd = j->hd, hd8 = up8(hd), k0 = j->spans[2 * t], n = j->spans[2 * t + 1] - k0;
    float *acc = scratch + nh * hd8;
    if (j->q8) q8_weighted_values(j, h0 / (j->H / j->Hkv), k0, n, nh, d0, d1, p, p_s, acc, acc + nh * hd8);
    else weighted_values(j, h0 / (j->H / j->Hkv), k0, n, nh, d0, d1, p, p_s, acc);
    for (int64_t h = 0; h < nh; h++) {   /* out = acc / sum */
        const float *a = acc + h * hd8, sum = lane_sum(p + h * p_s, n);
        float *oh = j->out + t * j->out_s + (h0 + h) * hd;
        const __m256 vs = _mm256_set1_ps(sum);
        int64_t d = d0;
        for (; d + 8 <= d1; d += 8) ST(oh + d, _mm256_div_ps(LD(a + d), vs));
        for (; d < d1; d++) oh[d] = a[d] / sum;
    }
}

/* ======================================================================================================
 * act(a) * b
 * ==================================================================================================== */

#if LAYER_512
#define MAP_LOOP16(ACT)                                                                                       \
    for (; k + 16 <= n; k += 16)                                                                              \
        ST16(out + k, b ? _mm512_mul_ps(v16_act(ACT, LD16(a + k)), LD16(b + k)) : v16_act(ACT, LD16(a + k)));
#else
#define MAP_LOOP16(ACT)
#endif
#define MAP_LOOP(ACT)                                                                                         \
    MAP_LOOP16(ACT)                                                                                           \
    for (; k + 8 <= n; k += 8) ST(out + k, b ? _mm256_mul_ps(v8_act(ACT, LD(a + k)), LD(b + k)) : v8_act(ACT, LD(a + k)));

AVX2 static void map_row(int act, const float *a, const float *b, int64_t n, float *out) {
    int64_t k = 0;
    switch (act) {   /* a constant act per loop */
    case ACT_SILU: MAP_LOOP(ACT_SILU) break;
    case ACT_GELU_TANH: MAP_LOOP(ACT_GELU_TANH) break;
    case FN_EXP: MAP_LOOP(FN_EXP) break;
    default: MAP_LOOP(FN_TANH) break;
    }
    for (; k < n; k++) out[k] = b ? f1_act(act, a[k]) * b[k] : f1_act(act, a[k]);
}
#undef MAP_LOOP
#undef MAP_LOOP16

/* ======================================================================================================
 * f32 -> f16: F16C's conversion rounds to nearest even, subnormals and overflow to inf included, as half_from_float
 * does; a NaN keeps part of its payload there, so 8 values with a NaN among them go value by value
 * ==================================================================================================== */
AVX2 static void f16_row(const float *x, int64_t xs, int64_t n, uint16_t *out, int64_t os) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float *p = x + i * xs;
        const __m256 v = xs == 1 ? _mm256_loadu_ps(p)
                                 : _mm256_setr_ps(p[0], p[xs], p[2 * xs], p[3 * xs], p[4 * xs], p[5 * xs], p[6 * xs],
                                                  p[7 * xs]);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
        const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (os == 1) {
            _mm_storeu_si128((__m128i *)(out + i), h);
        } else {   /* a key into the Cache's transposed rows: 8 values converted at once, stored one by one */
            uint16_t t[8];
            _mm_storeu_si128((__m128i *)t, h);
            for (int e = 0; e < 8; e++) out[(i + e) * os] = t[e];
        }
    }
    for (; i < n; i++) out[i * os] = half_from_float(x[i * xs]);
}

const layer_ops LAYER_SYM = {sumsq, rms_row, rope_row, attend_scores, lane_max, exps, weighted, map_row, f16_row};

#else
const layer_ops LAYER_SYM = {0};
#endif
