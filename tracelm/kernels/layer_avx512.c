/* The layer kernels' 512-bit path (avx512vnni and amx): layer_avx2.c with attend's scores over the Cache's keys 16
 * keys a vector and its weighted values 16 dims a vector (layer_avx2.c's head). The same chains per key and per dim,
 * so the same bits; the rest is the AVX2 path's. */
#define LAYER_512 1
#include "layer_avx2.c"
