/* SHA-256 (FIPS 180-4): the plain C compression function, the same one on the x86 SHA extensions, the padding,
 * and HMAC-SHA256 (RFC 2104). Used by trace_stats.c; tests compare every function with hashlib and hmac. */
#include "sha256.h"

#include <string.h>

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* ---- plain C: W[t] from the block (t < 16) or from W[t-2], W[t-7], W[t-15], W[t-16]; 64 rounds; h += ---- */
static void blocks_c(uint32_t h[8], const uint8_t *p, size_t nb) {
    for (; nb--; p += 64) {
        uint32_t w[64], s[8];
        for (int t = 0; t < 16; t++) w[t] = be32(p + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        memcpy(s, h, sizeof s);
        for (int t = 0; t < 64; t++) {
            uint32_t e = s[4], a = s[0];
            uint32_t t1 = s[7] + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & s[5]) ^ (~e & s[6])) + K256[t] + w[t];
            uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & s[1]) ^ (a & s[2]) ^ (s[1] & s[2]));
            memmove(s + 1, s, 7 * sizeof(uint32_t));
            s[4] += t1;
            s[0] = t1 + t2;
        }
        for (int i = 0; i < 8; i++) h[i] += s[i];
    }
}

/* ---- the SHA extensions: the state as ABEF / CDGH, four rounds per pair of sha256rnds2, the message schedule by
 * sha256msg1 / sha256msg2 (W[t..t+3] from the four vectors before it) ---- */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define SHA_NI __attribute__((target("sha,sse4.1")))

SHA_NI static void blocks_ni(uint32_t h[8], const uint8_t *p, size_t nb) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)h), 0xB1);         /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(h + 4)), 0x1B);  /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                            /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                                 /* CDGH */
    for (; nb--; p += 64) {
        const __m128i abef = s0, cdgh = s1;
        __m128i m[4];
        for (int i = 0; i < 4; i++) m[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {   /* rounds 4g..4g+3 */
            __m128i k = _mm_add_epi32(m[g & 3], _mm_loadu_si128((const __m128i *)(K256 + 4 * g)));
            s1 = _mm_sha256rnds2_epu32(s1, s0, k);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
            if (g < 12) {   /* W[4g+16..4g+19] into the vector that held W[4g..4g+3] */
                __m128i w7 = _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4);
                m[g & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]), w7),
                                                m[(g + 3) & 3]);
            }
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    t = _mm_shuffle_epi32(s0, 0x1B);                       /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                      /* DCHG */
    _mm_storeu_si128((__m128i *)h, _mm_blend_epi16(t, s1, 0xF0));        /* DCBA */
    _mm_storeu_si128((__m128i *)(h + 4), _mm_alignr_epi8(s1, t, 8));     /* HGFE */
}

/* two messages' blocks at once: the rounds of one wait on their own previous round, so two independent chains
 * keep the SHA unit busy (the same operations on each as blocks_ni) */
SHA_NI static void blocks_ni_x2(uint32_t ha[8], const uint8_t *pa, uint32_t hb[8], const uint8_t *pb, size_t nb) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i s0[2], s1[2];
    uint32_t *h[2] = {ha, hb};
    const uint8_t *p[2] = {pa, pb};
    for (int x = 0; x < 2; x++) {
        __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)h[x]), 0xB1);
        s1[x] = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(h[x] + 4)), 0x1B);
        s0[x] = _mm_alignr_epi8(t, s1[x], 8);
        s1[x] = _mm_blend_epi16(s1[x], t, 0xF0);
    }
    for (size_t b = 0; b < nb; b++) {
        __m128i abef[2] = {s0[0], s0[1]}, cdgh[2] = {s1[0], s1[1]}, m[2][4];
        for (int x = 0; x < 2; x++)
            for (int i = 0; i < 4; i++)
                m[x][i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p[x] + 64 * b + 16 * i)), bswap);
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            const __m128i kg = _mm_loadu_si128((const __m128i *)(K256 + 4 * g));
#pragma GCC unroll 2
            for (int x = 0; x < 2; x++) {
                __m128i k = _mm_add_epi32(m[x][g & 3], kg);
                s1[x] = _mm_sha256rnds2_epu32(s1[x], s0[x], k);
                s0[x] = _mm_sha256rnds2_epu32(s0[x], s1[x], _mm_shuffle_epi32(k, 0x0E));
                if (g < 12) {
                    __m128i w7 = _mm_alignr_epi8(m[x][(g + 3) & 3], m[x][(g + 2) & 3], 4);
                    m[x][g & 3] = _mm_sha256msg2_epu32(
                        _mm_add_epi32(_mm_sha256msg1_epu32(m[x][g & 3], m[x][(g + 1) & 3]), w7), m[x][(g + 3) & 3]);
                }
            }
        }
        for (int x = 0; x < 2; x++) {
            s0[x] = _mm_add_epi32(s0[x], abef[x]);
            s1[x] = _mm_add_epi32(s1[x], cdgh[x]);
        }
    }
    for (int x = 0; x < 2; x++) {
        __m128i t = _mm_shuffle_epi32(s0[x], 0x1B), u = _mm_shuffle_epi32(s1[x], 0xB1);
        _mm_storeu_si128((__m128i *)h[x], _mm_blend_epi16(t, u, 0xF0));
        _mm_storeu_si128((__m128i *)(h[x] + 4), _mm_alignr_epi8(u, t, 8));
    }
}

int sha256_ni_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1");
}
#else
static void blocks_ni(uint32_t h[8], const uint8_t *p, size_t nb) { blocks_c(h, p, nb); }
static void blocks_ni_x2(uint32_t ha[8], const uint8_t *pa, uint32_t hb[8], const uint8_t *pb, size_t nb) {
    blocks_c(ha, pa, nb);
    blocks_c(hb, pb, nb);
}
int sha256_ni_available(void) { return 0; }
#endif

static void blocks(const sha256_ctx *c, uint32_t h[8], const uint8_t *p, size_t nb) {
    if (c->ni) blocks_ni(h, p, nb);
    else blocks_c(h, p, nb);
}

/* ---- the message: whole blocks as they come, the rest buffered; then 0x80, zeros, the bit length (big end) ---- */
void sha256_init(sha256_ctx *c, int ni) {
    memcpy(c->h, H0, sizeof H0);
    c->len = 0;
    c->ni = ni;
}

void sha256_update(sha256_ctx *c, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    size_t have = (size_t)(c->len % 64);
    c->len += n;
    if (have) {
        size_t take = 64 - have < n ? 64 - have : n;
        memcpy(c->buf + have, p, take);
        p += take; n -= take;
        if (have + take < 64) return;
        blocks(c, c->h, c->buf, 1);
    }
    blocks(c, c->h, p, n / 64);
    memcpy(c->buf, p + n / 64 * 64, n % 64);
}

void sha256_final(sha256_ctx *c, uint8_t out[32]) {
    size_t have = (size_t)(c->len % 64);
    uint64_t bits = c->len * 8;
    uint8_t pad[128] = {0};
    memcpy(pad, c->buf, have);
    pad[have] = 0x80;
    size_t total = have + 9 <= 64 ? 64 : 128;
    for (int i = 0; i < 8; i++) pad[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    blocks(c, c->h, pad, total / 64);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) out[4 * i + j] = (uint8_t)(c->h[i] >> (24 - 8 * j));
}

void sha256(const void *p, size_t n, uint8_t out[32], int ni) {
    sha256_ctx c;
    sha256_init(&c, ni);
    sha256_update(&c, p, n);
    sha256_final(&c, out);
}

/* two messages: their common whole blocks two at a time (SHA-NI), then each on its own */
void sha256_x2(const void *a, size_t na, const void *b, size_t nb, uint8_t out_a[32], uint8_t out_b[32], int ni) {
    sha256_ctx ca, cb;
    sha256_init(&ca, ni);
    sha256_init(&cb, ni);
    size_t both = ni ? (na < nb ? na : nb) / 64 : 0;
    if (both) {
        blocks_ni_x2(ca.h, (const uint8_t *)a, cb.h, (const uint8_t *)b, both);
        ca.len = cb.len = 64 * both;
    }
    sha256_update(&ca, (const uint8_t *)a + 64 * both, na - 64 * both);
    sha256_update(&cb, (const uint8_t *)b + 64 * both, nb - 64 * both);
    sha256_final(&ca, out_a);
    sha256_final(&cb, out_b);
}

/* HMAC-SHA256: sha256((K ^ opad) || sha256((K ^ ipad) || msg)), K the key (hashed first if over 64 bytes) padded
 * with zeros to 64 bytes */
void hmac_sha256(const uint8_t *key, size_t klen, const void *msg, size_t n, uint8_t out[32], int ni) {
    uint8_t k[64] = {0}, pad[64], inner[32];
    if (klen > 64) sha256(key, klen, k, ni);
    else memcpy(k, key, klen);
    sha256_ctx c;
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_init(&c, ni);
    sha256_update(&c, pad, 64);
    sha256_update(&c, msg, n);
    sha256_final(&c, inner);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    sha256_init(&c, ni);
    sha256_update(&c, pad, 64);
    sha256_update(&c, inner, 32);
    sha256_final(&c, out);
}

void hex_of(const uint8_t *b, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
}
