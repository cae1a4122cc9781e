/* The elementwise math of the layer kernels, written once. A path includes this file with P defined as its
 * arithmetic -- f1 (scalar, kernels.h) or v8 (8 lanes, layer_avx2.c) -- and LM as the functions' attributes, and
 * gets P_exp, P_tanh, P_silu, P_gelu_tanh, P_rms_out, P_rms_add_out, P_rot: the same IEEE operations, in the same
 * order, on every lane of every path.
 *
 * The ops: P_t the float type, P_i the int32 type, P_c(k) a float constant, P_ic(k) an int one; add sub mul div;
 * min(a, b) = a < b ? a : b and max(a, b) = a > b ? a : b (as MINPS / MAXPS: b when unordered); ibits / fbits
 * reinterpret the bits; iadd isub (wrapping); sra1 (>> 1, arithmetic); shl23 (<< 23); neg / abs flip / clear the
 * sign bit; orsign(a, b) = a with b's sign bit or'ed in.
 */
#ifndef LAYER_MATH_CONSTANTS
#define LAYER_MATH_CONSTANTS
#define LM_CAT_(a, b) a##_##b
#define LM_CAT(a, b) LM_CAT_(a, b)

#define EXP_HI 89.0f                 /* e^89 > FLT_MAX: clamped here, the result is +inf */
#define EXP_LO (-104.0f)             /* e^-104 < half the least subnormal: clamped here, the result is 0 */
#define EXP_LOG2E 1.44269504f        /* log2(e) */
#define EXP_SHIFT 12582912.0f        /* 1.5 * 2^23: y + EXP_SHIFT rounds y to an integer n, kept in the low bits */
#define EXP_LN2_HI 0.693359375f      /* ln 2 to 9 bits (355/512), so n * EXP_LN2_HI is exact for |n| < 2^15 */
#define EXP_LN2_LO (-2.12194440e-4f) /* ln 2 - EXP_LN2_HI */
#define GELU_C ((float)0.044715)     /* the f32 constants of stages/ffn.py gelu_tanh (np.float32 of the double) */
#define GELU_K ((float)0.7978845608028654)   /* sqrt(2 / pi) */
#define SILU_CAP 88.0f               /* stages/ffn.py silu: exp(min(-x, 88)) */
#endif

#define F(name) LM_CAT(P, name)

/* 2^k for k in -126..127: the exponent field k + 127 */
LM F(t) F(pow2)(F(i) k) { return F(fbits)(F(shl23)(F(iadd)(k, F(ic)(127)))); }

/* e^x. x = n ln2 + r with n = round(x log2e) (the EXP_SHIFT rounding) and |r| <= ~0.347, r computed in two steps
 * (Cody-Waite: x - n LN2_HI is exact, then - n LN2_LO); e^r by its Taylor polynomial to r^7 (the r^8 term is
 * below 2^-27 there) in Horner's order; then times 2^n as 2^(n >> 1) * 2^(n - (n >> 1)), so that a subnormal
 * result is rounded once. x is first clamped to [EXP_LO, EXP_HI] (a NaN stays NaN): n is in -150..128.
 * Measured against the exact e^x: within 2 ulp (tests/test_layer_kernels.py). */
LM F(t) F(exp)(F(t) x) {
    x = F(max)(F(c)(EXP_LO), F(min)(F(c)(EXP_HI), x));
    F(t) t = F(add)(F(mul)(x, F(c)(EXP_LOG2E)), F(c)(EXP_SHIFT));
    F(t) n = F(sub)(t, F(c)(EXP_SHIFT));
    F(t) r = F(sub)(F(sub)(x, F(mul)(n, F(c)(EXP_LN2_HI))), F(mul)(n, F(c)(EXP_LN2_LO)));
    F(t) p = F(c)(1.0f / 5040.0f);
    p = F(add)(F(mul)(p, r), F(c)(1.0f / 720.0f));
    p = F(add)(F(mul)(p, r), F(c)(1.0f / 120.0f));
    p = F(add)(F(mul)(p, r), F(c)(1.0f / 24.0f));
    p = F(add)(F(mul)(p, r), F(c)(1.0f / 6.0f));
    p = F(add)(F(mul)(p, r), F(c)(0.5f));
    p = F(add)(F(mul)(p, r), F(c)(1.0f));
    p = F(add)(F(mul)(p, r), F(c)(1.0f));
    F(i) k = F(isub)(F(ibits)(t), F(ibits)(F(c)(EXP_SHIFT)));   /* = n as an integer */
    F(i) k1 = F(sra1)(k);
    return F(mul)(F(mul)(p, F(pow2)(k1)), F(pow2)(F(isub)(k, k1)));
}

/* tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|). Its absolute error is a few 2^-24 (relative error grows
 * as |u| -> 0: 1 - e cancels) -- what gelu's 1 + tanh keeps. */
LM F(t) F(tanh)(F(t) u) {
    F(t) e = F(exp)(F(mul)(F(abs)(u), F(c)(-2.0f)));
    F(t) t = F(div)(F(sub)(F(c)(1.0f), e), F(add)(F(c)(1.0f), e));
    return F(orsign)(t, u);
}

/* silu(x) = x / (1 + exp(min(-x, 88))), the ops of stages/ffn.py silu */
LM F(t) F(silu)(F(t) x) {
    F(t) e = F(exp)(F(min)(F(c)(SILU_CAP), F(neg)(x)));
    return F(div)(x, F(add)(e, F(c)(1.0f)));
}

/* gelu_tanh(x) = ((tanh((((x x) C + 1) x) K) + 1) x) 0.5, the ops of stages/ffn.py gelu_tanh in its order */
LM F(t) F(gelu_tanh)(F(t) x) {
    F(t) in = F(mul)(F(add)(F(mul)(F(mul)(x, x), F(c)(GELU_C)), F(c)(1.0f)), x);
    in = F(tanh)(F(mul)(in, F(c)(GELU_K)));
    return F(mul)(F(mul)(F(add)(in, F(c)(1.0f)), x), F(c)(0.5f));
}

/* RMSNorm's output, given inv = 1 / sqrt(mean(x^2) + eps): (x inv) w, and with the residual added after */
LM F(t) F(rms_out)(F(t) x, F(t) inv, F(t) w) { return F(mul)(F(mul)(x, inv), w); }
LM F(t) F(rms_add_out)(F(t) x, F(t) inv, F(t) w, F(t) res) { return F(add)(F(mul)(F(mul)(x, inv), w), res); }

/* RoPE of a pair (a, b) with the table values at their own dims (ca, sa at a's, cb, sb at b's):
 * a' = a ca + (-b) sa, b' = b cb + a sb -- stages/attention.py rotate's x * cos + partner * sin */
LM void F(rot)(F(t) a, F(t) b, F(t) ca, F(t) sa, F(t) cb, F(t) sb, F(t) *oa, F(t) *ob) {
    *oa = F(add)(F(mul)(a, ca), F(mul)(F(neg)(b), sa));
    *ob = F(add)(F(mul)(b, cb), F(mul)(a, sb));
}

/* the elementwise function an ACT_* / FN_* code names (kernels.h) */
LM F(t) F(act)(int act, F(t) a) {
    switch (act) {
    case ACT_SILU: return F(silu)(a);
    case ACT_GELU_TANH: return F(gelu_tanh)(a);
    case FN_EXP: return F(exp)(a);
    default: return F(tanh)(a);
    }
}

#undef F
