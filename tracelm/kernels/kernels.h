/* tracelm kernels: what both paths (portable C, AVX2) share.
 *
 * The one fixed order. out[i, j] is a function of (x row i, w row j) only:
 *
 *  - Quantized weights. x row i is split per block (32 values for Q4_0..Q8_0, 256 for the K-quants) into two
 *    int8 blocks by one quantizer, quant(v): d = amax(v) / 127, id = 1 / d, q = nearbyintf(v * id) (round half
 *    to even, |q| <= 127), plus the integer sums of q (per block of 32, or per 16 for the K-quants):
 *      hi = quant(x)                    (dh, qh)
 *      r  = x - dh * qh                 f32 multiply, then subtract (no FMA), value by value
 *      lo = quant(r)                    (dl, ql)
 *    THE ORDER. Two accumulators, each from acc = 0.0f, weight block after weight block from k = 0: acc_hi
 *    takes the hi blocks, acc_lo the lo blocks, each block's exact integer dot products followed by ONE float
 *    update (COMBINE_* below, with dx = dh or dl); then
 *                                  out = acc_hi + acc_lo
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
 *    Why two halves: one int8 block keeps ~8 bits of each value (error up to dh/2); the residual pass carries
 *    the next ~7 (error up to dl/2 <= dh/254), so against f32 activations a product is off by ~1e-4 of
 *    sqrt(sum (x w)^2) at most instead of ~1e-2 -- at twice the integer work per weight byte.
 *  - F32 / F16 / BF16 weights, f32 x: 32 lanes, acc[l] = acc[l] + w[k] * x[k] for k = l (mod 32), the row
 *    padded with zeros to a multiple of 32, then the fixed tree reduce32.
 *
 * No FMA: the build uses -ffp-contract=off and the AVX2 code is compiled without the fma target.
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

/* Quantized activations, in the caller's scratch buffer: x row m is two rows of blocks, hi at quantized row 2m,
 * lo at 2m + 1 (xq_row_bytes each). */
typedef struct {
    float d;         /* scale: x ~ d * q */
    int32_t sum;     /* sum of q */
    int8_t q[32];
} xblock32;          /* 40 bytes, for Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 */

typedef struct {
    float d;
    int16_t bsum[16];  /* sum of q per 16 values */
    int8_t q[256];
} xblock256;         /* 292 bytes, for Q4_K Q5_K Q6_K */

/* A job for one matmul: tasks are (tile of up to MTILE x rows) x (group of GROUP weight rows). */
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
    const void *xq;         /* quantized x rows (quantized types): 2M rows, hi and lo of each x row */
    int64_t xq_row_bytes;   /* bytes of one half-row */
    int64_t n_groups;       /* ceil(N / GROUP) */
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

/* The reduction of the 32 lanes of the F32/F16/BF16 dot: lanes l and l+16, then l and l+8, l+4, l+2, l+1. */
static inline float reduce32(const float a[32]) {
    float t[16], u[8], v[4];
    for (int l = 0; l < 16; l++) t[l] = a[l] + a[l + 16];
    for (int l = 0; l < 8; l++) u[l] = t[l] + t[l + 8];
    for (int l = 0; l < 4; l++) v[l] = u[l] + u[l + 4];
    float w0 = v[0] + v[2], w1 = v[1] + v[3];
    return w0 + w1;
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

/* ---- the two paths ---- */
typedef struct {
    const char *name;
    void (*quantize_row)(int qtype, const float *x, int64_t K, void *xq);   /* one row of x -> hi row, lo row */
    void (*mm_task)(const mm_job *job, int64_t group, int64_t m0, int64_t m1); /* rows 8g.. x rows m0..m1 */
} kernel_path;

extern const kernel_path portable_path;
extern const kernel_path avx2_path;   /* only if compiled for x86-64 */
int avx2_compiled(void);

/* dequantize rows (portable only; matches gguf.quants bit for bit) */
void dequantize_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t K, float *out, int64_t r0, int64_t r1);

#endif
