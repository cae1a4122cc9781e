/* The AVX-VNNI path: avx2.c with vpdpbusd (VEX, 256-bit) for its integer dots (avx2.c's head says how). */
#define VNNI 1
#include "avx2.c"
