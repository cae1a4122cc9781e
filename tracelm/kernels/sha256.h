/* SHA-256 (FIPS 180-4) for the trace kernels: digests of stage outputs and the hash chain of trace lines.
 * Two block functions give the same bits (it is one exact function): plain C, and the x86 SHA extensions
 * (SHA-NI) when the CPU has them and the kernels run their AVX2 path. */
#ifndef TRACELM_SHA256_H
#define TRACELM_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t h[8];
    uint8_t buf[64];
    uint64_t len;   /* bytes hashed so far */
    int ni;         /* use the SHA extensions */
} sha256_ctx;

void sha256_init(sha256_ctx *c, int ni);
void sha256_update(sha256_ctx *c, const void *p, size_t n);
void sha256_final(sha256_ctx *c, uint8_t out[32]);
void sha256(const void *p, size_t n, uint8_t out[32], int ni);
void sha256_x2(const void *a, size_t na, const void *b, size_t nb, uint8_t out_a[32], uint8_t out_b[32], int ni);
void hmac_sha256(const uint8_t *key, size_t klen, const void *msg, size_t n, uint8_t out[32], int ni);
int sha256_ni_available(void);
void hex_of(const uint8_t *b, size_t n, char *out);   /* 2n lowercase hex digits, no terminator */

#endif
