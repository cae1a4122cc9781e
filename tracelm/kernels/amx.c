/* The AMX path: avx512vnni.c's path (avx2.c with VNNI 2) whose many-row products run 16 quantized half-rows at a
 * time as AMX tiles: the 32-value types' blocks (tdpbsud: the block's integer dot products of 16 half-rows x 16 weight
 * rows in one instruction, amx_chunk16) and the K-quants' super-blocks (the weights times their scales as two byte
 * planes, amx_superk), the float steps unchanged. Used only where the CPU has AMX-TILE and AMX-INT8 and the kernel
 * lets this process use the tile registers (core.c). */
#define VNNI 2
#define AMX 1
#include "avx2.c"
