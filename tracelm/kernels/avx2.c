/* The AVX2 path: chosen at run time (CPUID), compiled per function with target("avx2,f16c") -- no "fma", so
 * the compiler cannot fuse a multiply and an add even if asked to contract.
 *
 * Quantized weights: eight weight rows at a time, one per float lane. The integer dot products of a block
 * (exact: maddubs, then int16/int32 sums; the weight offsets -8/-16/-32 folded out as offset * sum(q)) land in
 * one 8-lane vector, row r in lane r, and the float update of kernels.h (COMBINE_*) runs on the 8 lanes with v8_*
 * ops, once for the hi half of x and once for the lo half, into acc_hi and acc_lo; out = acc_hi + acc_lo. Two
 * kinds of kernel, the same integers and float operations:
 *   - direct (up to direct_rows(t, packed) x rows, decode): blocks unpacked on the fly and met by both halves of
 *     the x row before the next block, the next group prefetched. Q4_0..Q5_1 and packed K-quants "vertical"
 *     (below): the 8 rows' block transposed (packed: as it lies) so that lane r holds row r's quads, each x quad
 *     broadcast -- no sums across lanes; Q8_0 and the file's K-quant rows row by row (one maddubs per
 *     row-block), summed across rows by hadd trees. On 512-bit vectors (avx512vnni, amx), packed weights two
 *     groups at a time, 16 rows in 16 lanes (direct_pair), so each x quad's broadcast and vpdpbusd serve both,
 *     and the 4/5-bit pairs met by up to 4 x rows a pass (up to 16 rows: a server's batch, a draft's check); on
 *     256-bit vectors the packed 4/5-bit groups up to 4 x rows a pass too (up to 8 or 4 rows: direct_rows_group);
 *     packed Q4_K on 512-bit vectors two x rows a pass (up to 4 rows), the other K-quants one;
 *   - tiled (more x rows, prefill): a chunk of blocks of the 8 rows unpacked once into a vertical buffer, then
 *     met by every quantized row of the task's tile (2 per x row: hi, lo), 4 at a time.
 * F32/F16/BF16 weights: the 32 lanes as 4 vectors; one weight row against 1-2 x rows, or a 2 x 4 tile that
 * runs the 4 lane vectors one after the other (each lane is its own chain, so the order is the same).
 */
#include "kernels.h"

/* This file is compiled three times (setup.py): as itself, the AVX2 path; from avxvnni.c with VNNI 1 and from
 * avx512vnni.c with VNNI 2, the VNNI paths, where the integer dot of a dword's 4 unsigned weight bytes with 4 signed
 * activation bytes is one vpdpbusd into int32 (VEX-encoded AVX-VNNI, or EVEX-encoded AVX512-VNNI on 256-bit
 * vectors) instead of maddubs -> int16 pairs -> madd. The integers are the same, so every path gives the same bits;
 * only the int16 budgets (runs of 4 or 8 quads) and the scale vectors' format (int16 pairs for madd, int32 for
 * mullo) differ. */
#ifndef VNNI
#define VNNI 0
#endif
#ifndef AMX
#define AMX 0
#endif
#if VNNI == 1
#define TARGET "avx2,f16c,avxvnni"
#define PATH_SYM avxvnni_path
#define PATH_NAME "avxvnni"
#elif VNNI == 2 && AMX
#define TARGET "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8"
#define PATH_SYM amx_path
#define PATH_NAME "amx"
#elif VNNI == 2
#define TARGET "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define PATH_SYM avx512vnni_path
#define PATH_NAME "avx512vnni"
#else
#define TARGET "avx2,f16c"
#define PATH_SYM avx2_path
#define PATH_NAME "avx2"
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target(TARGET)))
#define INL static inline __attribute__((always_inline, target(TARGET)))

#if !VNNI
int avx2_compiled(void) { return 1; }
#endif

/* acc + the products of w's unsigned bytes with x's signed bytes. DOTACC: AVX2 in int16 pairs (maddubs, then an
 * int16 add: mind the budget), VNNI in int32 dwords (vpdpbusd); SUM32 widens such an accumulator to dwords (VNNI:
 * it is one); DOT32: the dword sums added to an int32 accumulator; SCALE32: dwords times a scale vector (AVX2: int16
 * pairs times int16 scales, madd; VNNI: int32 times int32, mullo); SUB16: an offset taken off an accumulator */
#if VNNI == 1
#define DOTACC(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif VNNI == 2
#define DOTACC(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#endif
#if VNNI
#define SUM32(acc) (acc)
#define DOT32(acc, w, x) DOTACC(acc, w, x)
#define SCALE32(s, sc) _mm256_mullo_epi32(s, sc)
#define SUB16(a, b) _mm256_sub_epi32(a, b)
#else
#define DOTACC(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define SUM32(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#define DOT32(acc, w, x) _mm256_add_epi32(acc, SUM32(_mm256_maddubs_epi16(w, x)))
#define SCALE32(s, sc) _mm256_madd_epi16(s, sc)
#define SUB16(a, b) _mm256_sub_epi16(a, b)
#endif

/* keep a vector in a register, opaque to the compiler: a loaded vector is then not folded into each of its uses
 * as a load again, and a chain of integer adds is not reassociated into a tree that computes every product
 * first and spills them */
#define REG(v) __asm__("" : "+v"(v))

#define v8_add(a, b) _mm256_add_ps(a, b)
#define v8_sub(a, b) _mm256_sub_ps(a, b)
#define v8_mul(a, b) _mm256_mul_ps(a, b)
#define v8_cvt(i) _mm256_cvtepi32_ps(i)

/* up to this many x rows per task: unpack on the fly; more: unpack once into a buffer (measured, 1 thread, both
 * halves: the vertical 4/5-bit and the K-quant kernels win from 2 rows on; the row-by-row Q8_0 one holds out longer,
 * and so does the packed K-quants' direct one, which reads its blocks as they lie -- measured, 2 threads, ffn_down
 * shapes, ms direct against tiled: 2 rows Q4_K 0.15 / 0.21, Q5_K 0.25 / 0.27, Q6_K 0.26 / 0.35; 3 rows Q4_K
 * 0.21 / 0.24, Q5_K 0.36 / 0.32, Q6_K 0.35 / 0.38; 4 rows alike). On 512-bit vectors the packed 4/5-bit pairs meet
 * 4 (or 2) x rows a pass, their blocks unpacked once for all (direct_pair): they win up to 16 rows -- measured, 1
 * thread, SmolLM2's Q4_1 ffn_gate_up (3072 x 576), us direct against tiled: 2 rows 33 / 60, 4 rows 56 / 81, 8 rows
 * 105 / 125, 12 rows 158 / 170, 16 rows 210 / 220. On 256-bit vectors the same for the packed 4/5-bit types, 4 x rows a
 * pass (direct_rows_group): measured, 1 thread, 4864 x 896, us direct against tiled, AVX2: Q4_1 2 rows 150 / 201, 4
 * rows 264 / 328, 8 rows 523 / 572, 12 rows 780 / 826; Q5_0 2 rows 173 / 192, 4 rows 301 / 312, 8 rows 589 / 545;
 * avxvnni: Q4_1 8 rows 473 / 526, Q5_0 8 rows 495 / 477. Packed Q4_K on 512-bit vectors: two x rows a pass
 * (dotk4_packed16x2), up to 4 -- measured, 1 thread, 2048 x 3584, us direct against tiled: 3 rows 206-218 / 230-238 (one
 * row a pass), 4 rows 243-253 / 302-308 */
INL int direct_rows(int t, int pk) {
    if (pk && type_block(t) == 256) return t == T_Q5_K ? 2 : VNNI == 2 && t == T_Q4_K ? 4 : 3;
    if (VNNI == 2 && pk && t != T_Q8_0) return 16;
    if (pk && t != T_Q8_0) return t == T_Q4_0 || t == T_Q4_1 ? 8 : 4;   /* 256-bit: direct_rows_group */
    return t == T_Q8_0 ? 3 : 1;
}
#define TILE_MIN 4      /* F32/F16/BF16: from this many x rows on, the 2 x 4 tile */
#define PREFETCH 2048   /* tiled kernel: bytes ahead in each row's stream */

/* ---- helpers ---- */
INL __m256i ld256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INL __m128i ld128(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
INL __m256i join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

/* 8 vectors of 8 int32 -> one vector, lane r = sum of s[r] */
INL __m256i hsum8(__m256i s0, __m256i s1, __m256i s2, __m256i s3, __m256i s4, __m256i s5, __m256i s6,
                  __m256i s7) {
    __m256i a = _mm256_hadd_epi32(s0, s1), b = _mm256_hadd_epi32(s2, s3);
    __m256i c = _mm256_hadd_epi32(s4, s5), d = _mm256_hadd_epi32(s6, s7);
    __m256i f = _mm256_hadd_epi32(a, b), g = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(f, g, 0x20), _mm256_permute2x128_si256(f, g, 0x31));
}

/* DOTACC outputs of 8 rows (AVX2: maddubs, 16 int16 each, 8-bit weights: each at most 2*128*127 = 32512, so none
 * can be added to another in int16; VNNI: 8 int32) -> lane r = row r's sum */
INL __m256i rowsums8(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4, __m256i p5, __m256i p6, __m256i p7) {
    return hsum8(SUM32(p0), SUM32(p1), SUM32(p2), SUM32(p3), SUM32(p4), SUM32(p5), SUM32(p6), SUM32(p7));
}

/* off * sum q (off 8, 16 or 128) as a vector of W bits: the broadcast sum shifted, off the scalar unit */
#define OFF_SUM(W, off, sum) _mm##W##_slli_epi32(_mm##W##_set1_epi32(sum), (off) == 8 ? 3 : (off) == 16 ? 4 : 7)

/* a half-row's block of a 32-value type on W-bit vectors (P: v8 or v16): its integer sums isum less off * sum q, then
 * kernels.h's float step into acc with the weights' d (and m: dm, Q4_1 and Q5_1) and the x block X's */
#define HALF_STEP(W, P, acc, isum, X, off, dm, d, m)                                                                 \
    {                                                                                                             \
        __m##W##i i_ = (isum);                                                                                    \
        if (off) i_ = _mm##W##_sub_epi32(i_, OFF_SUM(W, off, (X)->sum));                                          \
        const __m##W dx_ = _mm##W##_set1_ps((X)->d);                                                              \
        if (dm) COMBINE_DM(P, acc, d, m, dx_, i_, _mm##W##_set1_epi32((X)->sum));                                 \
        else COMBINE_D(P, acc, d, dx_, i_);                                                                       \
    }

INL int weight_bits(int t) { return t == T_Q4_0 || t == T_Q4_1 ? 4 : t == T_Q5_0 || t == T_Q5_1 ? 5 : 8; }

/* ======================================================================================================
 * activations: kernels.h's quantizer, the same bytes as the portable quantize_block / quantize_split.
 *  - amax: the integer max of the values' bits with the sign cleared (non-negative floats order as their bits; an
 *    inf or NaN lies above 0x7f7fffff, so the same max flags a non-finite block);
 *  - q = cvtps(x id) rounds half to even, as nearbyintf does (|x id| <= 127 and a few ulp: no clamp is ever taken);
 *    the hi half keeps v = round(x id) as a float for r = x - d v, the portable path's (float)q (v may be -0 where
 *    (float)q is +0: r then differs in the sign of a zero only, which lo maps to q = 0 alike);
 *  - 32-value blocks go 8 at a time, their horizontal maxes and sums and their divides one vector's work.
 * ==================================================================================================== */
INL __m256i abs_bits(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)); }

/* 8 vectors -> one, lane b = the max of v[b]'s lanes */
INL __m256i max8(const __m256i *v) {
#define M2(a, b, lo, hi) _mm256_max_epi32(lo(a, b), hi(a, b))
    const __m256i t0 = M2(v[0], v[1], _mm256_unpacklo_epi32, _mm256_unpackhi_epi32);
    const __m256i t1 = M2(v[2], v[3], _mm256_unpacklo_epi32, _mm256_unpackhi_epi32);
    const __m256i t2 = M2(v[4], v[5], _mm256_unpacklo_epi32, _mm256_unpackhi_epi32);
    const __m256i t3 = M2(v[6], v[7], _mm256_unpacklo_epi32, _mm256_unpackhi_epi32);
    const __m256i u0 = M2(t0, t1, _mm256_unpacklo_epi64, _mm256_unpackhi_epi64);   /* blocks 0..3, per 128 lanes */
    const __m256i u1 = M2(t2, t3, _mm256_unpacklo_epi64, _mm256_unpackhi_epi64);   /* blocks 4..7 */
#undef M2
    return _mm256_max_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* per lane from its amax bits: d = amax / 127, id = 1 / d; below 2^-100 d = id = 0 (so q = 0 and r = x) */
INL void scales_of(__m256i amax, __m256 *d, __m256 *id) {
    const __m256 a = _mm256_castsi256_ps(amax), live = _mm256_cmp_ps(a, _mm256_set1_ps(TINY_AMAX), _CMP_GE_OQ);
    const __m256 dd = _mm256_div_ps(a, _mm256_set1_ps(127.0f));
    *d = _mm256_and_ps(dd, live);
    *id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), dd), live);
}
INL int nonfinite_lanes(__m256i amax) {
    return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7f7fffff))));
}

/* 32 int32 (4 vectors) -> 32 int8 at q */
INL void pack32(__m256i a, __m256i b, __m256i c, __m256i e, int8_t *q) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* 32 values at x scaled by id (in every lane, as d) -> q, the sums of q's first and last 16 (s01, s23: their lanes
 * add up to each); keep_r: r = x - d v at r, the max of its bits with the sign cleared into *ar */
INL void quant32(const float *x, __m256 id, __m256 d, int keep_r, float *r, __m256i *ar, int8_t *q, __m256i *s01,
                 __m256i *s23) {
#if VNNI == 2
    const __m512 id16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(id)),
                 d16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(d));
    __m512i i[2], a = _mm512_setzero_si512();
    for (int k = 0; k < 2; k++) {
        const __m512 xv = _mm512_loadu_ps(x + 16 * k), p = _mm512_mul_ps(xv, id16);
        if (keep_r) {
            const __m512 v = _mm512_roundscale_ps(p, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
            const __m512 rv = _mm512_sub_ps(xv, _mm512_mul_ps(d16, v));
            _mm512_storeu_ps(r + 16 * k, rv);
            a = _mm512_max_epi32(a, _mm512_and_si512(_mm512_castps_si512(rv), _mm512_set1_epi32(0x7fffffff)));
            i[k] = _mm512_cvtps_epi32(v);
        } else {
            i[k] = _mm512_cvtps_epi32(p);
        }
    }
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(i[0]));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(i[1]));
#define LO(v) _mm512_castsi512_si256(v)
#define HI(v) _mm512_extracti64x4_epi64(v, 1)
    *s01 = _mm256_add_epi32(LO(i[0]), HI(i[0]));
    *s23 = _mm256_add_epi32(LO(i[1]), HI(i[1]));
    if (keep_r) *ar = _mm256_max_epi32(*ar, _mm256_max_epi32(LO(a), HI(a)));
#undef LO
#undef HI
#else
    __m256i i[4];
    for (int k = 0; k < 4; k++) {
        const __m256 xv = _mm256_loadu_ps(x + 8 * k), p = _mm256_mul_ps(xv, id);
        if (keep_r) {
            const __m256 v = _mm256_round_ps(p, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
            const __m256 rv = _mm256_sub_ps(xv, _mm256_mul_ps(d, v));
            _mm256_storeu_ps(r + 8 * k, rv);
            *ar = _mm256_max_epi32(*ar, abs_bits(rv));
            i[k] = _mm256_cvtps_epi32(v);
        } else {
            i[k] = _mm256_cvtps_epi32(p);
        }
    }
    pack32(i[0], i[1], i[2], i[3], q);
    *s01 = _mm256_add_epi32(i[0], i[1]);
    *s23 = _mm256_add_epi32(i[2], i[3]);
#endif
}

/* nb <= 8 blocks of 32 values at x (amax: lane b, block b's) -> h[0..nb); keep_r: their residuals at r and the
 * residuals' amax bits at ar[b] (a non-finite block's: NaN, so that its lo block is one too) */
INL void quantize8(const float *x, int nb, __m256i amax, xblock32 *h, int keep_r, float *r, __m256i *ar) {
    const int bad = nonfinite_lanes(amax);
    __m256 dv, idv;
    scales_of(amax, &dv, &idv);
    float d[8], id[8];
    int32_t sum[8];
    __m256i s[8];
    _mm256_storeu_ps(d, dv);
    _mm256_storeu_ps(id, idv);
    for (int b = 0; b < 8; b++) s[b] = ar[b] = _mm256_setzero_si256();
    for (int b = 0; b < nb; b++) {
        if (bad >> b & 1) {   /* d = NaN, q = 0 */
            memset(h[b].q, 0, 32);
            ar[b] = _mm256_set1_epi32(0x7fc00000);
            continue;
        }
        __m256i s01, s23;
        quant32(x + 32 * b, _mm256_broadcast_ss(id + b), _mm256_broadcast_ss(d + b), keep_r, r + 32 * b, &ar[b], h[b].q,
                &s01, &s23);
        s[b] = _mm256_add_epi32(s01, s23);
    }
    _mm256_storeu_si256((__m256i *)sum, hsum8(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]));
    for (int b = 0; b < nb; b++) {
        h[b].d = bad >> b & 1 ? __builtin_nanf("") : d[b];
        h[b].sum = sum[b];
    }
}

/* nb <= 8 blocks of 32 values -> their hi (and lo) blocks */
INL void quantize_blocks32(const float *x, int nb, xblock32 *h, xblock32 *l, int halves) {
    __m256i am[8], ar[8];
    float r[256];
    for (int b = 0; b < 8; b++) {
        const float *xb = x + 32 * b;
        am[b] = _mm256_setzero_si256();
        if (b < nb)
            for (int k = 0; k < 4; k++) am[b] = _mm256_max_epi32(am[b], abs_bits(_mm256_loadu_ps(xb + 8 * k)));
    }
    quantize8(x, nb, max8(am), h, halves == 2, r, ar);
    if (halves == 2) quantize8(r, nb, max8(ar), l, 0, r, am);
}

/* one block of 256 values -> o (d, q, the sums per 16 and per 32, pad zeros); amax: the max of the values' bits with
 * the sign cleared in 8 lanes, or NULL (found here); keep_r: r = x - d v at r and its amax so at *ar (a non-finite
 * block's: NaN, so that its lo block is one too) */
INL void quantize256(const float *x, const __m256i *amax, xblock256 *o, int keep_r, float *r, __m256i *ar) {
    __m256i am = _mm256_setzero_si256(), s[16];
    if (amax) am = *amax;
    else for (int k = 0; k < 32; k++) am = _mm256_max_epi32(am, abs_bits(_mm256_loadu_ps(x + 8 * k)));
    if (keep_r) *ar = _mm256_setzero_si256();
    am = _mm256_max_epi32(am, _mm256_permute2x128_si256(am, am, 1));   /* the max in every lane */
    am = _mm256_max_epi32(am, _mm256_shuffle_epi32(am, 0x4e));
    am = _mm256_max_epi32(am, _mm256_shuffle_epi32(am, 0xb1));
    const int bad = nonfinite_lanes(am) != 0;
    __m256 d, id;
    scales_of(am, &d, &id);
    for (int g = 0; g < 8; g++) {
        if (bad) {
            memset(o->q + 32 * g, 0, 32);
            s[2 * g] = s[2 * g + 1] = _mm256_setzero_si256();
        } else {
            quant32(x + 32 * g, id, d, keep_r, r + 32 * g, ar, o->q + 32 * g, &s[2 * g], &s[2 * g + 1]);
        }
    }
    const __m256i lo = hsum8(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);          /* bsum[0..8) */
    const __m256i hi = hsum8(s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]);    /* bsum[8..16) */
    const __m256i s32 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xd8);     /* bsum32[0..8) */
    _mm256_storeu_si256((__m256i *)o->bsum, _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
    const __m256i p32 = _mm256_permute4x64_epi64(_mm256_packs_epi32(s32, s32), 0xd8);
    _mm_storeu_si128((__m128i *)o->bsum32, _mm256_castsi256_si128(p32));
    memset(o->pad, 0, sizeof o->pad);
    o->d = bad ? __builtin_nanf("") : _mm256_cvtss_f32(d);
    if (bad && keep_r) *ar = _mm256_set1_epi32(0x7fc00000);
}

AVX2 static void quantize_row(int qtype, const float *x, int64_t K, void *xq, int halves) {
    if (type_block(qtype) == 32) {
        const int64_t nb = K / 32;
        xblock32 *h = (xblock32 *)xq, *l = h + nb;   /* hi row, then (two halves) lo row */
        for (int64_t i = 0; i < nb; i += 8)
            quantize_blocks32(x + 32 * i, nb - i < 8 ? (int)(nb - i) : 8, h + i, l + i, halves);
    } else {
        const int64_t nb = K / 256;
        xblock256 *h = (xblock256 *)xq, *l = h + nb;
        float r[256];
        __m256i ar = _mm256_setzero_si256();
        for (int64_t i = 0; i < nb; i++) {
            quantize256(x + 256 * i, NULL, h + i, halves == 2, r, &ar);
            if (halves == 2) quantize256(r, &ar, l + i, 0, r, NULL);   /* a non-finite hi: r is never read */
        }
    }
}

/* the f16 at the start of each of 8 blocks (rows[r] + o), and the f16 after it (plain loads: a gather is slow) */
INL uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INL void scales8(const uint8_t *const *rows, int64_t o, __m256 *d, __m256 *m) {
    __m256i g = _mm256_setr_epi32((int)ld32(rows[0] + o), (int)ld32(rows[1] + o), (int)ld32(rows[2] + o),
                                  (int)ld32(rows[3] + o), (int)ld32(rows[4] + o), (int)ld32(rows[5] + o),
                                  (int)ld32(rows[6] + o), (int)ld32(rows[7] + o));
    g = _mm256_shuffle_epi8(g, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8,
                                                9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    g = _mm256_permute4x64_epi64(g, 0xd8);   /* d0..d7 | m0..m7 */
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(g));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(g, 1));
}

/* ======================================================================================================
 * 32-value types, "vertical": the 8 weight rows of a group side by side, row r in 32-bit lane r. Quad c of a
 * block (elements 4c..4c+3) of the 8 rows is one vector V_c; the x block's quad c, broadcast to every lane,
 * meets it in one maddubs; int16 adds over the quads and one madd leave lane r = row r's isum -- no horizontal
 * sums. Exact: a maddubs lane is at most 2*15*127 = 3810 (4-bit weights) or 2*31*127 = 7874 (5-bit), so 8 or 4
 * of them fit an int16 (6-bit K-quant weights: 2*63*127 = 16002, 2 fit; 8-bit: one, widened at once by madd).
 * Many x rows: a chunk of KC blocks unpacked into a buffer once, then met by every quantized row of the task's
 * tile, 4 at a time.
 * ==================================================================================================== */
#define KC 32
typedef struct {
    __m256i v[KC][8];   /* quad c of block kb, row r in lane r: 0..15 / 0..31 (offset folded out), or |w| (Q8_0) */
    __m256i s[KC][8];   /* Q8_0: w, for its signs */
    float d[KC][GROUP], m[KC][GROUP];
} ubuf32;

INL int32_t ld32s(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }
#define BQ(q, c) _mm256_set1_epi32(ld32s((q) + 4 * (c)))   /* x quad c in every lane */

/* the 16 bytes at rows[r] + o, r = 0..7 -> T0..T3: lane r of Tc = bytes 4c..4c+3 of row r */
INL void transpose8x4(const uint8_t *const *rows, int64_t o, __m256i *T0, __m256i *T1, __m256i *T2, __m256i *T3) {
    __m256i a = join(ld128(rows[0] + o), ld128(rows[4] + o)), b = join(ld128(rows[1] + o), ld128(rows[5] + o));
    __m256i c = join(ld128(rows[2] + o), ld128(rows[6] + o)), d = join(ld128(rows[3] + o), ld128(rows[7] + o));
    __m256i ab0 = _mm256_unpacklo_epi32(a, b), ab1 = _mm256_unpackhi_epi32(a, b);
    __m256i cd0 = _mm256_unpacklo_epi32(c, d), cd1 = _mm256_unpackhi_epi32(c, d);
    *T0 = _mm256_unpacklo_epi64(ab0, cd0);
    *T1 = _mm256_unpackhi_epi64(ab0, cd0);
    *T2 = _mm256_unpacklo_epi64(ab1, cd1);
    *T3 = _mm256_unpackhi_epi64(ab1, cd1);
}

/* fifth bits of quads 2k and 2k + 1: byte b of lane r = 16 if bit 8k + b (even) / 8k + 4 + b (odd) of qh (lane r
 * of QH). Byte k of each lane to all four of its bytes, then one bit per byte: the odd quad's bits are 16..128, so
 * min(v, 16); the even quad's 1..8, so (v + 15) & 16. */
INL void fifth_pair(__m256i QH, int k, __m256i *even, __m256i *odd) {
    const __m256i rep = _mm256_setr_epi8(k, k, k, k, 4 + k, 4 + k, 4 + k, 4 + k, 8 + k, 8 + k, 8 + k, 8 + k, 12 + k,
                                         12 + k, 12 + k, 12 + k, k, k, k, k, 4 + k, 4 + k, 4 + k, 4 + k, 8 + k, 8 + k,
                                         8 + k, 8 + k, 12 + k, 12 + k, 12 + k, 12 + k);
    const __m256i v = _mm256_shuffle_epi8(QH, rep), b16 = _mm256_set1_epi8(16);
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0x08040201));
    *even = _mm256_and_si256(_mm256_add_epi8(lo, _mm256_set1_epi8(15)), b16);
    *odd = _mm256_min_epu8(_mm256_and_si256(v, _mm256_set1_epi32((int)0x80402010)), b16);
}

/* packed (kernels.h: qh spread by quad, bit 8b + c of lane r = row r's bit 4c + b): quad c's fifth bits, 16 in byte b
 * of lane r where set -- one shift (none for quad 4) and a mask */
INL __m256i fifth_quad(__m256i QH, int c) {
    const __m256i s = c < 4 ? _mm256_slli_epi32(QH, 4 - c) : c > 4 ? _mm256_srli_epi32(QH, c - 4) : QH;
    return _mm256_and_si256(s, _mm256_set1_epi32(0x10101010));
}

/* quads c, c + 1 (the low nibbles of Ta, Tb) and c + 4, c + 5 (their high nibbles) of a 4/5-bit block on W-bit vectors
 * into new vectors v0, v1, v4, v5, the fifth bits of packed QH added where `five` (FQ: fifth_quad or fifth_quad16; f:
 * 15 in every byte) */
#define NIBBLE_QUADS(W, FQ, Ta, Tb, c, QH, f, five, v0, v1, v4, v5)                                              \
    __m##W##i v0 = _mm##W##_and_si##W(Ta, f), v1 = _mm##W##_and_si##W(Tb, f);                                    \
    __m##W##i v4 = _mm##W##_and_si##W(_mm##W##_srli_epi16(Ta, 4), f),                                            \
              v5 = _mm##W##_and_si##W(_mm##W##_srli_epi16(Tb, 4), f);                                            \
    if (five) {                                                                                                  \
        v0 = _mm##W##_or_si##W(v0, FQ(QH, c)); v1 = _mm##W##_or_si##W(v1, FQ(QH, (c) + 1));                      \
        v4 = _mm##W##_or_si##W(v4, FQ(QH, (c) + 4)); v5 = _mm##W##_or_si##W(v5, FQ(QH, (c) + 5));                \
    }

/* Block b (at o = b * tb in each row) of a group of 8 rows, in either layout: the file's rows (rows[r]), or packed
 * (kernels.h: the block at p = group + 8 o, a few plain loads). T0..T3: lane r of Tc = dword c of row r's 16
 * nibble bytes; QH (Q5_0, Q5_1): lane r = row r's qh; d, m: lane r = row r's f16 d, m as f32 (m: Q4_1, Q5_1). */
INL int packed_quants(int t) { return t == T_Q4_0 || t == T_Q8_0 ? 16 : t == T_Q4_1 ? 32 : t == T_Q5_0 ? 48 : 64; }
INL void block32(int t, int pk, const uint8_t *const *rows, const uint8_t *p, int64_t o, __m256i *T0, __m256i *T1,
                 __m256i *T2, __m256i *T3, __m256i *QH, __m256 *d, __m256 *m) {
    const int five = t == T_Q5_0 || t == T_Q5_1;
    if (pk) {
        const int pq = packed_quants(t);
        *T0 = ld256(p + pq); *T1 = ld256(p + pq + 32); *T2 = ld256(p + pq + 64); *T3 = ld256(p + pq + 96);
        if (five) *QH = ld256(p + (t == T_Q5_0 ? 16 : 32));
        *d = _mm256_cvtph_ps(ld128(p));
        *m = t == T_Q4_1 || t == T_Q5_1 ? _mm256_cvtph_ps(ld128(p + 16)) : *d;
        return;
    }
    const int qo = t == T_Q4_0 ? 2 : t == T_Q4_1 ? 4 : t == T_Q5_0 ? 6 : 8, ho = o + (t == T_Q5_0 ? 2 : 4);
    transpose8x4(rows, o + qo, T0, T1, T2, T3);
    if (five)
        *QH = _mm256_setr_epi32(ld32s(rows[0] + ho), ld32s(rows[1] + ho), ld32s(rows[2] + ho), ld32s(rows[3] + ho),
                                ld32s(rows[4] + ho), ld32s(rows[5] + ho), ld32s(rows[6] + ho), ld32s(rows[7] + ho));
    scales8(rows, o, d, m);
}

/* the 8 rows' 4/5-bit block at offset o -> V0..V7 (quad c: elements 4c..4c+3; low nibbles of the 16 bytes are
 * elements 0..15, high nibbles 16..31) */
#define WQUADS(t, pk, rows, p, o, d, m)                                                                     \
    __m256i V0, V1, V2, V3, V4, V5, V6, V7;                                                                    \
    {                                                                                                          \
        const __m256i f_ = _mm256_set1_epi8(15);                                                               \
        __m256i QH = _mm256_setzero_si256();                                                                   \
        block32(t, pk, rows, p, o, &V0, &V1, &V2, &V3, &QH, &d, &m);                                           \
        V4 = _mm256_and_si256(_mm256_srli_epi16(V0, 4), f_); V0 = _mm256_and_si256(V0, f_);                    \
        V5 = _mm256_and_si256(_mm256_srli_epi16(V1, 4), f_); V1 = _mm256_and_si256(V1, f_);                    \
        V6 = _mm256_and_si256(_mm256_srli_epi16(V2, 4), f_); V2 = _mm256_and_si256(V2, f_);                    \
        V7 = _mm256_and_si256(_mm256_srli_epi16(V3, 4), f_); V3 = _mm256_and_si256(V3, f_);                    \
        if ((t == T_Q5_0 || t == T_Q5_1) && pk) {                                                              \
            V0 = _mm256_or_si256(V0, fifth_quad(QH, 0)); V1 = _mm256_or_si256(V1, fifth_quad(QH, 1));          \
            V2 = _mm256_or_si256(V2, fifth_quad(QH, 2)); V3 = _mm256_or_si256(V3, fifth_quad(QH, 3));          \
            V4 = _mm256_or_si256(V4, fifth_quad(QH, 4)); V5 = _mm256_or_si256(V5, fifth_quad(QH, 5));          \
            V6 = _mm256_or_si256(V6, fifth_quad(QH, 6)); V7 = _mm256_or_si256(V7, fifth_quad(QH, 7));          \
        } else if (t == T_Q5_0 || t == T_Q5_1) {                                                               \
            __m256i e_, o_;                                                                                    \
            fifth_pair(QH, 0, &e_, &o_); V0 = _mm256_or_si256(V0, e_); V1 = _mm256_or_si256(V1, o_);           \
            fifth_pair(QH, 1, &e_, &o_); V2 = _mm256_or_si256(V2, e_); V3 = _mm256_or_si256(V3, o_);           \
            fifth_pair(QH, 2, &e_, &o_); V4 = _mm256_or_si256(V4, e_); V5 = _mm256_or_si256(V5, o_);           \
            fifth_pair(QH, 3, &e_, &o_); V6 = _mm256_or_si256(V6, e_); V7 = _mm256_or_si256(V7, o_);           \
        }                                                                                                      \
    }

/* the 8 rows' pointers to the 32 quant bytes of a packed Q8_0 block at p */
INL void q8_rows(const uint8_t *p, const uint8_t **pr) { for (int r = 0; r < GROUP; r++) pr[r] = p + 16 + 32 * r; }

/* Chunk blocks b0.. of a group into a buffer: quad c of block kb at v[(8 kb + c) step] (Q8_0: its signs at s), the
 * 8 rows' d and m at d, m + 8 kb step. step 1: ubuf32; step 2: one half of a pair of groups (avx512vnni's 16-row
 * tile: the two groups' vectors side by side, one 512-bit load). biased: Q8_0's weights as w + 128 (unsigned bytes;
 * the 128 sum q is taken off as Q4_0's 8 sum q is) for a path without sign_epi8. */
INL void unpack32_to(int t, int pk, const uint8_t *const *rows, const uint8_t *g, int64_t b0, int nkb, __m256i *v,
                     __m256i *s, float *dd, float *mm, int step, int biased) {
    const int tb = type_bytes(t);
    for (int kb = 0; kb < nkb; kb++) {
        const int64_t o = (b0 + kb) * tb;
        const uint8_t *p = g + GROUP * o;   /* packed: the block of the 8 rows */
        if (pk) for (int c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)p + GROUP * PREFETCH + c);
        else for (int r = 0; r < GROUP; r++) PREFETCH_W((const char *)rows[r] + o + PREFETCH);
        __m256 d, m;
        if (t == T_Q8_0) {
            const uint8_t *pr[GROUP];
            if (pk) q8_rows(p, pr);
            const uint8_t *const *qr = pk ? pr : rows;
            const int64_t qo = pk ? 0 : o + 2;
            __m256i W0, W1, W2, W3, W4, W5, W6, W7;
            transpose8x4(qr, qo, &W0, &W1, &W2, &W3);
            transpose8x4(qr, qo + 16, &W4, &W5, &W6, &W7);
#define ST(c) if (biased) v[(8 * kb + c) * step] = _mm256_xor_si256(W##c, _mm256_set1_epi8((char)0x80)); \
              else { s[(8 * kb + c) * step] = W##c; v[(8 * kb + c) * step] = _mm256_abs_epi8(W##c); }
            ST(0) ST(1) ST(2) ST(3) ST(4) ST(5) ST(6) ST(7)
#undef ST
            if (pk) d = m = _mm256_cvtph_ps(ld128(p));
            else scales8(rows, o, &d, &m);
        } else {
            WQUADS(t, pk, rows, p, o, d, m)
            __m256i *w = v + 8 * kb * step;
            w[0] = V0; w[step] = V1; w[2 * step] = V2; w[3 * step] = V3;
            w[4 * step] = V4; w[5 * step] = V5; w[6 * step] = V6; w[7 * step] = V7;
        }
        _mm256_storeu_ps(dd + 8 * kb * step, d);
        _mm256_storeu_ps(mm + 8 * kb * step, m);
    }
}
INL void unpack32(int t, int pk, const uint8_t *const *rows, const uint8_t *g, int64_t b0, int nkb, ubuf32 *u) {
    unpack32_to(t, pk, rows, g, b0, nkb, &u->v[0][0], &u->s[0][0], &u->d[0][0], &u->m[0][0], 1, 0);
}

/* Accumulators against a chunk, block after block. One group (ng = 1): x half-rows x0..x(nx-1) (nx = 2 or 4)
 * against u0, accumulator k = half-row k. Two groups (ng = 2, nx = 2: a 16-row tile): half-rows x0, x1 against u0
 * (accumulators 0, 1) and u1 (2, 3) -- each x quad broadcast once for both groups' weights. */
#define XK(k) (ng == 2 ? ((k) & 1 ? x1 : x0) : (k) == 0 ? x0 : (k) == 1 ? x1 : (k) == 2 ? x2 : x3)
#define BK(k) (ng == 2 ? ((k) & 1 ? b1 : b0) : (k) == 0 ? b0 : (k) == 1 ? b1 : (k) == 2 ? b2 : b3)
#define UK(k) (ng == 2 && (k) >= 2 ? u1 : u0)
INL void dot32_chunk(int t, const ubuf32 *u0, const ubuf32 *u1, int nkb, int ng, int nx, const xblock32 *x0,
                     const xblock32 *x1, const xblock32 *x2, const xblock32 *x3, __m256 *a0, __m256 *a1, __m256 *a2,
                     __m256 *a3) {
    const int off = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0, bits = weight_bits(t), four = ng == 2 || nx > 2;
    const __m256i z = _mm256_setzero_si256();
    __m256 f0 = *a0, f1 = *a1, f2 = four ? *a2 : _mm256_setzero_ps(), f3 = four ? *a3 : _mm256_setzero_ps();
    for (int kb = 0; kb < nkb; kb++, x0++, x1++, x2++, x3++) {
        __m256i i0 = z, i1 = z, i2 = z, i3 = z;
        if (bits == 8) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m256i w0 = u0->v[kb][c], s0 = u0->s[kb][c], w1 = ng == 2 ? u1->v[kb][c] : w0,
                              s1 = ng == 2 ? u1->s[kb][c] : s0;
                const __m256i b0 = BQ(x0->q, c), b1 = BQ(x1->q, c), b2 = nx > 2 ? BQ(x2->q, c) : b0,
                              b3 = nx > 2 ? BQ(x3->q, c) : b1;
#define P(k) i##k = DOT32(i##k, ng == 2 && (k) >= 2 ? w1 : w0, _mm256_sign_epi8(BK(k), ng == 2 && (k) >= 2 ? s1 : s0)); \
             REG(i##k);
                P(0) P(1) if (four) { P(2) P(3) }
#undef P
            }
        } else {
            /* AVX2, 4-bit: all 8 quads in int16 lanes; 5-bit: quads 0..3 and 4..7 apart. VNNI: all in int32 */
            __m256i h0 = z, h1 = z, h2 = z, h3 = z;
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m256i w0 = u0->v[kb][c], w1 = ng == 2 ? u1->v[kb][c] : w0;
                const __m256i b0 = BQ(x0->q, c), b1 = BQ(x1->q, c), b2 = nx > 2 ? BQ(x2->q, c) : b0,
                              b3 = nx > 2 ? BQ(x3->q, c) : b1;
#define P(k) { const __m256i w_ = ng == 2 && (k) >= 2 ? w1 : w0;                                                  \
               if (bits == 5 && c >= 4 && !VNNI) { h##k = DOTACC(h##k, w_, BK(k)); REG(h##k); }                      \
               else { i##k = DOTACC(i##k, w_, BK(k)); REG(i##k); } }
                P(0) P(1) if (four) { P(2) P(3) }
#undef P
            }
#define R(k) i##k = bits == 4 || VNNI ? SUM32(i##k) : _mm256_add_epi32(SUM32(i##k), SUM32(h##k));
            R(0) R(1) if (four) { R(2) R(3) }
#undef R
        }
#define C(k)                                                                                             \
        {                                                                                                \
            const xblock32 *x_ = XK(k);                                                                  \
            const __m256 d = _mm256_loadu_ps(UK(k)->d[kb]), dx = _mm256_set1_ps(x_->d);                  \
            if (off) i##k = _mm256_sub_epi32(i##k, OFF_SUM(256, off, x_->sum));                           \
            if (t == T_Q4_1 || t == T_Q5_1)                                                              \
                COMBINE_DM(v8, f##k, d, _mm256_loadu_ps(UK(k)->m[kb]), dx, i##k, _mm256_set1_epi32(x_->sum)); \
            else COMBINE_D(v8, f##k, d, dx, i##k);                                                       \
        }
        C(0) C(1) if (four) { C(2) C(3) }
#undef C
    }
    *a0 = f0; *a1 = f1;
    if (four) { *a2 = f2; *a3 = f3; }
}
#undef XK
#undef BK
#undef UK

#if VNNI == 2
/* ======================================================================================================
 * avx512vnni, many x rows: the 16-row tile. A pair of groups' chunk side by side (quad c of block kb of group h at
 * v[kb][c][h]), so that one 512-bit vpdpbusd meets both groups' 8 rows with an x quad broadcast to its 16 lanes; the
 * float update of kernels.h on 16 lanes (v16_*: the same IEEE operations per lane). A lone last group is paired with
 * itself (its second half unused).
 * ==================================================================================================== */
#define v16_add(a, b) _mm512_add_ps(a, b)
#define v16_sub(a, b) _mm512_sub_ps(a, b)
#define v16_mul(a, b) _mm512_mul_ps(a, b)
#define v16_cvt(i) _mm512_cvtepi32_ps(i)
INL __m512i ld512(const void *p) { return _mm512_loadu_si512(p); }
#define BQ16(q, c) _mm512_set1_epi32(ld32s((q) + 4 * (c)))   /* x quad c in all 16 lanes */

typedef struct {
    __m256i v[KC][8][2];   /* as ubuf32's v, two groups; Q8_0: w + 128 (unsigned) */
    float d[KC][2][GROUP], m[KC][2][GROUP];
} ubuf32x2;

/* a block's float step on 16 lanes for x block X: f + the update of kernels.h from the weights' d (and m: Q4_1,
 * Q5_1) and s, the sum of u q over the block (u the unsigned weight: the offset, Q8_0's bias of 128 too, taken off
 * here as off * sum q) */
INL void step16(int t, __m512 *f, __m512 d, __m512 m, const xblock32 *X, __m512i s) {
    const int off = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : t == T_Q8_0 ? 128 : 0;
    const __m512 dx = _mm512_set1_ps(X->d);
    if (off) s = _mm512_sub_epi32(s, OFF_SUM(512, off, X->sum));
    if (t == T_Q4_1 || t == T_Q5_1) COMBINE_DM(v16, *f, d, m, dx, s, _mm512_set1_epi32(X->sum));
    else COMBINE_D(v16, *f, d, dx, s);
}
#define BLOCK_DM(t, u, kb)                                                                                        \
    const __m512 d = _mm512_loadu_ps((u)->d[kb]),                                                                 \
                 m = (t) == T_Q4_1 || (t) == T_Q5_1 ? _mm512_loadu_ps((u)->m[kb]) : d;

/* x half-rows x0..x(nx-1) (nx = 2 or 4) against one pair's chunk u (np2 = 1), accumulator a[k] = half-row k, or
 * against two pairs' chunks u, w at once (np2 = 2: a 32-row tile; c[k] against w), each x quad broadcast once for
 * both: half the loads per vpdpbusd (dotk_chunk16) */
INL void dot32_chunk16(int t, int np2, const ubuf32x2 *u, const ubuf32x2 *w, int nkb, int nx, const xblock32 *x0,
                       const xblock32 *x1, const xblock32 *x2, const xblock32 *x3, __m512 *a, __m512 *c) {
    const int four = nx > 2, two = np2 == 2;
    const __m512i z = _mm512_setzero_si512();
    __m512 f0 = a[0], f1 = a[1], f2 = four ? a[2] : _mm512_setzero_ps(), f3 = four ? a[3] : _mm512_setzero_ps();
    __m512 g0 = two ? c[0] : f0, g1 = two ? c[1] : f1, g2 = two && four ? c[2] : f2, g3 = two && four ? c[3] : f3;
    for (int kb = 0; kb < nkb; kb++, x0++, x1++, x2++, x3++) {
        __m512i i0 = z, i1 = z, i2 = z, i3 = z, r0 = z, r1 = z, r2 = z, r3 = z;
#define DP(s, V, B) s = _mm512_dpbusd_epi32(s, V, B); REG(s);
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const __m512i V = ld512(u->v[kb][q]);
            __m512i B0 = BQ16(x0->q, q), B1 = BQ16(x1->q, q), B2 = four ? BQ16(x2->q, q) : B0,
                    B3 = four ? BQ16(x3->q, q) : B1;
            REG(B0); REG(B1); if (four) { REG(B2); REG(B3); }
            DP(i0, V, B0) DP(i1, V, B1) if (four) { DP(i2, V, B2) DP(i3, V, B3) }
            if (two) {
                const __m512i W = ld512(w->v[kb][q]);
                DP(r0, W, B0) DP(r1, W, B1) if (four) { DP(r2, W, B2) DP(r3, W, B3) }
            }
        }
#undef DP
        {
            BLOCK_DM(t, u, kb)
            step16(t, &f0, d, m, x0, i0);
            step16(t, &f1, d, m, x1, i1);
            if (four) { step16(t, &f2, d, m, x2, i2); step16(t, &f3, d, m, x3, i3); }
        }
        if (two) {
            BLOCK_DM(t, w, kb)
            step16(t, &g0, d, m, x0, r0);
            step16(t, &g1, d, m, x1, r1);
            if (four) { step16(t, &g2, d, m, x2, r2); step16(t, &g3, d, m, x3, r3); }
        }
    }
    a[0] = f0; a[1] = f1;
    if (four) { a[2] = f2; a[3] = f3; }
    if (two) {
        c[0] = g0; c[1] = g1;
        if (four) { c[2] = g2; c[3] = g3; }
    }
}

#if AMX
/* The tile registers as amx_chunk16 uses them, two sets for blocks in turn (even: tmm0, 2, 4; odd: 1, 3, 5): C
 * [16 half-rows][16 weight rows] int32; A, the 16 half-rows' 32 int8 q of one block; B, the pair's unpacked block as
 * dot32_chunk16 reads it (8 quads x 16 rows, 4 unsigned bytes each: u->v[kb] as it lies). The K-quants' (amx_superk)
 * are whole tiles: C as above, A 16 half-rows x 64 values, B 16 quads x 16 rows. Loaded when the kind changes (the
 * config is the thread's state). */
enum { AMX_TILES32 = 1, AMX_TILESK = 2 };
static __thread int amx_configured;
INL void amx_configure(int kind) {
    if (amx_configured == kind) return;
    struct { uint8_t palette, start_row, zero[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int s = 0; s < 8; s++) { cfg.colsb[s] = 64; cfg.rows[s] = 16; }
    if (kind == AMX_TILES32)
        for (int s = 0; s < 2; s++) {   /* A 32 values, B 8 quads; tmm6, 7 unused */
            cfg.colsb[2 + s] = 32; cfg.rows[4 + s] = 8; cfg.colsb[6 + s] = 0; cfg.rows[6 + s] = 0;
        }
    _tile_loadconfig(&cfg);
    amx_configured = kind;
}

/* Signed weights (amx_signed: Q4_0, Q5_0, Q8_0): a copy of the pair's chunk with the offset taken off each byte
 * (u - 8 | 16; Q8_0's w + 128 back to w), met by tdpbssd, gives isum itself: no off * sum q per step */
INL int amx_signed(int t) { return t == T_Q4_0 || t == T_Q5_0 || t == T_Q8_0; }
INL void amx_sign_chunk(int t, const ubuf32x2 *u, int nkb, __m512i (*sv)[8]) {
    const __m512i off = _mm512_set1_epi8((char)(t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 128));
    for (int kb = 0; kb < nkb; kb++)
        for (int c = 0; c < 8; c++) sv[kb][c] = _mm512_sub_epi8(ld512(u->v[kb][c]), off);
}

/* block kb's float steps for 16 half-rows (x as amx_chunk16's), from its integers c [half-row][weight row] */
INL void amx_combine(int t, const ubuf32x2 *u, int kb, const xblock32 *x, int64_t xrb, const int32_t (*c)[16],
                     __m512 *acc) {
    BLOCK_DM(t, u, kb)
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        const xblock32 *X = (const xblock32 *)((const char *)x + i * xrb) + kb;
        if (amx_signed(t)) COMBINE_D(v16, acc[i], d, _mm512_set1_ps(X->d), _mm512_load_si512(c[i]));
        else step16(t, &acc[i], d, m, X, _mm512_load_si512(c[i]));
    }
}

/* amx: 16 quantized half-rows (x: the first one's blocks from the chunk's first, the others xrb bytes apart)
 * against the pair's chunk, accumulator i = half-row i. Per block the integers of dot32_chunk16 -- sum over the
 * block's 32 values of x.q (signed) times u (unsigned), one tdpbsud for all 16 x 16 -- then its float steps, the
 * same operations in the same order, so the same bits. A pipeline over the blocks, two products in flight: block
 * kb's tile is stored, block kb + 2's product starts in its registers, then block kb - 1's floats are made from what
 * was stored a step before (the tile unit keeps its order, and a tile's store is read back only once it has landed;
 * four in flight measured no faster). */
#define AMX_BLOCK(C, A, B, kb)                                                                                   \
    {                                                                                                            \
        _tile_zero(C); _tile_loadd(A, x[kb].q, xrb);                                                             \
        if (amx_signed(t)) { _tile_loadd(B, sv[kb], 64); _tile_dpbssd(C, A, B); }                               \
        else { _tile_loadd(B, u->v[kb], 64); _tile_dpbsud(C, A, B); }                                            \
    }
INL void amx_chunk16(int t, const ubuf32x2 *u, const __m512i (*sv)[8], int nkb, const xblock32 *x, int64_t xrb,
                     __m512 *acc) {
    int32_t c[3][16][16] __attribute__((aligned(64)));
    __asm__ volatile("" ::: "memory");   /* the tile loads read u and x: what was stored there is stored */
    AMX_BLOCK(0, 2, 4, 0)
    if (nkb > 1) AMX_BLOCK(1, 3, 5, 1)
    for (int kb = 0; kb < nkb; kb++) {
        if (kb % 2 == 0) {
            _tile_stored(0, c[kb % 3], 64);
            if (kb + 2 < nkb) AMX_BLOCK(0, 2, 4, kb + 2)
        } else {
            _tile_stored(1, c[kb % 3], 64);
            if (kb + 2 < nkb) AMX_BLOCK(1, 3, 5, kb + 2)
        }
        if (kb > 0) amx_combine(t, u, kb - 1, x, xrb, c[(kb - 1) % 3], acc);
    }
    amx_combine(t, u, nkb - 1, x, xrb, c[(nkb - 1) % 3], acc);
}
#undef AMX_BLOCK
#endif
#endif

/* few x rows, 4/5-bit weights: each block of the 8 rows unpacked on the fly, met by the x row's hi (and, if
 * two, lo) half quad by quad as it is made (few live vectors); returns acc_hi (+ acc_lo) */
INL __m256 dot32v_direct(int t, int two, int pk, const uint8_t *const *rows, const xblock32 *xh, const xblock32 *xl,
                         int64_t nb, int64_t pf) {
    const int tb = type_bytes(t), off = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0, five = weight_bits(t) == 5;
    const __m256i f = _mm256_set1_epi8(15), z = _mm256_setzero_si256();
    __m256 acc_hi = _mm256_setzero_ps(), acc_lo = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, xh++, xl++) {
        const int64_t o = b * tb;
        const uint8_t *p = rows[0] + GROUP * o;   /* packed: the block of the 8 rows (rows[0]: the group) */
        /* the next group (pf bytes on) is one contiguous stretch in both layouts: prefetch it as fast as this one
         * is read */
        for (int64_t c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)p + pf + c);
        __m256i T0, T1, T2, T3, QH = z;
        __m256 d, m;
        block32(t, pk, rows, p, o, &T0, &T1, &T2, &T3, &QH, &d, &m);
        /* AVX2's int16 sums: 4-bit, all 8 quads in ha / la; 5-bit, quads 0 1 4 5 there, 2 3 6 7 in hb / lb */
        __m256i ha = z, la = z, hb = z, lb = z;
#define QUAD(V, c, H, L)                                                                     \
        H = DOTACC(H, V, BQ(xh->q, c)); REG(H);                                              \
        if (two) { L = DOTACC(L, V, BQ(xl->q, c)); REG(L); }
#define PAIR(Ta, Tb, c, H, L)   /* quads c, c + 1 (low nibbles) and c + 4, c + 5 (high) */    \
        {                                                                                    \
            NIBBLE_QUADS(256, fifth_quad, Ta, Tb, c, QH, f, five && pk, v0, v1, v4, v5)      \
            if (five && !pk) {                                                               \
                __m256i e, d;                                                                \
                fifth_pair(QH, (c) / 2, &e, &d); v0 = _mm256_or_si256(v0, e); v1 = _mm256_or_si256(v1, d); \
                fifth_pair(QH, (c) / 2 + 2, &e, &d); v4 = _mm256_or_si256(v4, e); v5 = _mm256_or_si256(v5, d); \
            }                                                                                \
            QUAD(v0, c, H, L) QUAD(v1, c + 1, H, L) QUAD(v4, c + 4, H, L) QUAD(v5, c + 5, H, L) \
        }
        PAIR(T0, T1, 0, ha, la)
        if (five) { PAIR(T2, T3, 2, hb, lb) } else { PAIR(T2, T3, 2, ha, la) }
#undef PAIR
#undef QUAD
#define HALF(HA, HB, X, ACC)                                                                            \
        {                                                                                               \
            __m256i i = SUM32(HA);                                                                      \
            if (five) i = _mm256_add_epi32(i, SUM32(HB));                                               \
            HALF_STEP(256, v8, ACC, i, X, off, t == T_Q4_1 || t == T_Q5_1, d, m)                         \
        }
        HALF(ha, hb, xh, acc_hi)
        if (two) HALF(la, lb, xl, acc_lo)
#undef HALF
    }
    return two ? _mm256_add_ps(acc_hi, acc_lo) : acc_hi;
}

#if VNNI < 2
/* few x rows on 256-bit vectors, packed 4/5-bit weights: nr (2 to 4) x rows at once, x[2r] and x[2r + 1] the halves
 * of row r (hi, lo). Each block of the group's 8 rows is loaded and unpacked once for all of them; each half-row's
 * integer sums (AVX2: the int16 runs of dot32v_direct) and float steps are as it has them alone; out[r] = acc_hi +
 * acc_lo of row r. */
INL void dot32v_rows(int t, int two, int nr, const uint8_t *g, const xblock32 *const *x, int64_t nb, int64_t pf,
                     __m256 *out) {
    const int tb = type_bytes(t), off = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0, five = weight_bits(t) == 5;
    const int dm = t == T_Q4_1 || t == T_Q5_1, nh = 2 * nr, split = five && !VNNI;
    const __m256i f = _mm256_set1_epi8(15), z = _mm256_setzero_si256();
    __m256 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < nh; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t o = b * tb;
        const uint8_t *p = g + GROUP * o;
        for (int64_t c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)p + pf + c);
        __m256i T0, T1, T2, T3, QH = z;
        __m256 d, m;
        block32(t, 1, NULL, p, o, &T0, &T1, &T2, &T3, &QH, &d, &m);
        __m256i s[8], h[8];   /* h: AVX2's 5-bit int16 run of quads 2 3 6 7 */
#pragma GCC unroll 8
        for (int k = 0; k < nh; k++) s[k] = h[k] = z;
#define QUAD(V, c, S)                                                                   \
        _Pragma("GCC unroll 8") for (int k = 0; k < nh; k++)                            \
            if (two || !(k & 1)) { S[k] = DOTACC(S[k], V, BQ(x[k][b].q, c)); REG(S[k]); }
#define PAIR(Ta, Tb, c, S)   /* quads c, c + 1 (low nibbles) and c + 4, c + 5 (high) */  \
        {                                                                               \
            NIBBLE_QUADS(256, fifth_quad, Ta, Tb, c, QH, f, five, v0, v1, v4, v5)       \
            QUAD(v0, c, S) QUAD(v1, c + 1, S) QUAD(v4, c + 4, S) QUAD(v5, c + 5, S)     \
        }
        PAIR(T0, T1, 0, s)
        if (split) { PAIR(T2, T3, 2, h) } else { PAIR(T2, T3, 2, s) }
#undef PAIR
#undef QUAD
#pragma GCC unroll 8
        for (int k = 0; k < nh; k++) {
            if (!two && (k & 1)) continue;
            const xblock32 *X = &x[k][b];
            __m256i i = SUM32(s[k]);
            if (split) i = _mm256_add_epi32(i, SUM32(h[k]));
            HALF_STEP(256, v8, acc[k], i, X, off, dm, d, m)
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) out[r] = two ? _mm256_add_ps(acc[2 * r], acc[2 * r + 1]) : acc[2 * r];
}
#endif

/* ---- few x rows, Q8_0: row by row (the vertical layout would cost a full transpose and one madd per quad for
 * 2 x halves), one maddubs per row-block and x half, summed across rows by rowsums8 ---- */
INL __m256i dot_direct(__m256i w, __m256i xv) {
    return DOTACC(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
}

/* one x row's hi (and, if two, lo) half against 8 weight rows, each block's weights loaded once for both:
 * returns acc_hi (+ acc_lo) */
INL __m256 q8_direct(int two, int pk, const uint8_t *const *rows, const xblock32 *xh, const xblock32 *xl, int64_t nb,
                     int64_t pf) {
    const int tb = type_bytes(T_Q8_0);
    __m256 acc_hi = _mm256_setzero_ps(), acc_lo = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, xh++, xl++) {
        const int64_t o = b * tb;
        const __m256i xvh = ld256(xh->q);
        /* the next group's 8 rows are one contiguous stretch: prefetch it front to back, 8 blocks' worth of
         * bytes per step, as fast as this group is read */
        for (int64_t c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)rows[0] + pf + GROUP * o + c);
        const uint8_t *p = rows[0] + GROUP * o;   /* packed: d[8], then the 8 rows' 32 bytes */
#define ROW(r) const __m256i w##r = pk ? ld256(p + 16 + 32 * r) : ld256(rows[r] + o + 2);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
#define D(x) rowsums8(dot_direct(w0, x), dot_direct(w1, x), dot_direct(w2, x), dot_direct(w3, x), \
                      dot_direct(w4, x), dot_direct(w5, x), dot_direct(w6, x), dot_direct(w7, x))
        __m256 d, m;
        if (pk) d = _mm256_cvtph_ps(ld128(p));
        else scales8(rows, o, &d, &m);
        const __m256i isum_h = D(xvh);
        COMBINE_D(v8, acc_hi, d, _mm256_set1_ps(xh->d), isum_h);
        if (two) {
            const __m256i xvl = ld256(xl->q), isum_l = D(xvl);
            COMBINE_D(v8, acc_lo, d, _mm256_set1_ps(xl->d), isum_l);
        }
#undef D
    }
    return two ? _mm256_add_ps(acc_hi, acc_lo) : acc_hi;
}

/* ======================================================================================================
 * K-quants, many x rows: super-blocks of the 8 rows unpacked once, vertically as for the 32-value types
 * (quad e/4 of the 256 values, row r in lane r), with per-sub-block scale vectors; then every x row of the tile,
 * up to 4 at a time. A sub-block's quads go through maddubs and int16 adds (4-bit: 8 fit; 5-bit: 4; 6-bit: 4, its
 * offset taken off in int16: k6off below), then one madd with the scale vector (lane r: row r's scale in both
 * int16) adds it to the int32 A. A task's TGK(t) groups, KS(t) super-blocks of each unpacked at a time (KUNITS
 * units of ~2.7 KB in all, so that they stay in L1), are met by each pass of x rows in turn: the x rows and Q6_K's
 * offsets of a pass are read and made once for all of them. Q6_K: 8 groups of 1 super-block, its offsets shared by
 * 4 pairs (measured, 2 threads, 64-256 rows, real ffn_down: +5-8% against 2 groups of 4); Q4_K/Q5_K: 2 of 4
 * (avx512vnni from 16 rows: 4 of 2, its two pairs met at once). The AMX tiles (from 16 x rows): 8 of 1 for all
 * three, so that each pass's x tiles are met by 4 pairs in turn (measured, 1 thread, 256 rows: Q4_K, Q5_K 6-8%
 * faster than 2 of 4; at 8 rows, on 512-bit VNNI, 2 of 4 stays: 10% faster on Qwen2.5-7B's ffn_down), and tiles
 * of MTILE_K x rows, each pair's planes met by twice the passes (2 threads, 256 rows, Qwen2.5-7B's shapes: Q4_K
 * 10-18%, Q6_K 13% faster than 64 rows; 256 rows: Q6_K's ffn_down faster still, Q4_K's slower).
 * ==================================================================================================== */
typedef struct {          /* one super-block of a group's 8 rows, unpacked */
    __m256i v[64];        /* quad e/4: 0..15 / 0..31 / 0..63 */
    __m256i sc[16];       /* Q4_K/Q5_K: sub-block j's scale (j < 8); Q6_K: sub-block i's; int16 twice per lane
                           * (VNNI: int32) */
    __m256i corr[4];      /* Q4_K/Q5_K: (mn_2k, mn_2k+1), k < 4: int16 pairs */
    float d[GROUP], dmin[GROUP];
} ubufk;                  /* 2.7 KB */
#define KUNITS 8          /* unpacked super-blocks of a task: TGK(t) groups of KS(t) (~22 KB: they stay in L1) */
#define KS_MAX 4
#define MTILE_K (AMX ? 2 * MTILE : MTILE)   /* x rows of a tile, the 256-value types (mm_job_plan) */
INL int KS(int t) { return t == T_Q6_K ? 1 : KS_MAX; }   /* super-blocks per chunk */
#define TGK(t) (KUNITS / KS(t))                           /* weight groups per task (task_groups) */

INL __m256 halves8(const uint8_t *const *rows, int64_t o) {   /* the f16 at rows[r] + o, r = 0..7 */
    __m128i h = _mm_setr_epi16((short)rd16(rows[0] + o), (short)rd16(rows[1] + o), (short)rd16(rows[2] + o),
                               (short)rd16(rows[3] + o), (short)rd16(rows[4] + o), (short)rd16(rows[5] + o),
                               (short)rd16(rows[6] + o), (short)rd16(rows[7] + o));
    return _mm256_cvtph_ps(h);
}

/* the n dwords at rows[r] + o (n a multiple of 4) -> T[0..n): lane r of T[p] = dword p of row r */
INL void transpose8xn(const uint8_t *const *rows, int64_t o, int n, __m256i *T) {
    for (int p = 0; p < n; p += 4) transpose8x4(rows, o + 4 * p, &T[p], &T[p + 1], &T[p + 2], &T[p + 3]);
}

/* The n dwords at byte f of super-block o's rows, in either layout: lane r of T[k] = dword k of row r. The file's
 * rows (rows[r] + o + f; n rounded up to 4), or packed (kernels.h: the block of the 8 rows at p, byte f's dwords
 * side by side at 8 f -- plain loads). */
INL void kdwords(int pk, const uint8_t *const *rows, const uint8_t *p, int64_t o, int f, int n, __m256i *T) {
    if (pk) for (int k = 0; k < n; k++) T[k] = ld256(p + 8 * f + 32 * k);
    else transpose8xn(rows, o + f, (n + 3) / 4 * 4, T);
}

/* the 8 rows' f16 d (and dmin: Q4_K, Q5_K) of super-block o as f32 */
INL void kscales_d(int t, int pk, const uint8_t *const *rows, const uint8_t *p, int64_t o, __m256 *d, __m256 *dmin) {
    if (t == T_Q6_K) {
        *d = pk ? _mm256_cvtph_ps(ld128(p + 8 * 208)) : halves8(rows, o + 208);
        *dmin = _mm256_setzero_ps();
    } else if (pk) {
        *d = _mm256_cvtph_ps(ld128(p));
        *dmin = _mm256_cvtph_ps(ld128(p + 16));
    } else {
        scales8(rows, o, d, dmin);
    }
}

/* each dword lane of v -> its bytes i0..i3 (0..3; -1: a zero byte); constant arguments: one shuffle */
#define LB_(l, i) ((i) < 0 ? -1 : 4 * (l) + (i))
#define LB4_(l, a, b, c, d) LB_(l, a), LB_(l, b), LB_(l, c), LB_(l, d)
#define LB16_(a, b, c, d) LB4_(0, a, b, c, d), LB4_(1, a, b, c, d), LB4_(2, a, b, c, d), LB4_(3, a, b, c, d)
INL __m128i lane_pattern(int i0, int i1, int i2, int i3) { return _mm_setr_epi8(LB16_(i0, i1, i2, i3)); }
INL __m256i lane_bytes(__m256i v, int i0, int i1, int i2, int i3) {
    return _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(lane_pattern(i0, i1, i2, i3)));
}
#undef LB16_
#undef LB4_
#undef LB_

/* the scale vectors of super-block o of the 8 rows (ubufk's sc, corr; lane r: row r), with vector ops: Q4_K/Q5_K,
 * kscales on the 12 bytes at 4 (lanes of U[0..2]); Q6_K, the 16 int8 at 192 (lanes of U[0..3]), sign-extended */
INL void kscale_vecs(int t, int pk, const uint8_t *const *rows, const uint8_t *p, int64_t o, __m256i *sc,
                     __m256i *corr) {
    __m256i U[4];
    if (t == T_Q6_K) {
        kdwords(pk, rows, p, o, 192, 4, U);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            sc[i] = VNNI ? _mm256_srai_epi32(lane_bytes(U[i / 4], -1, -1, -1, i % 4), 24)
                         : _mm256_srai_epi16(lane_bytes(U[i / 4], -1, i % 4, -1, i % 4), 8);
        return;
    }
    kdwords(pk, rows, p, o, 4, 3, U);   /* kscales' u0, u1, u2 */
    const __m256i T1 = U[0], T2 = U[1], T3 = U[2];
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4 = _mm256_set1_epi32(0x0f0f0f0f),
                  m2 = _mm256_set1_epi32(0x30303030);
    const __m256i a = _mm256_and_si256(T1, m6), b = _mm256_and_si256(T2, m6);   /* sc0..3, mn0..3 */
    const __m256i c = _mm256_or_si256(_mm256_and_si256(T3, m4), _mm256_and_si256(_mm256_srli_epi32(T1, 2), m2));
    const __m256i e = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(T3, 4), m4),
                                      _mm256_and_si256(_mm256_srli_epi32(T2, 2), m2));   /* sc4..7, mn4..7 */
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) sc[j] = lane_bytes(j < 4 ? a : c, j % 4, -1, VNNI ? -1 : j % 4, -1);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) corr[k] = lane_bytes(k < 2 ? b : e, 2 * (k % 2), -1, 2 * (k % 2) + 1, -1);
}

/* packed Q6_K (kernels.h: the 6-bit values regrouped in their 3 bytes): quad 32h + 8m + k (m = 0..3, k = 0..7) of
 * the 8 rows from A, B (the ql dwords 16h + k, 16h + 8 + k) and C (the qh dword 8h + k): quads m = 0, 1 are 6 bits
 * of A, B; m = 2, 3 a nibble of C and the top 2 bits of A, B */
INL __m256i q6_quad(int m, __m256i A, __m256i B, __m256i C) {
    const __m256i m6 = _mm256_set1_epi8(0x3f), f = _mm256_set1_epi8(15), b45 = _mm256_set1_epi8(0x30);
    if (m < 2) return _mm256_and_si256(m == 0 ? A : B, m6);
    return _mm256_or_si256(_mm256_and_si256(m == 2 ? C : _mm256_srli_epi16(C, 4), f),
                           _mm256_and_si256(_mm256_srli_epi16(m == 2 ? A : B, 2), b45));
}

/* super-block kb of a group into a buffer: quad e at V(e step), the scale vectors at sc, corr (vector i at [i step]),
 * the 8 rows' d and dmin at d, dmin. step 1: ubufk; step 2: one half of a pair of groups (avx512vnni's 16-row tile) */
INL void unpackk_to(int t, int pk, const uint8_t *const *rows, int64_t kb, __m256i *v, __m256i *sc, __m256i *corr,
                    float *dd, float *ddmin, int step) {
    const int tb = type_bytes(t);
    const __m256i f = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(0x10), b45 = _mm256_set1_epi8(0x30);
#define V(e) v[(e) * step]
    {
        const int64_t o = kb * tb;
        const uint8_t *blk = rows[0] + GROUP * o;   /* packed: the super-block of the 8 rows */
        if (pk) for (int c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)blk + GROUP * PREFETCH + c);
        else for (int r = 0; r < GROUP; r++)
            for (int c = 0; c < tb; c += 64) PREFETCH_W((const char *)rows[r] + o + PREFETCH + c);
        __m256i scv[16], corrv[4] = {0};   /* (Q6_K has no corr) */
        kscale_vecs(t, pk, rows, blk, o, scv, corrv);
        for (int i = 0; i < 16; i++) sc[i * step] = scv[i];
        for (int i = 0; i < 4; i++) corr[i * step] = corrv[i];
        __m256 d, dmin;
        kscales_d(t, pk, rows, blk, o, &d, &dmin);
        _mm256_storeu_ps(dd, d);
        _mm256_storeu_ps(ddmin, dmin);
        if (t == T_Q6_K) {
            __m256i L[32], H[16];
            kdwords(pk, rows, blk, o, 0, 32, L);
            kdwords(pk, rows, blk, o, 128, 16, H);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 8; p++) {
                    __m256i l0 = L[16 * h + p], l1 = L[16 * h + 8 + p], hb = H[8 * h + p];
                    if (pk) {
                        V(32 * h + p) = q6_quad(0, l0, l1, hb);
                        V(32 * h + 8 + p) = q6_quad(1, l0, l1, hb);
                        V(32 * h + 16 + p) = q6_quad(2, l0, l1, hb);
                        V(32 * h + 24 + p) = q6_quad(3, l0, l1, hb);
                        continue;
                    }
                    V(32 * h + p) = _mm256_or_si256(_mm256_and_si256(l0, f), _mm256_and_si256(_mm256_slli_epi16(hb, 4), b45));
                    V(32 * h + 8 + p) = _mm256_or_si256(_mm256_and_si256(l1, f), _mm256_and_si256(_mm256_slli_epi16(hb, 2), b45));
                    V(32 * h + 16 + p) = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), f), _mm256_and_si256(hb, b45));
                    V(32 * h + 24 + p) = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), f),
                                                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), b45));
                }
        } else {
            __m256i Q[32];
            kdwords(pk, rows, blk, o, t == T_Q4_K ? 16 : 48, 32, Q);
            for (int c = 0; c < 4; c++)
                for (int p = 0; p < 8; p++) {
                    V(16 * c + p) = _mm256_and_si256(Q[8 * c + p], f);
                    V(16 * c + 8 + p) = _mm256_and_si256(_mm256_srli_epi16(Q[8 * c + p], 4), f);
                }
            if (t == T_Q5_K) {   /* fifth bit of element 64c + l: bit 2c of qh[l]; of 64c + 32 + l: bit 2c + 1 */
                __m256i H[8];
                kdwords(pk, rows, blk, o, 16, 8, H);
                for (int c = 0; c < 4; c++)
                    for (int p = 0; p < 8; p++) {
                        __m256i lo = 2 * c <= 4 ? _mm256_slli_epi16(H[p], 4 - 2 * c) : _mm256_srli_epi16(H[p], 2 * c - 4);
                        __m256i hi = 2 * c + 1 <= 4 ? _mm256_slli_epi16(H[p], 3 - 2 * c) : _mm256_srli_epi16(H[p], 2 * c - 3);
                        V(16 * c + p) = _mm256_or_si256(V(16 * c + p), _mm256_and_si256(lo, b4));
                        V(16 * c + 8 + p) = _mm256_or_si256(V(16 * c + 8 + p), _mm256_and_si256(hi, b4));
                    }
            }
        }
    }
#undef V
}

/* super-blocks b0..b0+nks-1 of a group, the file's rows (rows[r]) or packed (the group at rows[0]) */
INL void unpackk(int t, int pk, const uint8_t *const *rows, int64_t b0, int nks, ubufk *u) {
    for (int kb = 0; kb < nks; kb++)
        unpackk_to(t, pk, rows, b0 + kb, u[kb].v, u[kb].sc, u[kb].corr, u[kb].d, u[kb].dmin, 1);
}

/* Q6_K: the offset 32 of u - 32 taken off inside a sub-block's int16 sum. The 4 quads of sub-block i summed in
 * int16 give, per row, two int16: elements 16i + 4c + {0, 1} (c = 0..3) in the low one, 16i + 4c + {2, 3} in
 * the high one, each sum u q over 8 values -- up to 8*63*127, too big for int16 -- but sum (u - 32) q = that less
 * 32 sum q is at most 8*32*127 = 32512: so the x half-row's 32 sum q of these 8 values (an int16 pair, the same
 * for every row) is taken off the wrapping int16 sum, which ends exact, and one madd with the scales follows.
 * k6off: those pairs of a chunk's super-blocks of one x half-row, sub-block i's the dword i of its super-block's 16. */
typedef struct { int32_t d[KS_MAX][16]; } k6off;
INL void k6_offsets(const xblock256 *x, int nks, k6off *o) {
    if (VNNI) {   /* the int32 sums need no wrapping: sub-block i's offset is 32 sum q over its 16 values */
        for (int kb = 0; kb < nks; kb++)
            for (int i = 0; i < 16; i++) o->d[kb][i] = 32 * x[kb].bsum[i];
        return;
    }
    const __m256i k32 = _mm256_set1_epi8(32), seq = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int kb = 0; kb < nks; kb++) {
        __m256i h[4];   /* values 64p..64p+63 (sub-blocks 4p..4p+3): dword 0, 1 of lane 0 = sub-block 4p, 4p + 2 */
        for (int p = 0; p < 4; p++) {
            /* 32 (q_2e + q_2e+1), dword c of a 128-bit lane = quad c of a sub-block: the lanes' 4 dwords summed */
            const __m256i a = _mm256_maddubs_epi16(k32, ld256(x[kb].q + 64 * p)),
                          b = _mm256_maddubs_epi16(k32, ld256(x[kb].q + 64 * p + 32));
            const __m256i c = _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
            h[p] = _mm256_add_epi16(c, _mm256_shuffle_epi32(c, 0x4e));
        }
        _mm256_storeu_si256((__m256i *)o->d[kb], _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(h[0], h[1]), seq));
        _mm256_storeu_si256((__m256i *)o->d[kb] + 1, _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(h[2], h[3]), seq));
    }
}
#define K6OFF(o, kb, i) _mm256_set1_epi32((o)->d[kb][i])

/* Q4_K / Q5_K: B = sum_j mn_j bsum32_j of x block x, lane r = row r (corr: ubufk's, the mins as int16 pairs): the
 * bsum32 pairs broadcast */
INL __m256i kmins(const __m256i *corr, const xblock256 *x) {
#define P(k) _mm256_madd_epi16(corr[k], _mm256_set1_epi32(ld32s(x->bsum32 + 2 * (k))))
    return _mm256_add_epi32(_mm256_add_epi32(P(0), P(1)), _mm256_add_epi32(P(2), P(3)));
#undef P
}

/* Accumulators against a chunk of super-blocks, as dot32_chunk: one group (ng = 1), x half-rows x0..x(nx-1)
 * (nx = 2 or 4) against u0, accumulator k = half-row k; two groups (ng = 2, nx = 2: the 16 x 2 tile), x0, x1
 * against u0 (accumulators 0, 1) and u1 (2, 3), each x quad broadcast once for both. */
#define XK(k) (ng == 2 ? ((k) & 1 ? x1 : x0) : (k) == 0 ? x0 : (k) == 1 ? x1 : (k) == 2 ? x2 : x3)
#define UK(k) (ng == 2 && (k) >= 2 ? u1 : u0)
INL void dotk_chunk(int t, const ubufk *u0, const ubufk *u1, int nks, int ng, int nx, const xblock256 *x0,
                    const xblock256 *x1, const xblock256 *x2, const xblock256 *x3, const k6off *o0,
                    const k6off *o1, const k6off *o2, const k6off *o3, __m256 *a0, __m256 *a1, __m256 *a2,
                    __m256 *a3) {
    const __m256i z = _mm256_setzero_si256();
    const int four = ng == 2 || nx > 2;
    __m256 f0 = *a0, f1 = *a1, f2 = four ? *a2 : _mm256_setzero_ps(), f3 = four ? *a3 : _mm256_setzero_ps();
    for (int kb = 0; kb < nks; kb++, x0++, x1++, x2++, x3++) {
        const __m256i *v0 = u0[kb].v, *v1 = ng == 2 ? u1[kb].v : v0;
        __m256i A0 = z, A1 = z, A2 = z, A3 = z;
/* the x quad c of half-row k at byte o of its block (a broadcast shared by the two groups: BK) and group k's
 * weights and scales */
#define BX(o, c) const __m256i b0 = BQ(x0->q + (o), c), b1 = BQ(x1->q + (o), c), b2 = nx > 2 ? BQ(x2->q + (o), c) : b0, \
                               b3 = nx > 2 ? BQ(x3->q + (o), c) : b1;
#define BK(k) (ng == 2 ? ((k) & 1 ? b1 : b0) : (k) == 0 ? b0 : (k) == 1 ? b1 : (k) == 2 ? b2 : b3)
#define VK(k, e) (ng == 2 && (k) >= 2 ? v1[e] : v0[e])
#define SK(k, e) (ng == 2 && (k) >= 2 ? sc1 : sc0)
        if (t == T_Q6_K) {
#pragma GCC unroll 2
            for (int i = 0; i < 16; i++) {   /* sub-block i: quads 4i..4i+3 in one int16 sum, less the offsets */
                const __m256i sc0 = u0[kb].sc[i], sc1 = ng == 2 ? u1[kb].sc[i] : sc0;
                __m256i s0 = z, s1 = z, s2 = z, s3 = z;
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    BX(16 * i, q)
#define P(k) s##k = DOTACC(s##k, VK(k, 4 * i + q), BK(k)); REG(s##k);
                    P(0) P(1) if (four) { P(2) P(3) }
#undef P
                }
                {
                    const __m256i b0 = K6OFF(o0, kb, i), b1 = K6OFF(o1, kb, i), b2 = nx > 2 ? K6OFF(o2, kb, i) : b0,
                                  b3 = nx > 2 ? K6OFF(o3, kb, i) : b1;
#define P(k) A##k = _mm256_add_epi32(A##k, SCALE32(SUB16(s##k, BK(k)), SK(k, i))); REG(A##k);
                    P(0) P(1) if (four) { P(2) P(3) }
#undef P
                }
            }
#define C(k) COMBINE_D(v8, f##k, _mm256_loadu_ps(UK(k)[kb].d), _mm256_set1_ps(XK(k)->d), A##k);
            C(0) C(1) if (four) { C(2) C(3) }
#undef C
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j++) {   /* sub-block j: quads 8j..8j+7 */
                const __m256i sc0 = u0[kb].sc[j], sc1 = ng == 2 ? u1[kb].sc[j] : sc0;
                __m256i s0 = z, s1 = z, s2 = z, s3 = z, h0 = z, h1 = z, h2 = z, h3 = z;
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) {
                    BX(32 * j, q)
#define P(k) if (t == T_Q5_K && q >= 4 && !VNNI) { h##k = DOTACC(h##k, VK(k, 8 * j + q), BK(k)); REG(h##k); } \
             else { s##k = DOTACC(s##k, VK(k, 8 * j + q), BK(k)); REG(s##k); }
                    P(0) P(1) if (four) { P(2) P(3) }
#undef P
                }
#define M(k) A##k = _mm256_add_epi32(A##k, t == T_Q5_K && !VNNI ? _mm256_add_epi32(SCALE32(s##k, SK(k, j)), SCALE32(h##k, SK(k, j))) \
                                                                : SCALE32(s##k, SK(k, j)));
                M(0) M(1) if (four) { M(2) M(3) }
#undef M
            }
            /* B = sum_j mn_j bsum32_j */
#define C(k)                                                                                                   \
            {                                                                                                  \
                const ubufk *u_ = UK(k) + kb;                                                                  \
                const __m256i B = kmins(u_->corr, XK(k));                                                      \
                COMBINE_K(v8, f##k, _mm256_loadu_ps(u_->d), _mm256_loadu_ps(u_->dmin), _mm256_set1_ps(XK(k)->d), A##k, B); \
            }
            C(0) C(1) if (four) { C(2) C(3) }
#undef C
        }
#undef BX
#undef BK
#undef VK
#undef SK
    }
    *a0 = f0; *a1 = f1;
    if (four) { *a2 = f2; *a3 = f3; }
}
#undef XK
#undef UK

#if VNNI == 2
/* avx512vnni, K-quants, many x rows: super-blocks of a pair of groups side by side (ubufk's fields, the two groups'
 * vectors at [.][0] and [.][1]: one 512-bit load), met by x half-rows x0..x(nx-1) (nx = 2 or 4), accumulator k =
 * half-row k; the integer sums as dotk_chunk's (VNNI: int32 throughout, the scales by mullo) */
typedef struct {
    __m256i v[64][2], sc[16][2], corr[4][2];
    float d[2][GROUP], dmin[2][GROUP];
} ubufk2;

/* kmins on 16 lanes: B = sum_j mn_j bsum32_j of x block x, from the mins' vectors corr[0..3] */
INL __m512i kmins_v16(const __m512i *corr, const xblock256 *x) {   /* vpdpwssd: madd and add in one */
#define P(k) corr[k], _mm512_set1_epi32(ld32s(x->bsum32 + 2 * (k)))
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_madd_epi16(P(0)), P(1)), P(2)), P(3));
#undef P
}
INL __m512i kmins16(const ubufk2 *u, const xblock256 *x) {   /* of a pair's unpacked super-block */
    const __m512i corr[4] = {ld512(u->corr[0]), ld512(u->corr[1]), ld512(u->corr[2]), ld512(u->corr[3])};
    return kmins_v16(corr, x);
}

/* Against one pair's chunk u (np2 = 1) or two pairs' chunks u, w at once (np2 = 2: a 32-row tile, each x quad
 * broadcast once for both; accumulators a[k] and c[k] = half-row k against u and w). The two pairs halve the
 * loads per vpdpbusd (a 512-bit weight vector and nx broadcasts feed 2 nx of them, not nx): the loop is bound
 * by its loads, not the dot ports (measured, `tracelm bench`, 2 threads, Zen 5: Qwen2.5-7B's prefill products
 * 10% faster, Qwen2.5-Coder-0.5B's 20%). */
INL void dotk_chunk16(int t, int np2, const ubufk2 *u, const ubufk2 *w, int nks, int nx, const xblock256 *x0,
                      const xblock256 *x1, const xblock256 *x2, const xblock256 *x3, const k6off *o0, const k6off *o1,
                      const k6off *o2, const k6off *o3, __m512 *a, __m512 *c) {
    const __m512i z = _mm512_setzero_si512();
    const int four = nx > 2, two = np2 == 2;
    __m512 f0 = a[0], f1 = a[1], f2 = four ? a[2] : _mm512_setzero_ps(), f3 = four ? a[3] : _mm512_setzero_ps();
    __m512 g0 = two ? c[0] : f0, g1 = two ? c[1] : f1, g2 = two && four ? c[2] : f2, g3 = two && four ? c[3] : f3;
    for (int kb = 0; kb < nks; kb++, x0++, x1++, x2++, x3++) {
        const ubufk2 *b = u + kb, *bw = two ? w + kb : b;   /* the two pairs' super-block kb */
        __m512i A0 = z, A1 = z, A2 = z, A3 = z, R0 = z, R1 = z, R2 = z, R3 = z;
/* quad e of the sub-block's weights against the x quads at byte o + 4 q of each half-row, broadcast once */
#define DQ(e, o, q)                                                                                              \
        {                                                                                                        \
            const __m512i V = ld512(b->v[e]);                                                                    \
            __m512i B0 = BQ16(x0->q + (o), q), B1 = BQ16(x1->q + (o), q), B2 = four ? BQ16(x2->q + (o), q) : B0, \
                    B3 = four ? BQ16(x3->q + (o), q) : B1;                                                       \
            REG(B0); REG(B1); if (four) { REG(B2); REG(B3); }                                                    \
            DP(s0, V, B0) DP(s1, V, B1) if (four) { DP(s2, V, B2) DP(s3, V, B3) }                                \
            if (two) {                                                                                           \
                const __m512i W = ld512(bw->v[e]);                                                               \
                DP(r0, W, B0) DP(r1, W, B1) if (four) { DP(r2, W, B2) DP(r3, W, B3) }                            \
            }                                                                                                    \
        }
#define DP(s, V, B) s = _mm512_dpbusd_epi32(s, V, B); REG(s);
/* A, R + the sub-block's sums (less Q6_K's offsets O) times its scales */
#define SC(k, O)                                                                                                    \
        A##k = _mm512_add_epi32(A##k, _mm512_mullo_epi32(_mm512_sub_epi32(s##k, O), sc)); REG(A##k);                \
        if (two) { R##k = _mm512_add_epi32(R##k, _mm512_mullo_epi32(_mm512_sub_epi32(r##k, O), scw)); REG(R##k); }
        if (t == T_Q6_K) {
#pragma GCC unroll 2
            for (int i = 0; i < 16; i++) {   /* sub-block i: quads 4i..4i+3, less the offsets, times the scales */
                __m512i s0 = z, s1 = z, s2 = z, s3 = z, r0 = z, r1 = z, r2 = z, r3 = z;
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) DQ(4 * i + q, 16 * i, q)
                const __m512i sc = ld512(b->sc[i]), scw = ld512(bw->sc[i]);
                SC(0, _mm512_set1_epi32(o0->d[kb][i])) SC(1, _mm512_set1_epi32(o1->d[kb][i]))
                if (four) { SC(2, _mm512_set1_epi32(o2->d[kb][i])) SC(3, _mm512_set1_epi32(o3->d[kb][i])) }
            }
            const __m512 d = _mm512_loadu_ps(b->d), dw = _mm512_loadu_ps(bw->d);
#define C(k, X)                                                                                                     \
            COMBINE_D(v16, f##k, d, _mm512_set1_ps(X->d), A##k);                                                    \
            if (two) COMBINE_D(v16, g##k, dw, _mm512_set1_ps(X->d), R##k);
            C(0, x0) C(1, x1) if (four) { C(2, x2) C(3, x3) }
#undef C
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j++) {   /* sub-block j: quads 8j..8j+7 */
                __m512i s0 = z, s1 = z, s2 = z, s3 = z, r0 = z, r1 = z, r2 = z, r3 = z;
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) DQ(8 * j + q, 32 * j, q)
                const __m512i sc = ld512(b->sc[j]), scw = ld512(bw->sc[j]);
                SC(0, z) SC(1, z) if (four) { SC(2, z) SC(3, z) }
            }
            const __m512 d = _mm512_loadu_ps(b->d), dmin = _mm512_loadu_ps(b->dmin);
            const __m512 dw = _mm512_loadu_ps(bw->d), dminw = _mm512_loadu_ps(bw->dmin);
#define C(k, X)                                                                                                     \
            COMBINE_K(v16, f##k, d, dmin, _mm512_set1_ps(X->d), A##k, kmins16(b, X));                               \
            if (two) COMBINE_K(v16, g##k, dw, dminw, _mm512_set1_ps(X->d), R##k, kmins16(bw, X));
            C(0, x0) C(1, x1) if (four) { C(2, x2) C(3, x3) }
#undef C
        }
#undef SC
#undef DP
#undef DQ
    }
    a[0] = f0; a[1] = f1;
    if (four) { a[2] = f2; a[3] = f3; }
    if (two) {
        c[0] = g0; c[1] = g1;
        if (four) { c[2] = g2; c[3] = g3; }
    }
}

#if AMX
/* amx, K-quants: each weight times its sub-block's scale, w = q sc (Q6_K: (q - 32) sc; |w| <= 31 * 63 or 32 * 128,
 * so an int16), held as two byte planes, lo = w mod 256 (unsigned) and hi = (w - lo) / 256 (signed). Then
 * sum_l w_l x_l = 256 (hi . x) + (lo . x) over the whole super-block: two tile products per 64 values and no step
 * per sub-block, giving exactly dotk_chunk16's integer A (its sum over j of sc_j (q . x)_j, Q6_K's offset inside);
 * its float steps follow unchanged. A pair's super-block of planes: quad e of its 16 rows as ubufk2's v (8 KB). */
typedef struct { __m512i lo[64], hi[64]; } kplanes;
INL void amx_kplanes(int t, const ubufk2 *b, kplanes *p) {
    const __m512i low = _mm512_set1_epi16(0xff), high = _mm512_set1_epi16((short)0xff00), k32 = _mm512_set1_epi16(32);
#pragma GCC unroll 4
    for (int e = 0; e < 64; e++) {
        const __m512i s = ld512(b->sc[t == T_Q6_K ? e / 4 : e / 8]);   /* int32 a lane (VNNI's scale vectors) */
        const __m512i s16 = _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(s, 16));
        const __m512i v = ld512(b->v[e]);
        __m512i ev = _mm512_and_si512(v, low), od = _mm512_srli_epi16(v, 8);   /* bytes 0, 2 and 1, 3 as int16 */
        if (t == T_Q6_K) { ev = _mm512_sub_epi16(ev, k32); od = _mm512_sub_epi16(od, k32); }
        const __m512i we = _mm512_mullo_epi16(ev, s16), wo = _mm512_mullo_epi16(od, s16);
        p->lo[e] = _mm512_or_si512(_mm512_and_si512(we, low), _mm512_slli_epi16(wo, 8));
        p->hi[e] = _mm512_or_si512(_mm512_srli_epi16(we, 8), _mm512_and_si512(wo, high));
    }
}

/* a super-block's float steps for 16 half-rows (x as amx_superk's) from its planes' integers lo, hi */
INL void amx_combinek(int t, const ubufk2 *b, const xblock256 *x, int64_t xrb, const int32_t (*lo)[16],
                      const int32_t (*hi)[16], __m512 *acc) {
    const __m512 d = _mm512_loadu_ps(b->d), dmin = _mm512_loadu_ps(b->dmin);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        const xblock256 *X = (const xblock256 *)((const char *)x + i * xrb);
        const __m512i A = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[i]), 8), _mm512_load_si512(lo[i]));
        if (t == T_Q6_K) COMBINE_D(v16, acc[i], d, _mm512_set1_ps(X->d), A);
        else COMBINE_K(v16, acc[i], d, dmin, _mm512_set1_ps(X->d), A, kmins16(b, X));
    }
}

/* amx: 16 or, with `two`, 32 quantized half-rows (x: the first one's super-block, the others xrb bytes apart) against
 * a pair's unpacked super-block u and its planes w, accumulator i = half-row i: the products, then the floats. C tiles
 * tmm0, 1 (the first 16's lo, hi) and tmm2, 3 (the second 16's), A tmm4, 5, the planes tmm6, 7 (each loaded once for
 * both x tiles). In turn: the next super-block's products issued before these floats (over a chunk's super-blocks,
 * or over every pass and pair of it; at once, or spread among the floats) measured 3-15% slower, 1 thread. */
INL void amx_superk(int t, int two, const ubufk2 *u, const kplanes *w, const xblock256 *x, int64_t xrb, __m512 *acc) {
    int32_t c[4][16][16] __attribute__((aligned(64)));
    const xblock256 *x2 = (const xblock256 *)((const char *)x + 16 * xrb);
    __asm__ volatile("" ::: "memory");   /* the tile loads read w and x: what was stored there is stored */
    _tile_zero(0); _tile_zero(1);
    if (two) { _tile_zero(2); _tile_zero(3); }
    for (int q = 0; q < 4; q++) {   /* values 64 q.. */
        _tile_loadd(4, x->q + 64 * q, xrb);
        _tile_loadd(6, w->lo + 16 * q, 64); _tile_loadd(7, w->hi + 16 * q, 64);
        _tile_dpbsud(0, 4, 6); _tile_dpbssd(1, 4, 7);
        if (two) { _tile_loadd(5, x2->q + 64 * q, xrb); _tile_dpbsud(2, 5, 6); _tile_dpbssd(3, 5, 7); }
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
    if (two) { _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64); }
    amx_combinek(t, u, x, xrb, c[0], c[1], acc);
    if (two) amx_combinek(t, u, x2, xrb, c[2], c[3], acc + 16);
}
#endif
#endif

/* ---- few x rows: unpack on the fly ---- */
INL __m256i word_bcast(__m256i v, int lo, int hi) {   /* int16 word `lo` to the low half, `hi` to the high half */
    return _mm256_shuffle_epi8(v, _mm256_setr_epi8(2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo,
                                                   2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo,
                                                   2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * hi, 2 * hi + 1, 2 * hi,
                                                   2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi,
                                                   2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi,
                                                   2 * hi + 1));
}

/* Q4_K / Q5_K super-block of one row against an x row's hi and lo halves, the weights unpacked once:
 * A = sum sc_j * (q . x)_j (8 int32 partials each); B = sum mn_j * bsum32_j, 4 partials each: hi's in the low
 * 128 bits, lo's in the high (b2 = bsum32 of hi | of lo) */
INL void k45_direct(int t, int two, const uint8_t *blk, const xblock256 *xh, const xblock256 *xl, __m256i b2,
                    __m256i *Ah, __m256i *Al, __m256i *B) {
    uint32_t u0 = ld32(blk + 4), u1 = ld32(blk + 8), u2 = ld32(blk + 12);   /* kscales, 4 bytes at a time */
    uint32_t a = u0 & 0x3f3f3f3fu, b = u1 & 0x3f3f3f3fu;
    uint32_t c = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    uint32_t e = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
    __m256i sm = _mm256_cvtepu8_epi16(_mm_setr_epi32((int)a, (int)c, (int)b, (int)e));   /* sc0..7 | mn0..7 */
    __m256i sc = _mm256_permute2x128_si256(sm, sm, 0x00), mn = _mm256_permute2x128_si256(sm, sm, 0x11);
    *B = _mm256_madd_epi16(mn, b2);
    const __m256i f = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const uint8_t *qs = blk + (t == T_Q4_K ? 16 : 48);
    __m256i hb = t == T_Q5_K ? ld256(blk + 16) : _mm256_setzero_si256();
    __m256i acch = _mm256_setzero_si256(), accl = _mm256_setzero_si256();
#define CHUNK(c)                                                                                                   \
    {                                                                                                              \
        __m256i v = ld256(qs + 32 * c), lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f); \
        if (t == T_Q5_K) {                                                                                         \
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));  \
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4)); \
        }                                                                                                          \
        const __m256i s0 = word_bcast(sc, 2 * c, 2 * c), s1 = word_bcast(sc, 2 * c + 1, 2 * c + 1);               \
        acch = _mm256_add_epi32(acch, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ld256(xh->q + 64 * c)), s0));    \
        if (two) accl = _mm256_add_epi32(accl, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ld256(xl->q + 64 * c)), s0)); \
        acch = _mm256_add_epi32(acch, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ld256(xh->q + 64 * c + 32)), s1)); \
        if (two) accl = _mm256_add_epi32(accl, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ld256(xl->q + 64 * c + 32)), s1)); \
    }
    CHUNK(0) CHUNK(1) CHUNK(2) CHUNK(3)
#undef CHUNK
    *Ah = acch;
    *Al = accl;
}

/* Q6_K super-block of one row against an x row's hi and lo halves: A = sum sc_i * ((q - 32) . x)_i as 8 int32
 * partials each */
INL void k6_direct(int two, const uint8_t *blk, const xblock256 *xh, const xblock256 *xl, __m256i bs16h,
                   __m256i bs16l, __m256i *Ah, __m256i *Al) {
    __m256i sc16 = _mm256_cvtepi8_epi16(ld128(blk + 192));
    __m256i acch = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs16h), 5));
    __m256i accl = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs16l), 5));
    __m256i s_lo = _mm256_permute2x128_si256(sc16, sc16, 0x00), s_hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    const __m256i f = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
#define GRP(G, L, SHIFT_L, SHIFT_H, S)                                                                            \
    {                                                                                                             \
        __m256i q = _mm256_and_si256(SHIFT_L ? _mm256_srli_epi16(L, 4) : L, f);                                   \
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, SHIFT_H), three), 4));    \
        const __m256i s = word_bcast(S, (2 * (G)) % 8, (2 * (G) + 1) % 8);                                        \
        acch = _mm256_add_epi32(acch, _mm256_madd_epi16(_mm256_maddubs_epi16(q, ld256(xh->q + 32 * (G))), s));    \
        if (two) accl = _mm256_add_epi32(accl, _mm256_madd_epi16(_mm256_maddubs_epi16(q, ld256(xl->q + 32 * (G))), s)); \
    }
    {
        __m256i l0 = ld256(blk), l1 = ld256(blk + 32), hb = ld256(blk + 128);
        GRP(0, l0, 0, 0, s_lo) GRP(1, l1, 0, 2, s_lo) GRP(2, l0, 1, 4, s_lo) GRP(3, l1, 1, 6, s_lo)
    }
    {
        __m256i l0 = ld256(blk + 64), l1 = ld256(blk + 96), hb = ld256(blk + 160);
        GRP(4, l0, 0, 0, s_hi) GRP(5, l1, 0, 2, s_hi) GRP(6, l0, 1, 4, s_hi) GRP(7, l1, 1, 6, s_hi)
    }
#undef GRP
    *Ah = acch;
    *Al = accl;
}

/* 8 vectors of 2 x 4 int32 -> the 8 rows' sums of the low 128 bits (*h) and of the high 128 bits (*l) */
INL void hsum8_halves(__m256i s0, __m256i s1, __m256i s2, __m256i s3, __m256i s4, __m256i s5, __m256i s6,
                      __m256i s7, __m256i *h, __m256i *l) {
    __m256i a = _mm256_hadd_epi32(s0, s1), b = _mm256_hadd_epi32(s2, s3);
    __m256i c = _mm256_hadd_epi32(s4, s5), d = _mm256_hadd_epi32(s6, s7);
    __m256i f = _mm256_hadd_epi32(a, b), g = _mm256_hadd_epi32(c, d);
    *h = _mm256_permute2x128_si256(f, g, 0x20);
    *l = _mm256_permute2x128_si256(f, g, 0x31);
}


/* one x row's hi and lo halves against 8 weight rows: returns acc_hi + acc_lo */
INL __m256 dotk_direct(int t, int two, const uint8_t *const *rows, const xblock256 *xh, const xblock256 *xl,
                       int64_t nb, int64_t pf) {
    const int tb = type_bytes(t);
    __m256 acc_hi = _mm256_setzero_ps(), acc_lo = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, xh++, xl++) {
        const int64_t o = b * tb;
        const __m256i bsh = ld256(xh->bsum), bsl = ld256(xl->bsum);
        __m256 dxh = _mm256_set1_ps(xh->d), dxl = _mm256_set1_ps(xl->d), d, dmin;
        for (int64_t c = 0; c < GROUP * tb; c += 64) PREFETCH_W((const char *)rows[0] + pf + GROUP * o + c);
        kscales_d(t, 0, rows, NULL, o, &d, &dmin);
        __m256i H0, H1, H2, H3, H4, H5, H6, H7, L0, L1, L2, L3, L4, L5, L6, L7;
        if (t == T_Q6_K) {
#define K6(r) k6_direct(two, rows[r] + o, xh, xl, bsh, bsl, &H##r, &L##r);
            K6(0) K6(1) K6(2) K6(3) K6(4) K6(5) K6(6) K6(7)
#undef K6
            const __m256i ah = hsum8(H0, H1, H2, H3, H4, H5, H6, H7);
            COMBINE_D(v8, acc_hi, d, dxh, ah);
            if (two) {
                const __m256i al = hsum8(L0, L1, L2, L3, L4, L5, L6, L7);
                COMBINE_D(v8, acc_lo, d, dxl, al);
            }
        } else {
            const __m256i b2 = join(ld128(xh->bsum32), ld128(xl->bsum32));
            __m256i B0, B1, B2, B3, B4, B5, B6, B7;
#define K45(r) k45_direct(t, two, rows[r] + o, xh, xl, b2, &H##r, &L##r, &B##r);
            K45(0) K45(1) K45(2) K45(3) K45(4) K45(5) K45(6) K45(7)
#undef K45
            __m256i ah = hsum8(H0, H1, H2, H3, H4, H5, H6, H7), bh, bl;
            hsum8_halves(B0, B1, B2, B3, B4, B5, B6, B7, &bh, &bl);
            COMBINE_K(v8, acc_hi, d, dmin, dxh, ah, bh);
            if (two) {
                const __m256i al = hsum8(L0, L1, L2, L3, L4, L5, L6, L7);
                COMBINE_K(v8, acc_lo, d, dmin, dxl, al, bl);
            }
        }
    }
    return two ? _mm256_add_ps(acc_hi, acc_lo) : acc_hi;
}

/* few x rows, packed K-quants (kernels.h): each super-block of the 8 rows read with plain loads, vertically as in
 * dot32v_direct -- lane r = row r, each x quad broadcast -- and met by the x row's hi (and, if two, lo) half quad
 * by quad as it is made; the integer sums as dotk_chunk's (int16 runs of 8 quads, Q5_K 4; Q6_K's sub-block of 4
 * less its offsets, then one madd with the scales). Returns acc_hi (+ acc_lo). The group's stream is prefetched
 * k_ahead super-blocks ahead, its last ones' into the next group's, which follows it (pf: those bytes; 0, none). */
INL __m256 dotk_packed(int t, int two, const uint8_t *g, const xblock256 *xh, const xblock256 *xl, int64_t nb,
                       int64_t pf) {
    const int tb = type_bytes(t);
    const __m256i f = _mm256_set1_epi8(15), z = _mm256_setzero_si256();
    __m256 acc_hi = _mm256_setzero_ps(), acc_lo = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, xh++, xl++) {
        const uint8_t *p = g + GROUP * b * tb;   /* the super-block of the 8 rows; byte f of the file's at 8 f */
        for (int64_t c = 0; pf && c < GROUP * tb; c += 64) PREFETCH_W((const char *)p + pf + c);
        __m256i sc[16], corr[4], Ah = z, Al = z;
        __m256 d, dmin;
        kscale_vecs(t, 1, NULL, p, 0, sc, corr);
        kscales_d(t, 1, NULL, p, 0, &d, &dmin);
        const __m256 dxh = _mm256_set1_ps(xh->d), dxl = _mm256_set1_ps(xl->d);
        if (t == T_Q6_K) {
            k6off oh, ol;
            k6_offsets(xh, 1, &oh);
            if (two) k6_offsets(xl, 1, &ol);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {   /* sub-block i: quads 4i + q = 32h + 8m + k, k = 4 (i % 2) + q */
                const int h = i / 8, m = i / 2 % 4;
                __m256i sh = z, sl = z;
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    const int k = 4 * (i % 2) + q;   /* (the loads a quad does not need go unused) */
                    const __m256i v = q6_quad(m, ld256(p + 32 * (16 * h + k)), ld256(p + 32 * (16 * h + 8 + k)),
                                              ld256(p + 8 * 128 + 32 * (8 * h + k)));
                    sh = DOTACC(sh, v, BQ(xh->q + 16 * i, q)); REG(sh);
                    if (two) { sl = DOTACC(sl, v, BQ(xl->q + 16 * i, q)); REG(sl); }
                }
                Ah = _mm256_add_epi32(Ah, SCALE32(SUB16(sh, K6OFF(&oh, 0, i)), sc[i]));
                if (two) Al = _mm256_add_epi32(Al, SCALE32(SUB16(sl, K6OFF(&ol, 0, i)), sc[i]));
            }
            COMBINE_D(v8, acc_hi, d, dxh, Ah);
            if (two) COMBINE_D(v8, acc_lo, d, dxl, Al);
            continue;
        }
        const int five = t == T_Q5_K, run = five && !VNNI ? 4 : 8, qs = 8 * (five ? 48 : 16);
        const __m256i b4 = _mm256_set1_epi8(0x10);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)   /* qs dwords 8c..8c+7: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
#pragma GCC unroll 2
            for (int k0 = 0; k0 < 8; k0 += run) {
                __m256i s0h = z, s0l = z, s1h = z, s1l = z;
#pragma GCC unroll 8
                for (int k = k0; k < k0 + run; k++) {
                    const __m256i Q = ld256(p + qs + 32 * (8 * c + k));
                    __m256i v0 = _mm256_and_si256(Q, f), v1 = _mm256_and_si256(_mm256_srli_epi16(Q, 4), f);
                    if (five) {   /* qh dword k: bit 2c (2c + 1) of its byte e, the fifth bit of value 4k + e */
                        const __m256i H = ld256(p + 8 * 16 + 32 * k);
                        v0 = _mm256_or_si256(v0, _mm256_and_si256(2 * c <= 4 ? _mm256_slli_epi16(H, 4 - 2 * c)
                                                                             : _mm256_srli_epi16(H, 2 * c - 4), b4));
                        v1 = _mm256_or_si256(v1, _mm256_and_si256(2 * c + 1 <= 4 ? _mm256_slli_epi16(H, 3 - 2 * c)
                                                                                 : _mm256_srli_epi16(H, 2 * c - 3), b4));
                    }
#define Q4(S, V, o) S = DOTACC(S, V, BQ(o, k)); REG(S);
                    Q4(s0h, v0, xh->q + 64 * c) Q4(s1h, v1, xh->q + 64 * c + 32)
                    if (two) { Q4(s0l, v0, xl->q + 64 * c) Q4(s1l, v1, xl->q + 64 * c + 32) }
#undef Q4
                }
                Ah = _mm256_add_epi32(Ah, _mm256_add_epi32(SCALE32(s0h, sc[2 * c]), SCALE32(s1h, sc[2 * c + 1])));
                if (two) Al = _mm256_add_epi32(Al, _mm256_add_epi32(SCALE32(s0l, sc[2 * c]), SCALE32(s1l, sc[2 * c + 1])));
            }
        COMBINE_K(v8, acc_hi, d, dmin, dxh, Ah, kmins(corr, xh));
        if (two) COMBINE_K(v8, acc_lo, d, dmin, dxl, Al, kmins(corr, xl));
    }
    return two ? _mm256_add_ps(acc_hi, acc_lo) : acc_hi;
}

#if VNNI == 2
/* few x rows (decode), packed weights, two groups at once on 512-bit vectors: the direct kernels' steps lane by
 * lane, group g's 8 rows in the low 256 bits and g + 1's (gb bytes on) in the high, so each x quad's broadcast and
 * vpdpbusd serve 16 rows. The same integer sums and float steps per lane: the same bits. (Qwen2.5-7B's decode,
 * `tracelm bench` at 2 threads: 1.26x the 8-row kernels; docs/performance.md.) */
INL __m512i ld2g(const uint8_t *p, int64_t gb) {   /* 32 bytes at p of this group and of the next */
    return _mm512_inserti64x4(_mm512_castsi256_si512(ld256(p)), ld256(p + gb), 1);
}
INL __m512 cvt2g(const uint8_t *p, int64_t gb) {    /* the 8 f16 at p of both groups */
    return _mm512_cvtph_ps(join(ld128(p), ld128(p + gb)));
}
INL __m512i lane_bytes16(__m512i v, int i0, int i1, int i2, int i3) {   /* lane_bytes on 16 lanes */
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(lane_pattern(i0, i1, i2, i3)));
}

/* kscale_vecs (VNNI's int32 lanes) of the packed super-block at p and at p + gb */
INL void kscale_vecs16(int t, const uint8_t *p, int64_t gb, __m512i *sc, __m512i *corr) {
    if (t == T_Q6_K) {
        __m512i U[4];
        for (int k = 0; k < 4; k++) U[k] = ld2g(p + 8 * 192 + 32 * k, gb);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) sc[i] = _mm512_srai_epi32(lane_bytes16(U[i / 4], -1, -1, -1, i % 4), 24);
        return;
    }
    const __m512i T1 = ld2g(p + 8 * 4, gb), T2 = ld2g(p + 8 * 4 + 32, gb), T3 = ld2g(p + 8 * 4 + 64, gb);
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f),
                  m2 = _mm512_set1_epi32(0x30303030);
    const __m512i a = _mm512_and_si512(T1, m6), b = _mm512_and_si512(T2, m6);
    const __m512i c = _mm512_or_si512(_mm512_and_si512(T3, m4), _mm512_and_si512(_mm512_srli_epi32(T1, 2), m2));
    const __m512i e = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(T3, 4), m4),
                                      _mm512_and_si512(_mm512_srli_epi32(T2, 2), m2));
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) sc[j] = lane_bytes16(j < 4 ? a : c, j % 4, -1, -1, -1);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) corr[k] = lane_bytes16(k < 2 ? b : e, 2 * (k % 2), -1, 2 * (k % 2) + 1, -1);
}

INL __m512i q6_quad16(int m, __m512i A, __m512i B, __m512i C) {   /* q6_quad on 16 lanes */
    const __m512i m6 = _mm512_set1_epi8(0x3f), f = _mm512_set1_epi8(15), b45 = _mm512_set1_epi8(0x30);
    if (m < 2) return _mm512_and_si512(m == 0 ? A : B, m6);
    return _mm512_or_si512(_mm512_and_si512(m == 2 ? C : _mm512_srli_epi16(C, 4), f),
                           _mm512_and_si512(_mm512_srli_epi16(m == 2 ? A : B, 2), b45));
}

/* few x rows, packed 4/5-bit 32-value types: dot32v_direct for two groups at once, as dotk_packed16 */
INL __m512i fifth_quad16(__m512i QH, int c) {   /* fifth_quad on 16 lanes */
    const __m512i s = c < 4 ? _mm512_slli_epi32(QH, 4 - c) : c > 4 ? _mm512_srli_epi32(QH, c - 4) : QH;
    return _mm512_and_si512(s, _mm512_set1_epi32(0x10101010));
}
/* nr (1, 2 or 4) x rows at once, x[2r] and x[2r + 1] the halves of row r (hi, lo): each block's weights loaded and
 * unpacked once for all of them, each half-row's sums and float steps as it has them alone; out[r] = acc_hi + acc_lo
 * of row r */
INL void dot32_packed16(int t, int two, int nr, const uint8_t *g, int64_t gb, const xblock32 *const *x, int64_t nb,
                        __m512 *out) {
    const int tb = type_bytes(t), off = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0, five = weight_bits(t) == 5;
    const int pq = packed_quants(t), dm = t == T_Q4_1 || t == T_Q5_1, nh = 2 * nr;
    const __m512i f = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    __m512 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < nh; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + GROUP * b * tb;
        for (int64_t c = 0; c < GROUP * tb; c += 64) {
            PREFETCH_W((const char *)p + 2 * gb + c);
            PREFETCH_W((const char *)p + 3 * gb + c);
        }
        const __m512i T0 = ld2g(p + pq, gb), T1 = ld2g(p + pq + 32, gb), T2 = ld2g(p + pq + 64, gb),
                      T3 = ld2g(p + pq + 96, gb), QH = five ? ld2g(p + (t == T_Q5_0 ? 16 : 32), gb) : z;
        const __m512 d = cvt2g(p, gb), m = dm ? cvt2g(p + 16, gb) : d;
        __m512i s[8];
#pragma GCC unroll 8
        for (int k = 0; k < nh; k++) s[k] = z;
#define QUAD(V, c)                                                                      \
        _Pragma("GCC unroll 8") for (int k = 0; k < nh; k++)                            \
            if (two || !(k & 1)) { s[k] = _mm512_dpbusd_epi32(s[k], V, BQ16(x[k][b].q, c)); REG(s[k]); }
#define PAIR(Ta, Tb, c)   /* quads c, c + 1 (low nibbles) and c + 4, c + 5 (high) */     \
        {                                                                               \
            NIBBLE_QUADS(512, fifth_quad16, Ta, Tb, c, QH, f, five, v0, v1, v4, v5)     \
            QUAD(v0, c) QUAD(v1, c + 1) QUAD(v4, c + 4) QUAD(v5, c + 5)                 \
        }
        PAIR(T0, T1, 0) PAIR(T2, T3, 2)
#undef PAIR
#undef QUAD
#pragma GCC unroll 8
        for (int k = 0; k < nh; k++) {
            if (!two && (k & 1)) continue;
            const xblock32 *X = &x[k][b];
            HALF_STEP(512, v16, acc[k], s[k], X, off, dm, d, m)
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) out[r] = two ? _mm512_add_ps(acc[2 * r], acc[2 * r + 1]) : acc[2 * r];
}

/* 8 vectors of two halves of 8 int32 -> lane r (r < 8) = sum of half 0 of s[r], lane 8 + r = sum of its half 1 */
INL __m512i rowsums16(const __m512i *s) {
    __m512i t[4], u[2];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)   /* per 128 bits: s[2k] a + c, s[2k + 1] a + c, s[2k] b + d, s[2k + 1] b + d */
        t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * k], s[2 * k + 1]), _mm512_unpackhi_epi32(s[2 * k], s[2 * k + 1]));
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)   /* per 128 bits: the sums of s[4k..4k+3] over its 4 dwords */
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    const __m512i v = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xdd));
    return _mm512_shuffle_i32x4(v, v, 0xd8);   /* 128-bit lanes: rows 0-3, 0-3 of the half after, 4-7, 4-7 -> in order */
}

/* few x rows, packed Q8_0, two groups at once: row r of both in one vector (the group's 32 bytes low, the next's
 * high), biased to unsigned (w + 128) for vpdpbusd against the x block in both halves; 128 sum q taken off the
 * 16 rows' sums (rowsums16). nr (1 or 2) x rows at once, as dot32_packed16 (measured, 1 thread, SmolLM2's head:
 * 2 rows 0.87 of one row's passes each, 3 rows 0.88; from 4 rows the tile is faster) */
INL void q8_packed16(int two, int nr, const uint8_t *g, int64_t gb, const xblock32 *const *x, int64_t nb, __m512 *out) {
    const int tb = type_bytes(T_Q8_0), nh = 2 * nr;
    const __m512i bias = _mm512_set1_epi8((char)0x80), z = _mm512_setzero_si512();
    __m512 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < nh; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + GROUP * b * tb;   /* d[8], then the 8 rows' 32 bytes */
        for (int64_t c = 0; c < GROUP * tb; c += 64) {
            PREFETCH_W((const char *)p + 2 * gb + c);
            PREFETCH_W((const char *)p + 3 * gb + c);
        }
        __m512i w[8], s[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) w[r] = _mm512_xor_si512(ld2g(p + 16 + 32 * r, gb), bias);
        const __m512 d = cvt2g(p, gb);
#pragma GCC unroll 8
        for (int k = 0; k < nh; k++) {   /* each half-row against the block's 16 rows, loaded once for all */
            if (!two && (k & 1)) continue;
            const xblock32 *X = &x[k][b];
            const __m512i xv = _mm512_broadcast_i64x4(ld256(X->q));
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) s[r] = _mm512_dpbusd_epi32(z, w[r], xv);
            const __m512i i = _mm512_sub_epi32(rowsums16(s), OFF_SUM(512, 128, X->sum));
            COMBINE_D(v16, acc[k], d, _mm512_set1_ps(X->d), i);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) out[r] = two ? _mm512_add_ps(acc[2 * r], acc[2 * r + 1]) : acc[2 * r];
}

INL __m512 dotk_packed16(int t, int two, const uint8_t *g, int64_t gb, const xblock256 *xh, const xblock256 *xl,
                         int64_t nb) {
    const int tb = type_bytes(t);
    const __m512i f = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    __m512 acc_hi = _mm512_setzero_ps(), acc_lo = _mm512_setzero_ps();
    const int64_t ahead = k_ahead;   /* super-blocks (kernels.h; docs/performance.md) */
    for (int64_t b = 0; b < nb; b++, xh++, xl++) {
        const uint8_t *p = g + GROUP * b * tb;
        /* each of the two groups' streams `ahead` blocks ahead, past their ends into the next pair's two groups */
        const uint8_t *a = p + ahead * GROUP * tb + (b + ahead >= nb ? gb : 0);
        for (int64_t c = 0; ahead && c < GROUP * tb; c += 64) {   /* 0: the hardware's prefetchers alone */
            PREFETCH_W((const char *)a + c);
            PREFETCH_W((const char *)a + gb + c);
        }
        __m512i sc[16], corr[4], Ah = z, Al = z;
        kscale_vecs16(t, p, gb, sc, corr);
        const __m512 d = cvt2g(p + (t == T_Q6_K ? 8 * 208 : 0), gb);
        const __m512 dxh = _mm512_set1_ps(xh->d), dxl = _mm512_set1_ps(xl->d);
        if (t == T_Q6_K) {
            k6off oh, ol;
            k6_offsets(xh, 1, &oh);
            if (two) k6_offsets(xl, 1, &ol);
            /* dwords A, B, C (k of half h) make quad q = k % 4 of the sub-blocks i = 8h + 2m + k / 4, m = 0..3:
             * each loaded once */
#pragma GCC unroll 4
            for (int hk = 0; hk < 4; hk++) {
                const int h = hk / 2, i0 = 8 * h + hk % 2;
                __m512i sh[4] = {z, z, z, z}, sl[4] = {z, z, z, z};
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    const int k = 4 * (hk % 2) + q;
                    const __m512i A = ld2g(p + 32 * (16 * h + k), gb), B = ld2g(p + 32 * (16 * h + 8 + k), gb),
                                  C = ld2g(p + 8 * 128 + 32 * (8 * h + k), gb);
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) {
                        const __m512i v = q6_quad16(m, A, B, C);
                        sh[m] = _mm512_dpbusd_epi32(sh[m], v, BQ16(xh->q + 16 * (i0 + 2 * m), q)); REG(sh[m]);
                        if (two) { sl[m] = _mm512_dpbusd_epi32(sl[m], v, BQ16(xl->q + 16 * (i0 + 2 * m), q)); REG(sl[m]); }
                    }
                }
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) {
                    const int i = i0 + 2 * m;
                    Ah = _mm512_add_epi32(Ah, _mm512_mullo_epi32(_mm512_sub_epi32(sh[m], _mm512_set1_epi32(oh.d[0][i])), sc[i]));
                    if (two) Al = _mm512_add_epi32(Al, _mm512_mullo_epi32(_mm512_sub_epi32(sl[m], _mm512_set1_epi32(ol.d[0][i])), sc[i]));
                }
            }
            COMBINE_D(v16, acc_hi, d, dxh, Ah);
            if (two) COMBINE_D(v16, acc_lo, d, dxl, Al);
            continue;
        }
        const __m512 dmin = cvt2g(p + 16, gb);
        const int five = t == T_Q5_K, qs = 8 * (five ? 48 : 16);
        const __m512i b4 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i s0h = z, s0l = z, s1h = z, s1l = z;
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i Q = ld2g(p + qs + 32 * (8 * c + k), gb);
                __m512i v0 = _mm512_and_si512(Q, f), v1 = _mm512_and_si512(_mm512_srli_epi16(Q, 4), f);
                if (five) {
                    const __m512i H = ld2g(p + 8 * 16 + 32 * k, gb);
                    v0 = _mm512_or_si512(v0, _mm512_and_si512(2 * c <= 4 ? _mm512_slli_epi16(H, 4 - 2 * c)
                                                                         : _mm512_srli_epi16(H, 2 * c - 4), b4));
                    v1 = _mm512_or_si512(v1, _mm512_and_si512(2 * c + 1 <= 4 ? _mm512_slli_epi16(H, 3 - 2 * c)
                                                                             : _mm512_srli_epi16(H, 2 * c - 3), b4));
                }
#define Q4(S, V, o) S = _mm512_dpbusd_epi32(S, V, BQ16(o, k)); REG(S);
                Q4(s0h, v0, xh->q + 64 * c) Q4(s1h, v1, xh->q + 64 * c + 32)
                if (two) { Q4(s0l, v0, xl->q + 64 * c) Q4(s1l, v1, xl->q + 64 * c + 32) }
#undef Q4
            }
            Ah = _mm512_add_epi32(Ah, _mm512_add_epi32(_mm512_mullo_epi32(s0h, sc[2 * c]), _mm512_mullo_epi32(s1h, sc[2 * c + 1])));
            if (two) Al = _mm512_add_epi32(Al, _mm512_add_epi32(_mm512_mullo_epi32(s0l, sc[2 * c]), _mm512_mullo_epi32(s1l, sc[2 * c + 1])));
        }
        COMBINE_K(v16, acc_hi, d, dmin, dxh, Ah, kmins_v16(corr, xh));
        if (two) COMBINE_K(v16, acc_lo, d, dmin, dxl, Al, kmins_v16(corr, xl));
    }
    return two ? _mm512_add_ps(acc_hi, acc_lo) : acc_hi;
}

/* Q4_K, two x rows at once (x[2r], x[2r + 1]: row r's hi and lo halves): each super-block's weights and scales loaded
 * and unpacked once for both, each half-row's sums and float steps as dotk_packed16 has them alone; out[r] = acc_hi +
 * acc_lo of row r. (Q5_K and Q6_K, whose unpacking keeps more vectors live, were slower so.) */
INL void dotk4_packed16x2(int two, const uint8_t *g, int64_t gb, const xblock256 *const *x, int64_t nb, __m512 *out) {
    const int tb = type_bytes(T_Q4_K), qs = 8 * 16;
    const __m512i f = _mm512_set1_epi8(15), z = _mm512_setzero_si512();
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t ahead = k_ahead;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + GROUP * b * tb;
        const uint8_t *a = p + ahead * GROUP * tb + (b + ahead >= nb ? gb : 0);
        for (int64_t c = 0; ahead && c < GROUP * tb; c += 64) {
            PREFETCH_W((const char *)a + c);
            PREFETCH_W((const char *)a + gb + c);
        }
        __m512i sc[16], corr[4], A[4] = {z, z, z, z};
        kscale_vecs16(T_Q4_K, p, gb, sc, corr);
        const __m512 d = cvt2g(p, gb), dmin = cvt2g(p + 16, gb);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i s0[4] = {z, z, z, z}, s1[4] = {z, z, z, z};
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i Q = ld2g(p + qs + 32 * (8 * c + k), gb);
                const __m512i v0 = _mm512_and_si512(Q, f), v1 = _mm512_and_si512(_mm512_srli_epi16(Q, 4), f);
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) {
                    if (!two && (h & 1)) continue;
                    s0[h] = _mm512_dpbusd_epi32(s0[h], v0, BQ16(x[h][b].q + 64 * c, k)); REG(s0[h]);
                    s1[h] = _mm512_dpbusd_epi32(s1[h], v1, BQ16(x[h][b].q + 64 * c + 32, k)); REG(s1[h]);
                }
            }
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++)
                if (two || !(h & 1))
                    A[h] = _mm512_add_epi32(A[h], _mm512_add_epi32(_mm512_mullo_epi32(s0[h], sc[2 * c]),
                                                                   _mm512_mullo_epi32(s1[h], sc[2 * c + 1])));
        }
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            if (two || !(h & 1))
                COMBINE_K(v16, acc[h], d, dmin, _mm512_set1_ps(x[h][b].d), A[h], kmins_v16(corr, &x[h][b]));
    }
    out[0] = two ? _mm512_add_ps(acc[0], acc[1]) : acc[0];
    out[1] = two ? _mm512_add_ps(acc[2], acc[3]) : acc[2];
}

/* a pair's two x rows of Q4_K, a function of its own (not inlined into the task: the one-row kernels' code stays as
 * it is) */
AVX2 __attribute__((noinline)) static void dotk4_pair_rows2(int two, const uint8_t *g, int64_t gb,
                                                           const xblock256 *const *x, int64_t nb, __m512 *out) {
    if (two) dotk4_packed16x2(1, g, gb, x, nb, out);
    else dotk4_packed16x2(0, g, gb, x, nb, out);
}
#endif

/* ======================================================================================================
 * F32 / F16 / BF16: 32 lanes in 4 vectors, one weight row against two x rows at a time
 * ==================================================================================================== */
INL __m256 wload8(int t, const uint8_t *p) {
    if (t == T_F32) return _mm256_loadu_ps((const float *)p);
    if (t == T_F16) return _mm256_cvtph_ps(ld128(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld128(p)), 16));
}

INL float reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {   /* = reduce32 */
    __m256 u = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

/* the zero-padded tail of a row as 32 floats */
INL void tail32(int t, const uint8_t *w, const float *x, int64_t k, int64_t K, float *wt, float *xt) {
    for (int l = 0; l < 32; l++) {
        wt[l] = 0.0f;
        xt[l] = 0.0f;
    }
    int es = t == T_F32 ? 4 : 2;
    for (int l = 0; k + l < K; l++) {
        const uint8_t *p = w + (k + l) * es;
        if (t == T_F32) memcpy(&wt[l], p, 4);
        else if (t == T_F16) wt[l] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(rd16(p))));
        else wt[l] = bf16_to_float(rd16(p));
        xt[l] = x[k + l];
    }
}

/* 32 lanes in 4 vectors, acc = acc + w * x (mul, then add), for x0 and, if two, x1 (named variables: GCC
 * keeps small arrays of vectors in memory at -O2) */
#define STEPF(W0, W1, W2, W3, X0, X1)                                                                         \
    do {                                                                                                      \
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(W0, _mm256_loadu_ps((X0))));                                    \
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(W1, _mm256_loadu_ps((X0) + 8)));                                \
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(W2, _mm256_loadu_ps((X0) + 16)));                               \
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(W3, _mm256_loadu_ps((X0) + 24)));                               \
        if (two) {                                                                                            \
            b0 = _mm256_add_ps(b0, _mm256_mul_ps(W0, _mm256_loadu_ps((X1))));                                \
            b1 = _mm256_add_ps(b1, _mm256_mul_ps(W1, _mm256_loadu_ps((X1) + 8)));                            \
            b2 = _mm256_add_ps(b2, _mm256_mul_ps(W2, _mm256_loadu_ps((X1) + 16)));                           \
            b3 = _mm256_add_ps(b3, _mm256_mul_ps(W3, _mm256_loadu_ps((X1) + 24)));                           \
        }                                                                                                     \
    } while (0)

INL void dotf_rows(int t, const uint8_t *w, const float *x0, const float *x1, int two, int64_t K, float *r0,
                   float *r1) {
    const int es = t == T_F32 ? 4 : 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const uint8_t *p = w + k * es;
        PREFETCH_W((const char *)p + 1024);
        __m256 w0 = wload8(t, p), w1 = wload8(t, p + 8 * es), w2 = wload8(t, p + 16 * es), w3 = wload8(t, p + 24 * es);
        STEPF(w0, w1, w2, w3, x0 + k, (two ? x1 : x0) + k);
    }
    if (k < K) {
        float wt[32], xt0[32], xt1[32];
        tail32(t, w, x0, k, K, wt, xt0);
        if (two) tail32(t, w, x1, k, K, wt, xt1);
        __m256 w0 = _mm256_loadu_ps(wt), w1 = _mm256_loadu_ps(wt + 8), w2 = _mm256_loadu_ps(wt + 16),
               w3 = _mm256_loadu_ps(wt + 24);
        STEPF(w0, w1, w2, w3, xt0, xt1);
    }
    *r0 = reduce4(a0, a1, a2, a3);
    if (two) *r1 = reduce4(b0, b1, b2, b3);
}


/* Many x rows: 2 weight rows x 4 x rows. Each lane vector (lanes 8i..8i+7, i = 0..3) of an output is its own
 * chain, so they are run one after the other: 8 accumulators, every lane's sequence unchanged. The zero-padded
 * tail is the same 32 floats as in dotf_rows. */
INL void dotf_tile(int t, const uint8_t *w0, const uint8_t *w1, const float *x0, const float *x1, const float *x2,
                   const float *x3, int64_t K, float *res /* [2][4] */) {
    const int es = t == T_F32 ? 4 : 2;
    const int64_t kf = K / 32 * 32;
    float wt[2][32], xt[4][32];
    if (kf < K) {
        tail32(t, w0, x0, kf, K, wt[0], xt[0]);
        tail32(t, w1, x1, kf, K, wt[1], xt[1]);
        tail32(t, w0, x2, kf, K, wt[0], xt[2]);
        tail32(t, w0, x3, kf, K, wt[0], xt[3]);
    }
    __m256 part[8][4];
    for (int i = 0; i < 4; i++) {
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
#define TILE_STEP(W0, W1, X0, X1, X2, X3)                                                                  \
        {                                                                                                  \
            __m256 a = (W0), b = (W1), v;                                                                  \
            v = _mm256_loadu_ps(X0); REG(v); c00 = _mm256_add_ps(c00, _mm256_mul_ps(a, v)); c10 = _mm256_add_ps(c10, _mm256_mul_ps(b, v)); \
            v = _mm256_loadu_ps(X1); REG(v); c01 = _mm256_add_ps(c01, _mm256_mul_ps(a, v)); c11 = _mm256_add_ps(c11, _mm256_mul_ps(b, v)); \
            v = _mm256_loadu_ps(X2); REG(v); c02 = _mm256_add_ps(c02, _mm256_mul_ps(a, v)); c12 = _mm256_add_ps(c12, _mm256_mul_ps(b, v)); \
            v = _mm256_loadu_ps(X3); REG(v); c03 = _mm256_add_ps(c03, _mm256_mul_ps(a, v)); c13 = _mm256_add_ps(c13, _mm256_mul_ps(b, v)); \
        }
        for (int64_t k = 8 * i; k < kf; k += 32)
            TILE_STEP(wload8(t, w0 + k * es), wload8(t, w1 + k * es), x0 + k, x1 + k, x2 + k, x3 + k)
        if (kf < K)
            TILE_STEP(_mm256_loadu_ps(wt[0] + 8 * i), _mm256_loadu_ps(wt[1] + 8 * i), xt[0] + 8 * i, xt[1] + 8 * i,
                      xt[2] + 8 * i, xt[3] + 8 * i)
#undef TILE_STEP
        part[0][i] = c00; part[1][i] = c01; part[2][i] = c02; part[3][i] = c03;
        part[4][i] = c10; part[5][i] = c11; part[6][i] = c12; part[7][i] = c13;
    }
    for (int o = 0; o < 8; o++) res[o] = reduce4(part[o][0], part[o][1], part[o][2], part[o][3]);
}

INL void dotf_task(int t, const mm_job *j, int64_t n0, int64_t nr, int64_t m0, int64_t m1) {
    if (m1 - m0 < TILE_MIN) {   /* few x rows: one weight row at a time, the 4 lane vectors together */
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *w = j->w + (n0 + r) * j->row_bytes;
            int64_t m = m0;
            for (; m + 2 <= m1; m += 2)
                dotf_rows(t, w, j->x + m * j->K, j->x + (m + 1) * j->K, 1, j->K, &j->out[m * j->ldo + n0 + r],
                          &j->out[(m + 1) * j->ldo + n0 + r]);
            if (m < m1) dotf_rows(t, w, j->x + m * j->K, NULL, 0, j->K, &j->out[m * j->ldo + n0 + r], NULL);
        }
        return;
    }
    for (int64_t r = 0; r < nr; r += 2) {
        const uint8_t *w0 = j->w + (n0 + r) * j->row_bytes, *w1 = r + 1 < nr ? w0 + j->row_bytes : w0;
        for (int64_t m = m0; m < m1; m += 4) {   /* edge tiles repeat a row; only real outputs are stored */
            const float *x[4];
            for (int i = 0; i < 4; i++) x[i] = j->x + (m + i < m1 ? m + i : m1 - 1) * j->K;
            float res[8];
            dotf_tile(t, w0, w1, x[0], x[1], x[2], x[3], j->K, res);
            for (int i = 0; i < 4 && m + i < m1; i++) {
                j->out[(m + i) * j->ldo + n0 + r] = res[i];
                if (r + 1 < nr) j->out[(m + i) * j->ldo + n0 + r + 1] = res[4 + i];
            }
        }
    }
}

/* ======================================================================================================
 * the task: weight rows 8*group.. against x rows m0..m1
 * ==================================================================================================== */
/* the 8 weight rows of a group (a last group's missing rows: its last row again) */
INL void group_rows(const mm_job *j, int64_t group, const uint8_t **rows) {
    const int64_t n0 = group * GROUP, nr = j->N - n0 < GROUP ? j->N - n0 : GROUP;
    for (int r = 0; r < GROUP; r++) rows[r] = j->w + (n0 + (r < nr ? r : nr - 1)) * j->row_bytes;
}

/* x rows m0.. (mt of them) against a group: out[i] = lane r, row 8 group + r's output for x row m0 + i */
INL void store_group(const mm_job *j, int64_t group, int64_t m0, int64_t mt, const __m256 *out) {
    const int64_t n0 = group * GROUP, nr = j->N - n0 < GROUP ? j->N - n0 : GROUP;
    for (int64_t i = 0; i < mt; i++) {
        float o[GROUP];
        if (nr == GROUP) { _mm256_storeu_ps(&j->out[(m0 + i) * j->ldo + n0], out[i]); continue; }
        _mm256_storeu_ps(o, out[i]);
        memcpy(&j->out[(m0 + i) * j->ldo + n0], o, (size_t)nr * sizeof(float));
    }
}

/* a tile's accumulators of a group (x row i: acc[2i] + acc[2i + 1], hi + lo; one half: acc[i]) -> its outputs */
INL void store_acc(const mm_job *j, int64_t group, int64_t m0, int64_t mt, const __m256 *acc) {
    __m256 out[MTILE];
    for (int64_t i = 0; i < mt; i++) out[i] = j->halves == 2 ? _mm256_add_ps(acc[2 * i], acc[2 * i + 1]) : acc[i];
    store_group(j, group, m0, mt, out);
}

/* x half-row k of a direct pass: row k / 2's hi (h) or lo (l) half (hv halves of xrb bytes a row) */
INL const char *half_row(const char *h, const char *l, int64_t hv, int64_t xrb, int k) {
    return (k & 1 ? l : h) + hv * (k / 2) * xrb;
}

#if VNNI == 2
/* out[i] (x row m0 + i) -> the outputs of ng (1 or 2) groups from `group` on: group + h in the 8 lanes of half h */
INL void store16(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t mt, const __m512 *out) {
    for (int h = 0; h < ng; h++) {
        __m256 o[MTILE_K];
        for (int64_t i = 0; i < mt; i++) {
            const __m512i a = _mm512_castps_si512(out[i]);
            o[i] = _mm256_castsi256_ps(h ? _mm512_extracti64x4_epi64(a, 1) : _mm512_castsi512_si256(a));
        }
        store_group(j, group + h, m0, mt, o);
    }
}

/* a 16-row tile's accumulators (x row i: acc[2i] + acc[2i + 1], or acc[i]) -> its ng groups' outputs */
INL void store_acc16(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t mt, const __m512 *acc) {
    __m512 out[MTILE_K];
    for (int64_t i = 0; i < mt; i++) out[i] = j->halves == 2 ? _mm512_add_ps(acc[2 * i], acc[2 * i + 1]) : acc[i];
    store16(j, group, ng, m0, mt, out);
}

/* few x rows, packed 4/5-bit types and K-quants: two whole groups from `group` on at once (dot32_packed16,
 * dotk_packed16) */
INL void direct_pair(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, gb = GROUP * j->row_bytes;
    const int64_t nb = j->K / type_block(t);
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    const uint8_t *g = j->w + group * gb;
    __m512 out[MTILE];
    for (int64_t i = 0, nr; i < mt; i += nr) {
        /* the 32-value types 4 (Q8_0: its 3 direct rows 2) or 2 x rows a pass, the weights loaded and unpacked once for
         * all; the K-quants one */
        nr = type_block(t) != 32 ? (t == T_Q4_K && mt - i >= 2 ? 2 : 1)
             : mt - i >= 4 && t != T_Q8_0 ? 4 : mt - i >= 2 ? 2 : 1;
        const char *h = xq + hv * i * xrb, *l = hv == 2 ? h + xrb : h;
        const xblock32 *xr[8];
        const xblock256 *xk[4];
        for (int k = 0; k < 2 * nr; k++) {   /* x half-row k: row k / 2's hi or lo */
            const char *p = half_row(h, l, hv, xrb, k);
            xr[k] = (const xblock32 *)p;
            if (k < 4) xk[k] = (const xblock256 *)p;
        }
#define K(T, TWO) dotk_packed16(T, TWO, g, gb, (const xblock256 *)h, (const xblock256 *)l, nb)
#define B(T, TWO)                                                                                      \
        (nr == 4 ? dot32_packed16(T, TWO, 4, g, gb, xr, nb, &out[i])                                   \
         : nr == 2 ? dot32_packed16(T, TWO, 2, g, gb, xr, nb, &out[i]) : dot32_packed16(T, TWO, 1, g, gb, xr, nb, &out[i]))
#define Q8(TWO) (nr == 2 ? q8_packed16(TWO, 2, g, gb, xr, nb, &out[i]) : q8_packed16(TWO, 1, g, gb, xr, nb, &out[i]))
#define DIRECT(TWO)                                                                                    \
        switch (t) {                                                                                   \
        case T_Q4_0: B(T_Q4_0, TWO); break;                                                            \
        case T_Q4_1: B(T_Q4_1, TWO); break;                                                            \
        case T_Q5_0: B(T_Q5_0, TWO); break;                                                            \
        case T_Q5_1: B(T_Q5_1, TWO); break;                                                            \
        case T_Q8_0: Q8(TWO); break;                                                                   \
        case T_Q4_K:                                                                                   \
            if (nr == 2) dotk4_pair_rows2(TWO, g, gb, xk, nb, &out[i]);                                \
            else out[i] = K(T_Q4_K, TWO);                                                              \
            break;                                                                                     \
        case T_Q5_K: out[i] = K(T_Q5_K, TWO); break;                                                   \
        default: out[i] = K(T_Q6_K, TWO); break;                                                       \
        }
        if (hv == 2) { DIRECT(1) } else { DIRECT(0) }
#undef DIRECT
#undef Q8
#undef B
#undef K
    }
    store16(j, group, 2, m0, mt, out);
}
#endif

#if VNNI < 2
/* few x rows (2 to direct_rows), packed 4/5-bit types on 256-bit vectors: 4 x rows a pass, then the 3 or 2 left
 * (dot32v_rows), or a last one alone. A function of its own, not inlined into mm_task, so that the one-row kernels'
 * code stays as it is (a larger mm_task moved them by 1-5 %). */
AVX2 __attribute__((noinline)) static void direct_rows_group(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, pf = GROUP * j->row_bytes, nb = j->K / 32;
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    const uint8_t *g = j->w + group * GROUP * j->row_bytes;
    __m256 out[MTILE];
    for (int64_t i = 0, nr; i < mt; i += nr) {
        nr = mt - i >= 4 ? 4 : mt - i;
        const char *h = xq + hv * i * xrb, *l = hv == 2 ? h + xrb : h;
        const xblock32 *xr[8];
        for (int k = 0; k < 2 * nr; k++) xr[k] = (const xblock32 *)half_row(h, l, hv, xrb, k);
#define B(T, TWO)                                                                                                 \
        (nr == 4 ? dot32v_rows(T, TWO, 4, g, xr, nb, pf, &out[i])                                                 \
         : nr == 3 ? dot32v_rows(T, TWO, 3, g, xr, nb, pf, &out[i])                                               \
         : nr == 2 ? dot32v_rows(T, TWO, 2, g, xr, nb, pf, &out[i])                                               \
         : (void)(out[i] = dot32v_direct(T, TWO, 1, &g, xr[0], xr[1], nb, pf)))
#define DIRECT(TWO)                                                                                               \
        switch (t) {                                                                                              \
        case T_Q4_0: B(T_Q4_0, TWO); break;                                                                       \
        case T_Q4_1: B(T_Q4_1, TWO); break;                                                                       \
        case T_Q5_0: B(T_Q5_0, TWO); break;                                                                       \
        default: B(T_Q5_1, TWO); break;                                                                           \
        }
        if (hv == 2) { DIRECT(1) } else { DIRECT(0) }
#undef DIRECT
#undef B
    }
    store_group(j, group, m0, mt, out);
}
#endif

/* the x half-rows of a tile's pass: nx (2 or 4) from half-row i of mq, each at byte `at` of its row (a last odd
 * half-row twice) */
INL void pass_rows(const char *xq, int64_t xrb, int64_t at, int64_t i, int64_t mq, int nx, const char *x[4]) {
    x[0] = xq + i * xrb + at;
    x[1] = xq + (i + 1 < mq ? i + 1 : i) * xrb + at;
    x[2] = nx > 2 ? xq + (i + 2) * xrb + at : x[0];
    x[3] = nx > 2 ? xq + (i + 3) * xrb + at : x[1];
}
#define PASS_ROWS(T, b0)                                                                                          \
    const char *xr_[4];                                                                                          \
    pass_rows(xq, xrb, (b0) * (int64_t)sizeof(T), i, mq, (int)nx, xr_);                                          \
    const T *x0 = (const T *)xr_[0], *x1 = (const T *)xr_[1], *x2 = (const T *)xr_[2], *x3 = (const T *)xr_[3];

/* few x rows: the halves in one pass over the weights, per x row */
INL void direct_group(const mm_job *j, int64_t group, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const uint8_t *rows[GROUP];
    group_rows(j, group, rows);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, pf = GROUP * j->row_bytes;  /* pf: next group */
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    __m256 out[MTILE];
    for (int64_t i = 0; i < mt; i++) {
        const char *h = xq + hv * i * xrb, *l = hv == 2 ? h + xrb : h;
        if (type_block(t) == 32) {
            const int64_t nb = j->K / 32;
            const xblock32 *xh = (const xblock32 *)h, *xl = (const xblock32 *)l;
#define DIRECT(TWO, PK)                                                                          \
            switch (t) {                                                                         \
            case T_Q4_0: out[i] = dot32v_direct(T_Q4_0, TWO, PK, rows, xh, xl, nb, pf); break;  \
            case T_Q4_1: out[i] = dot32v_direct(T_Q4_1, TWO, PK, rows, xh, xl, nb, pf); break;  \
            case T_Q5_0: out[i] = dot32v_direct(T_Q5_0, TWO, PK, rows, xh, xl, nb, pf); break;  \
            case T_Q5_1: out[i] = dot32v_direct(T_Q5_1, TWO, PK, rows, xh, xl, nb, pf); break;  \
            default: out[i] = q8_direct(TWO, PK, rows, xh, xl, nb, pf); break;                  \
            }
            if (j->packed) { if (hv == 2) { DIRECT(1, 1) } else { DIRECT(0, 1) } }
            else if (hv == 2) { DIRECT(1, 0) } else { DIRECT(0, 0) }
#undef DIRECT
        } else {
            const int64_t nb = j->K / 256;
            const xblock256 *xh = (const xblock256 *)h, *xl = (const xblock256 *)l;
            /* packed: k_ahead super-blocks ahead in the group's stream (a whole group ahead, the file rows' distance,
             * is past L1 for a long row: ffn_down's 18944 values of Q6_K, 124 KB a group) */
            const int64_t pk_pf = k_ahead * GROUP * type_bytes(t);
#define DIRECT(F, TWO, W, PF)                                                           \
            switch (t) {                                                                \
            case T_Q4_K: out[i] = F(T_Q4_K, TWO, W, xh, xl, nb, PF); break;            \
            case T_Q5_K: out[i] = F(T_Q5_K, TWO, W, xh, xl, nb, PF); break;            \
            default: out[i] = F(T_Q6_K, TWO, W, xh, xl, nb, PF); break;                \
            }
            if (j->packed) {
                if (hv == 2) { DIRECT(dotk_packed, 1, rows[0], pk_pf) } else { DIRECT(dotk_packed, 0, rows[0], pk_pf) }
            }
            else if (hv == 2) { DIRECT(dotk_direct, 1, rows, pf) } else { DIRECT(dotk_direct, 0, rows, pf) }
#undef DIRECT
        }
    }
    store_group(j, group, m0, mt, out);
}

/* CASE(T) for the 32-value type t, T a constant in each case, so that the compiler specialises each */
#define SWITCH32(t)                                                                                               \
    switch (t) {                                                                                                  \
    case T_Q4_0: CASE(T_Q4_0)                                                                                     \
    case T_Q4_1: CASE(T_Q4_1)                                                                                     \
    case T_Q5_0: CASE(T_Q5_0)                                                                                     \
    case T_Q5_1: CASE(T_Q5_1)                                                                                     \
    default: CASE(T_Q8_0)                                                                                         \
    }

/* 32-value types, many x rows: ng (1 or 2) groups from `group` on, each chunk of blocks unpacked once, then met by
 * the hv mt quantized rows of the tile (acc[g][hv i] = acc_hi (, acc[g][2i + 1] = acc_lo) of x row i): one group 4
 * half-rows at a time, two groups 2 at a time (the 16 x 2 tile of dot32_chunk), then 2 (a last one: twice) */
INL void tile32(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const uint8_t *rows[2][GROUP];
    for (int g = 0; g < ng; g++) group_rows(j, group + g, rows[g]);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, mq = hv * mt, nb = j->K / 32;
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    __m256 acc[2][2 * MTILE + 2];   /* + 2: the unused accumulators of a last pass of 2 */
    for (int g = 0; g < ng; g++)
        for (int64_t i = 0; i < mq; i++) acc[g][i] = _mm256_setzero_ps();
    ubuf32 u[2];
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
        int nkb = nb - b0 < KC ? (int)(nb - b0) : KC;
        for (int g = 0; g < ng; g++) {
            if (j->packed) unpack32(t, 1, rows[g], rows[g][0], b0, nkb, &u[g]);
            else unpack32(t, 0, rows[g], rows[g][0], b0, nkb, &u[g]);
        }
        for (int64_t i = 0, nx; i < mq; i += nx) {
            nx = ng == 1 && mq - i >= 4 ? 4 : 2;
            PASS_ROWS(xblock32, b0)
            __m256 *a2 = ng == 2 ? &acc[1][i] : &acc[0][i + 2], *a3 = ng == 2 ? &acc[1][i + 1] : &acc[0][i + 3];
#define CH(T, NG, NX) dot32_chunk(T, &u[0], &u[1], nkb, NG, NX, x0, x1, x2, x3, &acc[0][i], &acc[0][i + 1], a2, a3)
#define CASE(T) if (ng == 2) CH(T, 2, 2); else if (nx == 4) CH(T, 1, 4); else CH(T, 1, 2); break;
            SWITCH32(t)
#undef CASE
#undef CH
        }
    }
    for (int g = 0; g < ng; g++) store_acc(j, group + g, m0, mt, acc[g]);
}

#if !VNNI
/* AVX2, Q4_0 and Q5_0, many x rows: the weights signed (w = u - off), so that vpmaddubsw reads them from memory (its
 * signed operand; the unsigned one must be a register), and each x quad unsigned (q + 128: matmul's copy of the
 * quantized rows, every q xored with 0x80 once a call, mm_job's xu). An int16 lane's sum of (q + 128) w is
 * sum q w + 128 sum w, the second (c, per block: sum over the quads of maddubs(128, w)) taken off before the widening;
 * both wrap in int16, and sum q w over a lane's 16 products is at most 16 * 16 * 127 = 32512, so the difference is
 * exact: the integer of dot32_chunk, less its offset. */
typedef struct { ubuf32 u; __m256i c[KC]; } ubuf32s;
#define KCS (KC / 2)   /* blocks a chunk: 4 groups' weights, 16 KB, stay in L1 */
INL void unpack32s(int t, int pk, const uint8_t *const *rows, const uint8_t *g, int64_t b0, int nkb, ubuf32s *s) {
    unpack32(t, pk, rows, g, b0, nkb, &s->u);
    const __m256i off = _mm256_set1_epi8(t == T_Q4_0 ? 8 : 16), k128 = _mm256_set1_epi8((char)0x80);
    for (int kb = 0; kb < nkb; kb++) {
        __m256i c = _mm256_setzero_si256();
        for (int q = 0; q < 8; q++) {
            const __m256i w = _mm256_sub_epi8(s->u.v[kb][q], off);
            s->u.v[kb][q] = w;
            c = _mm256_add_epi16(c, _mm256_maddubs_epi16(k128, w));
        }
        s->c[kb] = c;
    }
}

/* one x half-row x (made unsigned: mm_job's xu) against NG (1..4) groups' signed chunks, accumulator a[g] = group g's */
INL void dot32s_chunk(int NG, const ubuf32s *const *u, int nkb, const xblock32 *x, __m256 *const *a) {
    const __m256i z = _mm256_setzero_si256();
    __m256 f0 = *a[0], f1 = NG > 1 ? *a[1] : f0, f2 = NG > 2 ? *a[2] : f0, f3 = NG > 3 ? *a[3] : f0;
    for (int kb = 0; kb < nkb; kb++, x++) {
        __m256i i0 = z, i1 = z, i2 = z, i3 = z;
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i b = BQ(x->q, c);
#define P(k) if (NG > k) { i##k = _mm256_add_epi16(i##k, _mm256_maddubs_epi16(b, u[k]->u.v[kb][c])); REG(i##k); }
            P(0) P(1) P(2) P(3)
#undef P
        }
        const __m256 dx = _mm256_set1_ps(x->d);
#define C(k) if (NG > k) {                                                                                \
            const __m256i s_ = SUM32(_mm256_sub_epi16(i##k, u[k]->c[kb]));                              \
            COMBINE_D(v8, f##k, _mm256_loadu_ps(u[k]->u.d[kb]), dx, s_); }
        C(0) C(1) C(2) C(3)
#undef C
    }
    *a[0] = f0;
    if (NG > 1) *a[1] = f1;
    if (NG > 2) *a[2] = f2;
    if (NG > 3) *a[3] = f3;
}

/* the tile of tile32 for Q4_0 and Q5_0 on AVX2: ng (1..4) groups, each x half-row against all of them at once */
INL void tile32s(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const uint8_t *rows[4][GROUP];
    for (int g = 0; g < ng; g++) group_rows(j, group + g, rows[g]);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, mq = hv * mt, nb = j->K / 32;
    const char *xq = (const char *)j->xu + hv * m0 * xrb;   /* made by matmul from 2 x rows on: a tile has 2 or more */
    __m256 acc[4][2 * MTILE];
    for (int g = 0; g < ng; g++)
        for (int64_t i = 0; i < mq; i++) acc[g][i] = _mm256_setzero_ps();
    ubuf32s u[4];
    const ubuf32s *up[4] = {&u[0], &u[1], &u[2], &u[3]};
    for (int64_t b0 = 0; b0 < nb; b0 += KCS) {
        const int nkb = nb - b0 < KCS ? (int)(nb - b0) : KCS;
        for (int g = 0; g < ng; g++) unpack32s(t, j->packed, rows[g], rows[g][0], b0, nkb, &u[g]);
        for (int64_t i = 0; i < mq; i++) {
            const xblock32 *x = (const xblock32 *)(xq + i * xrb) + b0;
            __m256 *const a[4] = {&acc[0][i], &acc[1][i], &acc[2][i], &acc[3][i]};
            switch (ng) {
            case 1: dot32s_chunk(1, up, nkb, x, a); break;
            case 2: dot32s_chunk(2, up, nkb, x, a); break;
            case 3: dot32s_chunk(3, up, nkb, x, a); break;
            default: dot32s_chunk(4, up, nkb, x, a); break;
            }
        }
    }
    for (int g = 0; g < ng; g++) store_acc(j, group + g, m0, mt, acc[g]);
}
#endif

#if VNNI == 2
/* avx512vnni, 32-value types, many x rows: ng (1 to 4) groups from `group` on as pairs, each a 16-row tile (a lone
 * last group with itself), each chunk of blocks unpacked once side by side, then met by the tile's quantized rows 4
 * at a time (a last 2 or 3: 2 at a time, a last odd one twice), against both pairs at once (dot32_chunk16); two
 * pairs take chunks of KC / 2 blocks, so that they stay in L1 */
INL void tile32x2(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t m1) {
    const int t = j->qtype, np = (ng + 1) / 2, kc = KC / np;
    const uint8_t *rows[4][GROUP];
    for (int g = 0; g < 2 * np; g++) group_rows(j, group + (g < ng ? g : ng - 1), rows[g]);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, mq = hv * mt, nb = j->K / 32;
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    __m512 acc[2][2 * MTILE + 4];   /* + 4: the unused accumulators of a last pass */
    for (int p = 0; p < np; p++)
        for (int64_t i = 0; i < mq + 4; i++) acc[p][i] = _mm512_setzero_ps();
    ubuf32x2 u[2];
#if AMX
    __m512i sv[2][KC][8];   /* amx_signed types: the chunk as signed bytes */
#endif
    for (int64_t b0 = 0; b0 < nb; b0 += kc) {
        int nkb = nb - b0 < kc ? (int)(nb - b0) : kc;
        for (int g = 0; g < 2 * np; g++) {
            ubuf32x2 *b = u + g / 2;
            const int h = g % 2;
            if (j->packed) unpack32_to(t, 1, rows[g], rows[g][0], b0, nkb, &b->v[0][0][h], NULL, b->d[0][h], b->m[0][h], 2, 1);
            else unpack32_to(t, 0, rows[g], rows[g][0], b0, nkb, &b->v[0][0][h], NULL, b->d[0][h], b->m[0][h], 2, 1);
        }
        for (int64_t i = 0, nx; i < mq; i += nx) {
#if AMX
            if (mq - i >= 16) {   /* 16 half-rows: one tile */
                nx = 16;
                amx_configure(AMX_TILES32);
                const xblock32 *xa = (const xblock32 *)(xq + i * xrb) + b0;
                for (int p = 0; p < np; p++) {
                    if (i == 0 && amx_signed(t)) amx_sign_chunk(t, u + p, nkb, sv[p]);
#define CASE(T) amx_chunk16(T, u + p, sv[p], nkb, xa, xrb, &acc[p][i]); break;
                    SWITCH32(t)
#undef CASE
                }
                continue;
            }
#endif
            nx = mq - i >= 4 ? 4 : 2;
            PASS_ROWS(xblock32, b0)
#define CH(T, NP, NX) dot32_chunk16(T, NP, &u[0], &u[1], nkb, NX, x0, x1, x2, x3, &acc[0][i], &acc[1][i])
#define CASE(T) if (np == 2) { if (nx == 4) CH(T, 2, 4); else CH(T, 2, 2); }                                        \
                else if (nx == 4) CH(T, 1, 4); else CH(T, 1, 2);                                                  \
                break;
            SWITCH32(t)
#undef CASE
#undef CH
        }
    }
    for (int p = 0; p < np; p++) store_acc16(j, group + 2 * p, ng - 2 * p < 2 ? 1 : 2, m0, mt, acc[p]);
}
#endif

/* K-quants, many x rows: ng (up to TGK) groups from `group` on, KS(t) super-blocks of each unpacked at a time, then
 * met by the tile's quantized rows, 2 at a time (a lone group: 4) -- each pass of x rows against every group, two
 * at a time (the 16 x 2 tile of dotk_chunk, a last one alone), so that Q6_K's offsets of the pass are made once */
INL void tilek(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const uint8_t *rows[KUNITS][GROUP];
    for (int g = 0; g < ng; g++) group_rows(j, group + g, rows[g]);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, mq = hv * mt, nb = j->K / 256;
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    __m256 acc[KUNITS][2 * MTILE + 2];
    for (int g = 0; g < ng; g++)
        for (int64_t i = 0; i < mq; i++) acc[g][i] = _mm256_setzero_ps();
    ubufk u[KUNITS];   /* group g's chunk at u + g ks */
    k6off off[4];
    const int ks = KS(t);
    for (int64_t b0 = 0; b0 < nb; b0 += ks) {
        int nks = nb - b0 < ks ? (int)(nb - b0) : ks;
        for (int g = 0; g < ng; g++) {
            if (j->packed) unpackk(t, 1, rows[g], b0, nks, u + g * ks);
            else unpackk(t, 0, rows[g], b0, nks, u + g * ks);
        }
        for (int64_t i = 0, nx; i < mq; i += nx) {
            nx = ng == 1 && mq - i >= 4 ? 4 : 2;
            PASS_ROWS(xblock256, b0)
            if (t == T_Q6_K) {
                k6_offsets(x0, nks, &off[0]);
                k6_offsets(x1, nks, &off[1]);
                if (nx > 2) { k6_offsets(x2, nks, &off[2]); k6_offsets(x3, nks, &off[3]); }
            }
            for (int g = 0; g < ng; g += 2) {
                const int two = g + 1 < ng;
                __m256 *a2 = two ? &acc[g + 1][i] : &acc[g][i + 2], *a3 = two ? &acc[g + 1][i + 1] : &acc[g][i + 3];
#define CH(T, NG, NX) dotk_chunk(T, u + g * ks, u + (two ? g + 1 : g) * ks, nks, NG, NX, x0, x1, x2, x3, &off[0], &off[1], \
                                 &off[2], &off[3], &acc[g][i], &acc[g][i + 1], a2, a3)
#define CASE(T) if (two) CH(T, 2, 2); else if (nx == 4) CH(T, 1, 4); else CH(T, 1, 2); break;
                switch (t) {
                case T_Q4_K: CASE(T_Q4_K)
                case T_Q5_K: CASE(T_Q5_K)
                default: CASE(T_Q6_K)
                }
#undef CASE
#undef CH
            }
        }
    }
    for (int g = 0; g < ng; g++) store_acc(j, group + g, m0, mt, acc[g]);
}

#if VNNI == 2
/* avx512vnni, K-quants, many x rows: ng (up to TGK) groups from `group` on as pairs (a lone last group with itself),
 * KS(t) super-blocks of each unpacked side by side at a time, then met by the tile's quantized rows 4 at a time, each
 * pass of x rows against every pair */
INL void tilek16(const mm_job *j, int64_t group, int ng, int64_t m0, int64_t m1) {
    const int t = j->qtype, np = (ng + 1) / 2;
    const uint8_t *rows[KUNITS][GROUP];
    for (int g = 0; g < ng; g++) group_rows(j, group + g, rows[g]);
    const int64_t mt = m1 - m0, xrb = j->xq_row_bytes, hv = j->halves, mq = hv * mt, nb = j->K / 256;
    const char *xq = (const char *)j->xq + hv * m0 * xrb;
    __m512 acc[KUNITS / 2][2 * MTILE_K + 4];
    for (int p = 0; p < np; p++)
        for (int64_t i = 0; i < mq + 4; i++) acc[p][i] = _mm512_setzero_ps();
    ubufk2 u[KUNITS / 2];   /* pair p's chunk at u + p ks */
#if AMX
    kplanes kp[KUNITS / 2];   /* its planes (amx_kplanes), where the tiles run: from 32 half-rows on (measured, 1
                               * thread, 7B shapes: at 16, one pass does not repay the planes, Q4_K 0.84x the 512-bit
                               * tiles; at 32 1.4-2x) */
    const int amx = mq >= 32;
#endif
    k6off off[4];
    const int ks = KS(t) < KUNITS / 2 / np ? KS(t) : KUNITS / 2 / np;   /* 4 pairs (amx's task_groups): 1 */
    for (int64_t b0 = 0; b0 < nb; b0 += ks) {
        int nks = nb - b0 < ks ? (int)(nb - b0) : ks;
        for (int g = 0; g < 2 * np; g++) {
            const int src = g < ng ? g : ng - 1, pk = j->packed;
            for (int kb = 0; kb < nks; kb++) {
                ubufk2 *b = u + g / 2 * ks + kb;
                const int h = g % 2;
                if (pk) unpackk_to(t, 1, rows[src], b0 + kb, &b->v[0][h], &b->sc[0][h], &b->corr[0][h], b->d[h], b->dmin[h], 2);
                else unpackk_to(t, 0, rows[src], b0 + kb, &b->v[0][h], &b->sc[0][h], &b->corr[0][h], b->d[h], b->dmin[h], 2);
            }
        }
#if AMX
        if (amx)
            for (int p = 0; p < np; p++)
                for (int kb = 0; kb < nks; kb++) amx_kplanes(t, u + p * ks + kb, kp + p * ks + kb);
#endif
        for (int64_t i = 0, nx; i < mq; i += nx) {
#if AMX
            if (amx && mq - i >= 16) {   /* 32 or 16 half-rows: two tiles or one */
                nx = mq - i >= 32 ? 32 : 16;
                amx_configure(AMX_TILESK);
                const xblock256 *xa = (const xblock256 *)(xq + i * xrb) + b0;
                for (int p = 0; p < np; p++) {
#define CASE(T) for (int kb = 0; kb < nks; kb++) {                                                               \
                    const int e = p * ks + kb;                                                                    \
                    if (nx == 32) amx_superk(T, 1, u + e, kp + e, xa + kb, xrb, &acc[p][i]);                      \
                    else amx_superk(T, 0, u + e, kp + e, xa + kb, xrb, &acc[p][i]);                               \
                } break;
                    switch (t) {
                    case T_Q4_K: CASE(T_Q4_K)
                    case T_Q5_K: CASE(T_Q5_K)
                    default: CASE(T_Q6_K)
                    }
#undef CASE
                }
                continue;
            }
#endif
            nx = mq - i >= 4 ? 4 : 2;
            PASS_ROWS(xblock256, b0)
            if (t == T_Q6_K) {
                k6_offsets(x0, nks, &off[0]);
                k6_offsets(x1, nks, &off[1]);
                if (nx > 2) { k6_offsets(x2, nks, &off[2]); k6_offsets(x3, nks, &off[3]); }
            }
            for (int p = 0; p < np; p += 2) {   /* two pairs at a time, a last lone one alone */
#define CH(T, NP, NX) dotk_chunk16(T, NP, u + p * ks, u + (p + 1) * ks, nks, NX, x0, x1, x2, x3, &off[0], &off[1],   \
                                   &off[2], &off[3], &acc[p][i], &acc[p + 1][i])
#define CASE(T) if (p + 1 == np) { if (nx == 4) CH(T, 1, 4); else CH(T, 1, 2); }                                     \
                else if (nx == 4) CH(T, 2, 4); else CH(T, 2, 2);                                                     \
                break;
                switch (t) {
                case T_Q4_K: CASE(T_Q4_K)
                case T_Q5_K: CASE(T_Q5_K)
                default: CASE(T_Q6_K)
                }
#undef CASE
#undef CH
            }
        }
    }
    for (int p = 0; p < np; p++) store_acc16(j, group + 2 * p, ng - 2 * p < 2 ? 1 : 2, m0, mt, acc[p]);
}
#endif

/* weight groups per task for a tile of mt x rows: on 256-bit vectors 2 where the 16-row tile runs -- Q4_0, Q5_0
 * (measured, 1 thread: +13% at 256 rows, +10% at 8; Q4_1 loses 2-4%, its m term keeping more vectors live; Q8_0's
 * sign step is per group, nothing to share) -- and on AVX2 4 for them (tile32s: the weights read by their maddubs,
 * each x quad's broadcast shared by 4 groups; measured, 2 threads, 4096 x 4096 at 256 rows, the builds alternated in
 * one process: 1.04-1.08x the 16-row tile); the K-quants, tiled: TGK (tilek). On 512-bit vectors, pairs of groups
 * (tile32x2, tilek16), two of them at once where that pays (below). */
AVX2 static int task_groups(int t, int64_t mt) {
    /* direct: one group, or a pair on 512-bit vectors (direct_pair); packed K-quants direct up to 3 rows: TGK groups,
     * met in pairs or one at a time */
    if (mt <= direct_rows(t, 0)) return VNNI == 2 ? 2 : 1;
    /* the K-quants: amx, the tiles' 4 pairs; avx512vnni, from 16 rows on, at least 2 pairs, met at once (tilek16;
     * measured, `tracelm bench kernels`, 2 threads, Qwen2.5-7B's shapes at 256 rows: ffn_gate_up 6%, ffn_down 10%
     * faster; at 8 rows, where Q4_K's big products read memory-bound, its 4 groups were slower in a scratch build) */
    if (type_block(t) == 256) return AMX && mt >= 16 ? KUNITS : VNNI == 2 && TGK(t) < 4 && mt >= 16 ? 4 : TGK(t);
    if (VNNI == 2) return AMX ? 2 : 4;   /* avx512vnni: two pairs at once (tile32x2); amx: a pair, for its tiles */
    return t == T_Q4_0 || t == T_Q5_0 ? (VNNI ? 2 : 4) : 1;   /* AVX2: tile32s */
}

/* ======================================================================================================
 * the task: weight groups g0.. (j->gstep of them, fewer at the end) against x rows m0..m1
 * ==================================================================================================== */
AVX2 static void mm_task(const mm_job *j, int64_t g0, int64_t m0, int64_t m1) {
    const int t = j->qtype;
    const int64_t g1 = j->n_groups - g0 < j->gstep ? j->n_groups : g0 + j->gstep;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = g * GROUP, nr = j->N - n0 < GROUP ? j->N - n0 : GROUP;
        switch (t) {   /* constant t: the compiler specialises each */
        case T_F32: dotf_task(T_F32, j, n0, nr, m0, m1); break;
        case T_F16: dotf_task(T_F16, j, n0, nr, m0, m1); break;
        case T_BF16: dotf_task(T_BF16, j, n0, nr, m0, m1); break;
        default:
            if (m1 - m0 <= direct_rows(t, j->packed)) {
#if VNNI == 2
                if (j->packed && g + 1 < g1 && (g + 2) * GROUP <= j->N) {
                    direct_pair(j, g, m0, m1);
                    g++;
                    continue;
                }
#else
                if (m1 - m0 > 1 && j->packed && type_block(t) == 32 && t != T_Q8_0) {
                    direct_rows_group(j, g, m0, m1);
                    continue;
                }
#endif
                direct_group(j, g, m0, m1);
            } else {
                const int tg = task_groups(t, m1 - m0), ng = g1 - g < tg ? (int)(g1 - g) : tg;
#if VNNI == 2
                if (type_block(t) == 256) tilek16(j, g, ng, m0, m1);
                else tile32x2(j, g, ng, m0, m1);
#else
                if (type_block(t) == 256) tilek(j, g, ng, m0, m1);
#if !VNNI
                else if (t == T_Q4_0 || t == T_Q5_0) tile32s(j, g, ng, m0, m1);
#endif
                else tile32(j, g, ng, m0, m1);
#endif
                g += ng - 1;
            }
        }
    }
}

/* ======================================================================================================
 * The integer dot's peak (tracelm bench's bound for a prompt's products): `rounds` rounds of 12 independent
 * accumulators, each one dot of the path's widest integer step (VNNI: vpdpbusd; AVX2: maddubs and its int16 add),
 * weights and activations in registers: nothing but the instruction's own throughput. Returns the int8 products.
 * ==================================================================================================== */
#if VNNI == 2
#define PEAK_V __m512i
#define PEAK_SET(c) _mm512_set1_epi32(c)
#define PEAK_DOT(a, w, x) _mm512_dpbusd_epi32(a, w, x)
#define PEAK_ADD(a, b) _mm512_add_epi32(a, b)
#define PEAK_LANES 64
#define DOT_INSN "vpdpbusd zmm"
#else
#define PEAK_V __m256i
#define PEAK_SET(c) _mm256_set1_epi32(c)
#define PEAK_DOT(a, w, x) DOTACC(a, w, x)
#define PEAK_ADD(a, b) _mm256_add_epi32(a, b)
#define PEAK_LANES 32
#define DOT_INSN VNNI ? "vpdpbusd ymm" : "vpmaddubsw ymm"
#endif
static volatile int peak_sink;
AVX2 static int64_t dot_peak(int64_t rounds) {
    PEAK_V w = PEAK_SET(0x01020304), x = PEAK_SET(0x05060708);
    REG(w); REG(x);
#define ACC(k) PEAK_V a##k = PEAK_SET(k);
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7) ACC(8) ACC(9) ACC(10) ACC(11)
#undef ACC
/* named accumulators, each kept in its register; x made opaque after each dot, so that AVX2's maddubs, which does
 * not read the accumulator, is not one product shared by all twelve */
#define ACC(k) a##k = PEAK_DOT(a##k, w, x); REG(a##k); REG(x);
    for (int64_t r = 0; r < rounds; r++) {
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7) ACC(8) ACC(9) ACC(10) ACC(11)
    }
#undef ACC
    const PEAK_V s = PEAK_ADD(PEAK_ADD(PEAK_ADD(PEAK_ADD(a0, a1), PEAK_ADD(a2, a3)), PEAK_ADD(a4, a5)),
                              PEAK_ADD(PEAK_ADD(PEAK_ADD(a6, a7), PEAK_ADD(a8, a9)), PEAK_ADD(a10, a11)));
    int first;
    memcpy(&first, &s, sizeof first);
    peak_sink = first;   /* every accumulator is used */
    return rounds * 12 * PEAK_LANES;
}

#if VNNI == 2
#define LAYER_OPS avx512_layer
#else
#define LAYER_OPS avx2_layer
#endif
const kernel_path PATH_SYM = {PATH_NAME, quantize_row, mm_task, task_groups, &LAYER_OPS, MTILE_K, dot_peak, DOT_INSN,
                               !VNNI};   /* avx2: tile32s reads the unsigned quads */

#else
#if !VNNI
int avx2_compiled(void) { return 0; }
#endif
const kernel_path PATH_SYM = {PATH_NAME, 0, 0, 0, 0, 0, 0, 0};   /* not compiled: no mm_task */
#endif
