/* tracelm kernels: what both paths (portable C, AVX2) share.
 *
 * The one fixed order. out[i, j] is a function of (x row i, w row j) only:
 *
 *  - Quantized weights. x row i is quantized per block (32 values for Q4_0..Q8_0, 256 for the K-quants) into one
 *    or two int8 blocks (the job's `halves`) by one quantizer, quant(v): d = amax(v) / 127, id = 1 / d,
 *    q = nearbyintf(v * id) (round half to even, |q| <= 127), plus the integer sums of q (per block of 32, or per
 *    16 for the K-quants):
 *      hi = quant(x)                    (dh, qh)
 *      r  = x - dh * qh                 f32 multiply, then subtract (no FMA), value by value   (halves = 2)
 *      lo = quant(r)                    (dl, ql)                                               (halves = 2)
 *    THE ORDER. One accumulator per half, each from acc = 0.0f, weight block after weight block from k = 0:
 *    acc_hi takes the hi blocks, acc_lo the lo blocks, each block's exact integer dot products followed by ONE
 *    float update (COMBINE_* below, with dx = dh or dl); then
 *                                  out = acc_hi                (halves = 1)
 *                                  out = acc_hi + acc_lo       (halves = 2)
 *    Integer sums are exact, so how a path computes them (plain loops, maddubs/madd, offsets folded out) cannot
 *    change a bit. With u the weight's unsigned integer (nibble, 5 or 6 bits) and q the activation's:
 *      Q4_0 / Q5_0   isum = sum (u - 8 | 16) q      acc = acc + (d*dx)*isum
 *      Q8_0          isum = sum w q                 acc = acc + (d*dx)*isum
 *      Q4_1 / Q5_1   isum = sum u q, s = sum q      acc = acc + ((d*dx)*isum + (m*dx)*s)
 *      Q4_K / Q5_K   A = sum_j sc_j sum_(j) u q, B = sum_j mn_j sum_(j) q  (8 sub-blocks of 32)
 *                                                   acc = acc + ((d*dx)*A - (dmin*dx)*B)
 *      Q6_K          A = sum_i sc_i sum_(i) (u - 32) q  (16 sub-blocks of 16)
 *                                                   acc = acc + (d*dx)*A
 *    (d, m, dmin: the weight block's f16 values as f32; dx: the x block's d; integers converted to float.)
 *    Edge cases, the same rule for both halves: a block with a non-finite value gets d = NaN (q = 0), so its
 *    products are NaN on every path (a non-finite x block makes r NaN, so lo is NaN too); a block whose amax is
 *    below 2^-100 is all zeros (d = 0; a tiny x block gives r = x, so lo is zeros too; an x block that hi
 *    represents exactly gives r = 0, lo zeros).
 *    One half or two: one int8 block keeps ~8 bits of each value (error up to dh/2), what llama.cpp's q8_0 / q8_K
 *    activations keep; the residual pass carries the next ~7 (error up to dl/2 <= dh/254), so against f32
 *    activations a product is off by ~1e-4 of sqrt(sum (x w)^2) at most instead of ~1e-2 -- at twice the integer
 *    work per weight byte.
 *  - F32 / F16 / BF16 weights, f32 x: 32 lanes, acc[l] = acc[l] + w[k] * x[k] for k = l (mod 32), the row
 *    padded with zeros to a multiple of 32, then the fixed tree reduce32.
 *
 * The layer kernels (layer.c; layer_portable.c, layer_avx2.c and its 512-bit twin layer_avx512.c). Their elementwise
 * math is written once, in layer_math.h, over the scalar ops f1_* (portable) or the 8-lane ops v8_* (AVX2): exp, tanh,
 * silu, gelu_tanh, the RMSNorm output and the RoPE pair are the same IEEE operations on both paths. Each output row
 * depends on its own input row (and, for attend, its own span of keys) alone. The reductions:
 *  - rms_norm, per row of d values: ss = 32 lanes, acc[l] = acc[l] + x[k] * x[k] for k = l (mod 32), the row
 *    padded with zeros to a multiple of 32, then reduce32; inv = 1 / sqrtf(ss / d + eps) (f32 divide, add,
 *    correctly rounded square root, divide, in that order); out = (x * inv) * w, or ((x * inv) * w) + residual.
 *  - attend, per (query row t, head h), over the keys j = k0..k1-1 of the row's span, i = j - k0, n = k1 - k0:
 *      qs[d] = q[d] * scale
 *      s_i   = acc = 0, acc = acc + qs[d] * k_j[d] for d = 0..hd-1 in order (one chain per key)
 *      m     = 8 lanes (i mod 8) from -inf, lane = max(lane, s_i) for i in order (max(a, b) = a > b ? a : b),
 *              then max(lane l, lane l + 4), max(l, l + 2), max(0, 1)
 *      p_i   = exp(s_i - m)                      (layer_math.h's exp)
 *      sum   = 8 lanes (i mod 8) from 0, lane = lane + p_i for i in order, then (l + l+4), (l + l+2), (0 + 1)
 *      o[d]  = acc = 0, acc = acc + p_i * v_j[d] for i = 0..n-1 in order; out[d] = acc / sum
 *    An empty span (n = 0) gives out = 0. Keys and values may be f16 (converted exactly to f32 first).
 *    Or q8_0 (kv_cache q8_0; ggml's blocks of 32: an f16 d, then 32 int8; a head dim not a multiple of 32 padded
 *    with zero values; docs/architecture.md, stages/attention.py q8_0_scores, q8_0_weighted): the query qs is
 *    rounded to blocks by the Cache's rule (q8_0_query below), and with the blocks b = 0..nb-1 of key j
 *      s_i   = acc = 0, acc = acc + (dq_b * dk_b) * isum_b for b in order,  isum_b = sum qq * qk (exact integers)
 *      o[d]  = acc = 0, acc = acc + (p_i * dv_b) * qv_j[d] for i = 0..n-1 in order (b: the block of dim d)
 *    -- the max, exps and sum as above.
 * The elementwise steps, for reference (layer_math.h has them in full):
 *  - exp(x): x clamped to [-104, 89]; n = round(x log2e) (+ 1.5 * 2^23, then -), r = (x - n ln2_hi) - n ln2_lo;
 *    e^r = Taylor to r^7 in Horner's order; times 2^(n >> 1), then times 2^(n - (n >> 1)). Within 2 ulp.
 *  - tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|); silu(x) = x / (exp(min(-x, 88)) + 1);
 *    gelu_tanh(x) = ((tanh((((x x) c + 1) x) k) + 1) x) 0.5 (stages/ffn.py's order); act(gate) * up.
 *  - rope, per pair (a, b) with the table values at each one's dim: a' = a ca + (-b) sa, b' = b cb + a sb.
 *
 * No FMA: the build uses -ffp-contract=off and the AVX2 code is compiled without the fma target.
 *
 * Packed weights (x8). A matrix of a quantized type (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0, Q4_K Q5_K Q6_K) with a multiple of
 * 8 rows may be held packed: each group of 8 rows keeps its 8 * row_bytes bytes, reordered block by block so that
 * a kernel loads a block of the 8 rows with a few vector loads instead of gathering it (llama.cpp repacks
 * likewise). Block b of the group is 8 * tb bytes at b * 8 * tb, the file's fields in the file's order, each at
 * 8 times its offset in the file's block, the 8 rows' units side by side: unit k of row r of a field at
 * 8 f + 8 u k + u r (f: the field's offset in the file's block, u: its unit). The units: 2 bytes for the f16
 * values (d; m of Q4_1, Q5_1; dmin of Q4_K, Q5_K; Q6_K's d, its last 2 bytes); 32 for Q8_0's quants; 4 for the
 * rest (qh, nibbles, K-quant scales, ql). So a vector of 32 bytes holds one dword of each of the 8 rows: Q4/Q5,
 * dword c (c = 0..3) of row r's 16 nibble bytes at 32 c + 4 r of the quants; Q4_K, the 12 scale bytes as 3 such
 * vectors at 32 (lane r: row r's kscales u0, u1, u2), the 128 nibble bytes as 32 at 128; Q5_K, its qh as 8 at
 * 128, the nibbles at 384; Q6_K, ql as 32 at 0, qh as 16 at 1024, the 16 scales as 4 at 1536, d at 1664.
 * Some bits move too. Q5_0 / Q5_1's 32-bit qh, spread by quad: bit 8b + c of the packed dword is the file's bit
 * 4c + b (byte b holds one fifth bit of each quad c = 4 values, so a quad's fifth bits are one shift and a mask
 * away). Q6_K's 6-bit values, regrouped in the three bytes that hold 4 of them: with a = ql[64h + l] (the low
 * nibbles of values v = 128h + l and v + 64), b = ql[64h + 32 + l] (of v + 32, v + 96) and c = qh[32h + l] (the
 * top 2 bits of v, v + 32, v + 64, v + 96, from bit 0), h = 0, 1, l = 0..31, the packed block holds in a's place
 * v's 6 bits | the top bits of v + 64 << 6, in b's place v + 32's 6 bits | the top bits of v + 96 << 6, in c's
 * place the low nibbles of v + 64 | v + 96 << 4 (so two quads of 6-bit values are one mask away, two a few
 * shifts). Only the place of each byte and of these bits changes: the numbers, and so the bits, are those of the
 * file's rows.
 */
#ifndef TRACELM_KERNELS_H
#define TRACELM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGML type numbers (gguf.GGMLQuantizationType) */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

/* Quantized activations, in the caller's scratch buffer: x row m is `halves` rows of blocks (xq_row_bytes each),
 * hi at quantized row halves * m, and with two halves lo at 2m + 1. */
typedef struct {
    float d;         /* scale: x ~ d * q */
    int32_t sum;     /* sum of q */
    int8_t q[32];
} xblock32;          /* 40 bytes, for Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 */

typedef struct {
    int8_t q[256];     /* first, and the block a multiple of 64 bytes: in a scratch from a 64-byte boundary (XQ_ALIGN)
                        * every block's q starts a cache line, as AMX's tile loads want (a row split over two lines
                        * loads ~6x slower) */
    float d;
    int16_t bsum[16];  /* sum of q per 16 values */
    int16_t bsum32[8]; /* sum of q per 32 values (the Q4_K/Q5_K mins' sub-blocks; as 4 int16 pairs, one load each) */
    uint8_t pad[12];
} xblock256;         /* 320 bytes, for Q4_K Q5_K Q6_K */

/* A job for one matmul: tasks are (tile of up to MTILE x rows) x (gstep groups of GROUP weight rows). */
#define GROUP 8
#define MTILE 64
typedef struct {
    int qtype;
    int64_t M, N, K;
    const float *x;         /* [M, K] */
    const uint8_t *w;       /* [N, row_bytes] */
    int64_t row_bytes;
    float *out;             /* [M, N], row m at out + m * ldo */
    int64_t ldo;            /* out's row stride in floats (>= N) */
    const void *xq;         /* quantized x rows (quantized types): halves * M rows, hi (and lo) of each x row */
    int64_t xq_row_bytes;   /* bytes of one half-row */
    const void *xu;         /* Q4_0/Q5_0 on a path with unsigned_x: xq again, each q made unsigned (q ^ 0x80), made
                             * once a call (xu_row_bytes); NULL: not made */
    int halves;             /* 1: hi only; 2: hi and lo */
    int packed;             /* w is packed (x8, above): group g at w + 8 g row_bytes */
    int64_t n_groups;       /* ceil(N / GROUP) */
    int64_t gstep;          /* groups per task (the path's task_groups; the last task may have fewer) */
    int64_t mtile;          /* x rows per task */
} mm_job;

/* ---- half and bfloat16 to float, exact ---- */
static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    if (e == 0x1f)                       /* inf, nan (quieted, as F16C does) */
        return f32_from_bits(sign | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0));
    if (e == 0) {
        if (m == 0) return f32_from_bits(sign);
        e = 113;                          /* subnormal: normalise (value m * 2^-24) */
        while (!(m & 0x400u)) { m <<= 1; e--; }
        return f32_from_bits(sign | (e << 23) | ((m & 0x3ffu) << 13));
    }
    return f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
}
static inline float bf16_to_float(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* ---- the float part of one weight block, written once ----
 * P is the arithmetic: P##_add, P##_sub, P##_mul, P##_cvt (int -> float). The portable path expands these with
 * scalar float ops (f1_*), the AVX2 path with 8-lane ops (v8_*), one weight row per lane: the same IEEE
 * operations on every lane, in the same order. */
#define COMBINE_D(P, acc, d, dx, isum) \
    acc = P##_add(acc, P##_mul(P##_mul(d, dx), P##_cvt(isum)))                   /* Q4_0 Q5_0 Q8_0 Q6_K */
#define COMBINE_DM(P, acc, d, m, dx, isum, sumq) \
    acc = P##_add(acc, P##_add(P##_mul(P##_mul(d, dx), P##_cvt(isum)),            /* Q4_1 Q5_1 */ \
                               P##_mul(P##_mul(m, dx), P##_cvt(sumq))))
#define COMBINE_K(P, acc, d, dmin, dx, A, B) \
    acc = P##_add(acc, P##_sub(P##_mul(P##_mul(d, dx), P##_cvt(A)),               /* Q4_K Q5_K */ \
                               P##_mul(P##_mul(dmin, dx), P##_cvt(B))))

#define f1_add(a, b) ((a) + (b))
#define f1_sub(a, b) ((a) - (b))
#define f1_mul(a, b) ((a) * (b))
#define f1_cvt(i) ((float)(i))

/* the rest of the scalar arithmetic of layer_math.h (integers wrap, as the vector ones do) */
#define f1_t float
#define f1_i int32_t
#define f1_c(k) (k)
#define f1_ic(k) ((int32_t)(k))
#define f1_div(a, b) ((a) / (b))
#define f1_min(a, b) ((a) < (b) ? (a) : (b))   /* as MINPS: b when unordered */
#define f1_max(a, b) ((a) > (b) ? (a) : (b))   /* as MAXPS */
#define f1_ibits(a) ((int32_t)bits_from_f32(a))
#define f1_fbits(i) f32_from_bits((uint32_t)(i))
#define f1_iadd(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define f1_isub(a, b) ((int32_t)((uint32_t)(a) - (uint32_t)(b)))
#define f1_sra1(a) ((a) >> 1)                   /* arithmetic shift (gcc, clang) */
#define f1_shl23(a) ((int32_t)((uint32_t)(a) << 23))
#define f1_neg(a) f32_from_bits(bits_from_f32(a) ^ 0x80000000u)
#define f1_abs(a) f32_from_bits(bits_from_f32(a) & 0x7fffffffu)
#define f1_orsign(a, b) f32_from_bits(bits_from_f32(a) | (bits_from_f32(b) & 0x80000000u))

/* The reduction of the 32 lanes of the F32/F16/BF16 dot: lanes l and l+16, then l and l+8, l+4, l+2, l+1. */
static inline float reduce32(const float a[32]) {
    float t[16], u[8], v[4];
    for (int l = 0; l < 16; l++) t[l] = a[l] + a[l + 16];
    for (int l = 0; l < 8; l++) u[l] = t[l] + t[l + 8];
    for (int l = 0; l < 4; l++) v[l] = u[l] + u[l + 4];
    float w0 = v[0] + v[2], w1 = v[1] + v[3];
    return w0 + w1;
}

/* attend's 8 lanes of a max and of a sum: lanes l and l+4, then l and l+2, then 0 and 1 */
static inline float lanes8_max(const float a[8]) {
    float u[4], v[2];
    for (int l = 0; l < 4; l++) u[l] = f1_max(a[l], a[l + 4]);
    for (int l = 0; l < 2; l++) v[l] = f1_max(u[l], u[l + 2]);
    return f1_max(v[0], v[1]);
}
static inline float lanes8_sum(const float a[8]) {
    float u[4], v[2];
    for (int l = 0; l < 4; l++) u[l] = a[l] + a[l + 4];
    for (int l = 0; l < 2; l++) v[l] = u[l] + u[l + 2];
    return v[0] + v[1];
}

/* ---- activation quantization (both paths produce these exact bytes) ----
 * A block with a non-finite value gets d = NaN (q = 0), so its products are NaN on every path; a block whose
 * amax is below 2^-100 is all zeros (d = 0), so 1/d never overflows. The lo half is the same quantizer on
 * r = x - dh * qh. */
#define TINY_AMAX 7.888609052210118e-31f /* 2^-100 */

/* ---- K-quant 6-bit scales and mins: 12 bytes -> sc[8], mn[8] ---- */
static inline void kscales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u0 = rd32(s), u1 = rd32(s + 4), u2 = rd32(s + 8);
    uint32_t a = u0 & 0x3f3f3f3fu, b = u1 & 0x3f3f3f3fu;
    uint32_t c = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    uint32_t e = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
    for (int i = 0; i < 4; i++) {
        sc[i] = (uint8_t)(a >> (8 * i)); mn[i] = (uint8_t)(b >> (8 * i));
        sc[4 + i] = (uint8_t)(c >> (8 * i)); mn[4 + i] = (uint8_t)(e >> (8 * i));
    }
}

/* block size (values) and bytes per block; 0 if unsupported */
static inline int type_block(int t) {
    switch (t) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}
static inline int type_bytes(int t) {
    switch (t) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}
static inline int is_float_type(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
static inline int64_t xq_row_bytes(int t, int64_t K) {
    if (is_float_type(t)) return 0;
    return type_block(t) == 32 ? (K / 32) * (int64_t)sizeof(xblock32) : (K / 256) * (int64_t)sizeof(xblock256);
}
/* Q4_0 and Q5_0: the scratch holds the quantized rows twice, the second time (after all of xq, the same layout) with
 * each q made unsigned (q ^ 0x80, stored in its int8): a path's swapped tiles broadcast those quads as they are, one
 * xor a value a call instead of one a quad a task */
static inline int unsigned_copy(int t) { return t == T_Q4_0 || t == T_Q5_0; }
static inline int64_t xu_row_bytes(int t, int64_t K) { return unsigned_copy(t) ? xq_row_bytes(t, K) : 0; }
static inline void unsigned_blocks(const void *xq_half_row, int64_t nb, void *xu_half_row) {
    const xblock32 *b = (const xblock32 *)xq_half_row;
    xblock32 *u = (xblock32 *)xu_half_row;
    for (int64_t i = 0; i < nb; i++) {
        u[i].d = b[i].d;
        u[i].sum = b[i].sum;
        for (int k = 0; k < 32; k++) u[i].q[k] = (int8_t)((uint8_t)b[i].q[k] ^ 0x80u);
    }
}
/* The quantized rows start at the scratch's first 64-byte boundary: scratch_bytes holds XQ_ALIGN bytes more. */
#define XQ_ALIGN 64
static inline char *xq_start(void *scratch) {
    return (char *)(((uintptr_t)scratch + XQ_ALIGN - 1) & ~(uintptr_t)(XQ_ALIGN - 1));
}

/* ---- layer kernels: the jobs (strides in items; a row of values always has unit stride) ---- */
typedef struct { const float *p; int64_t s0, s1; } rows3;   /* row (a, b) at p + a*s0 + b*s1 */

typedef struct {
    int64_t T, H, hd, rope_dim;   /* x [T, H, hd]; cos, sin [T, rope_dim]; dims rope_dim.. pass through */
    int mode;                     /* 0: pairs (2i, 2i+1); 1: pairs (i, i + rope_dim/2) */
    rows3 x, out;
    const float *cos, *sin;
    int64_t cos_s, sin_s;         /* their row strides */
} rope_job;

typedef struct {
    int64_t T, H, Hkv, hd, L;
    rows3 q;                      /* q [T, H, hd] */
    const void *k, *v;            /* [Hkv, L, hd], f32 or f16; or q8_0 [Hkv, L, nb * Q8_BYTES] bytes */
    int f16, q8;
    int64_t nb;                   /* q8_0: blocks per head dim */
    int64_t k_sh, k_sl, k_sd;     /* keys: any strides (head, position, dim), in items (q8_0: bytes, k_sd = 1) */
    int64_t v_sh, v_sl;           /* values: unit dim stride */
    const int64_t *spans;         /* [T, 2]: keys k0..k1-1 seen by query row t */
    float scale;
    float *out;                   /* [T, H * hd] */
    int64_t out_s;
} attend_job;

/* attend's scratch for one task (nh heads of one kv head, a span of n keys), in floats, each part 8-aligned:
 * qs [nh][hd8] | acc [nh][hd8] | a tile | scores [nh][n8] (a phase's task: no scores, they are shared -- layer.c).
 * The tile: 32 keys [hd][32]; q8_0: the query heads' blocks (q8_query) while scoring, then 32 positions' value
 * scales [nb][32] and every head's weights p dv [nh][nb][32] while summing */
#define ATT_TILE 32
static inline int64_t up8(int64_t v) { return (v + 7) / 8 * 8; }
#define Q8_BYTES 34              /* a q8_0 block: f16 d, 32 int8 */
static inline int64_t q8_blocks(int64_t hd) { return (hd + 31) / 32; }
static inline int64_t attend_tile_floats(int64_t hd, int64_t nh) {
    const int64_t nb = q8_blocks(hd), values = ATT_TILE * nb * (nh + 1), query = nh * nb * 9;   /* 9: d, q */
    const int64_t q8 = values > query ? values : query;
    return up8(q8 > ATT_TILE * hd ? q8 : ATT_TILE * hd);
}
static inline int64_t attend_scratch_floats(int64_t hd, int64_t n, int64_t nh) {
    return 2 * nh * up8(hd) + attend_tile_floats(hd, nh) + nh * up8(n);
}

/* ---- kv_cache q8_0 (the rule of state/cache.py q8_0_blocks, bit for bit) ---- */
static inline uint16_t half_from_float(float f) {   /* nearest, ties to even (numpy's astype(float16)) */
    const uint32_t x = bits_from_f32(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);         /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);        /* >= 65520 (inf included): inf */
    if (a < 0x38800000u)                                            /* below 2^-14: a multiple of 2^-24 */
        return (uint16_t)(sign | (uint32_t)__builtin_nearbyintf(f32_from_bits(a) * 16777216.0f));
    return (uint16_t)(sign | (((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10)));
}

/* One q8_0 block of 32 values: q, and d's f16 bits returned. d = amax / 127, q = nearbyintf(v * (1 / d)), d stored
 * as f16; a block with a non-finite value: d NaN, q 0; amax below 2^-100: zeros. */
static inline uint16_t q8_block(const float v[32], int8_t q[32]) {
    float amax = 0.0f;
    int finite = 1;
    for (int c = 0; c < 32; c++) {
        const float a = f1_abs(v[c]);
        finite &= a <= 3.40282347e38f;
        amax = a > amax ? a : amax;
    }
    const int zero = !finite || amax < TINY_AMAX;
    const float d = amax / 127.0f, id = zero ? 0.0f : 1.0f / d;
    for (int c = 0; c < 32; c++) q[c] = zero ? 0 : (int8_t)__builtin_nearbyintf(v[c] * id);
    return !finite ? 0x7e00u : zero ? 0 : half_from_float(d);
}

/* n values (times scale) as q8_0 blocks, the last padded with zeros: d's f16 bits and q of block b to d16[b], q[32 b] */
static inline void q8_row(const float *x, int64_t n, float scale, uint16_t *d16, int64_t d_step, int8_t *q,
                          int64_t q_step) {
    for (int64_t b = 0; 32 * b < n; b++) {
        float v[32];
        for (int c = 0; c < 32; c++) v[c] = 32 * b + c < n ? x[32 * b + c] * scale : 0.0f;
        d16[b * d_step] = q8_block(v, q + b * q_step);
    }
}

/* The query heads h0..h0+nh-1 of row t, times the scale, as q8_0 blocks: per head nb scales (f32 of the f16) then
 * nb * 32 int8, at out + h * nb * 9 floats */
static inline void q8_query(const float *q, int64_t q_s, int64_t nh, int64_t hd, float scale, float *out) {
    const int64_t nb = q8_blocks(hd);
    for (int64_t h = 0; h < nh; h++) {
        float *d = out + h * nb * 9;
        uint16_t d16[nb];
        q8_row(q + h * q_s, hd, scale, d16, 1, (int8_t *)(d + nb), 32);
        for (int64_t b = 0; b < nb; b++) d[b] = half_to_float(d16[b]);
    }
}

/* one key's score against a query head's blocks (qd: its nb scales, qq: its int8): the order above */
static inline float q8_score(const uint8_t *key, const float *qd, const int8_t *qq, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, key += Q8_BYTES) {
        int32_t isum = 0;
        for (int c = 0; c < 32; c++) isum += (int32_t)qq[32 * b + c] * (int8_t)key[2 + c];
        acc = acc + (qd[b] * half_to_float(rd16(key))) * (float)isum;
    }
    return acc;
}

/* the max's 8 lanes over a run of keys (i0 a multiple of 8, so lane l holds the keys i = l mod 8): each lane's
 * max(lane, s_i) from -inf in order, and whether a NaN met it */
typedef struct { float mx[8]; int32_t nan[8]; } lanes8;

/* lane l of the max over runs r = 0..: the lane after run r (len keys) from its value before. max(a, b) = a > b ?
 * a : b keeps the last of equal values and forgets all before a NaN, so one run's fold from -inf, joined thus,
 * is the fold over the whole span from -inf: a NaN in the run: its own fold; no key in the lane: unchanged */
static inline void lanes8_join(float lane[8], const lanes8 *r, int64_t len) {
    for (int l = 0; l < 8 && l < len; l++) lane[l] = r->nan[l] ? r->mx[l] : f1_max(lane[l], r->mx[l]);
}

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, FN_EXP = 2, FN_TANH = 3 };

typedef struct {
    float (*sumsq)(const float *x, int64_t d);    /* rms_norm's ss, in its order */
    void (*rms_row)(const float *x, const float *w, const float *res, float inv, int64_t d, float *out);
    void (*rope_row)(const rope_job *j, int64_t t);
    /* attend, heads h0..h0+nh-1 (of one kv head) of row t, in parts (layer.c runs them as one task or as phases):
     * the scores s_i of keys i0..i1-1 of its span (i0 a multiple of 8) at s + (h - h0) * s_s + i; */
    void (*attend_scores)(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t i0, int64_t i1, float *s,
                          int64_t s_s, float *scratch);
    void (*lane_max)(const float *s, int64_t n, lanes8 *r);   /* the max's lanes over s[0..n) */
    void (*exps)(float *s, int64_t n, float m);               /* s_i = exp(s_i - m) */
    /* out dims d0..d1-1 of the heads: (sum_i p_i v_j[d], i in order) / sum, p at p + (h - h0) * p_s */
    void (*weighted)(const attend_job *j, int64_t t, int64_t h0, int64_t nh, int64_t d0, int64_t d1, const float *p,
                     int64_t p_s, float *scratch);
    /* act(a) * b over n values (b NULL: act(a) alone; act one of ACT_* / FN_*) */
    void (*map_row)(int act, const float *a, const float *b, int64_t n, float *out);
    /* out[i * os] = half_from_float(x[i * xs]), i < n: the Cache's f16 keys and values */
    void (*f16_row)(const float *x, int64_t xs, int64_t n, uint16_t *out, int64_t os);
} layer_ops;

extern const layer_ops portable_layer, avx2_layer, avx512_layer;

/* inv = 1 / sqrt(ss / d + eps), the one order of both paths */
static inline float rms_inv(float ss, int64_t d, float eps) {
    float mean = ss / (float)d;
    return 1.0f / __builtin_sqrtf(mean + eps);
}

/* ---- the two paths ---- */
typedef struct {
    const char *name;
    void (*quantize_row)(int qtype, const float *x, int64_t K, void *xq, int halves);   /* x row -> hi (, lo) */
    void (*mm_task)(const mm_job *job, int64_t group, int64_t m0, int64_t m1); /* groups g.. x rows m0..m1 */
    int (*task_groups)(int qtype, int64_t rows);   /* groups per task for tiles of `rows` x rows */
    const layer_ops *layer;
    int mtile_k;   /* x rows of a tile for the 256-value types (0: MTILE) */
    int64_t (*dot_peak)(int64_t rounds);   /* the path's integer dot at its peak: int8 products done (dot_insn) */
    const char *dot_insn;
    int unsigned_x;   /* its Q4_0/Q5_0 tiles read mm_job's xu (made_unsigned) */
} kernel_path;

/* Whether a job of M x rows of type t on path p needs xu: from 2 rows on (a tile has 2 or more, direct_rows >= 1) */
static inline int wants_unsigned(const kernel_path *p, int t, int64_t M) {
    return p->unsigned_x && unsigned_copy(t) && M > 1;
}
/* x rows m0..m1-1 of xq (halves half-rows each, xrb bytes apiece) made unsigned into xu, the same layout */
static inline void made_unsigned(const char *xq, int64_t xrb, int64_t K, int halves, char *xu, int64_t m0, int64_t m1) {
    for (int64_t r = halves * m0; r < halves * m1; r++) unsigned_blocks(xq + r * xrb, K / 32, xu + r * xrb);
}

extern const kernel_path portable_path;
/* only if compiled for x86-64 (else mm_task is NULL): avx2.c, and avx2.c again with VNNI (avxvnni.c, avx512vnni.c)
 * and with VNNI and AMX tiles (amx.c) */
extern const kernel_path avx2_path, avxvnni_path, avx512vnni_path, amx_path;
/* the K-quants' packed decode prefetch distance (the 512-bit pairs' two streams of 8 rows, the 256-bit kernels' one),
 * in super-blocks ahead in each stream (core.c: 4, or TRACELM_K_AHEAD / set_k_ahead 0..64 for a sweep, 0 leaving the
 * streams to the hardware's prefetchers; a prefetch computes nothing, so every value gives the same bits) */
#define MAX_K_AHEAD 64
extern __attribute__((visibility("hidden"))) int k_ahead;
/* the weights' software prefetch hint (avx2.c's streams, every path on x86-64; core.c: set_prefetch_hint): 0, t0 (into
 * every cache level); 1, nta (non-temporal: into L1, kept out of the outer levels as far as the CPU allows, so that a
 * step's small operands -- norms' weights, the KV cache, activations -- stay there). Same bits either way. */
extern __attribute__((visibility("hidden"))) int prefetch_nta;
#define PREFETCH_W(p)                                                           \
    do {                                                                        \
        if (prefetch_nta) _mm_prefetch((const char *)(p), _MM_HINT_NTA);        \
        else _mm_prefetch((const char *)(p), _MM_HINT_T0);                      \
    } while (0)
int avx2_compiled(void);

/* a matmul job's tiling on path p, from its qtype, M and N */
static inline void mm_job_plan(const kernel_path *p, mm_job *j) {
    j->n_groups = (j->N + GROUP - 1) / GROUP;
    const int64_t mt = type_block(j->qtype) == 256 && p->mtile_k ? p->mtile_k : MTILE;
    j->mtile = j->M < mt ? j->M : mt;
    j->gstep = p->task_groups(j->qtype, j->mtile);
}

/* selftest.c: path p against the portable path, bit for bit, on a fixed battery of types, layouts and shapes
 * (products, the activations' quantizer, the layer kernels): 0 when every bit agrees, else -1 with msg naming the
 * first case that differs; the number of cases checked to *cases */
int path_selftest(const kernel_path *p, int flip, char *msg, size_t n, int *cases);

/* packed weights (x8): which types, and the layout both ways (one group of 8 rows of nb blocks) */
static inline int packable(int t) { return !is_float_type(t) && type_block(t) > 0; }
void pack_group(int qtype, const uint8_t *const rows[8], int64_t nb, uint8_t *out);
void unpack_group(int qtype, const uint8_t *group, int64_t nb, uint8_t *const rows[8]);

/* dequantize rows (portable only; matches gguf.quants bit for bit) */
void dequantize_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t K, float *out, int64_t r0, int64_t r1);

#endif
