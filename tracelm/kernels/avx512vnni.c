/* The AVX512-VNNI path: avx2.c with vpdpbusd (EVEX, on 256-bit vectors: AVX512-VL) for its integer dots (avx2.c's
 * head says how). */
#define VNNI 2
#include "avx2.c"
