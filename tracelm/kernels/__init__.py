"""tracelm's compiled kernels: y = x W^T computed directly on GGUF blocks, bit-exact by construction.

out[i, j] depends on x row i and w row j only -- the same float operations whatever the number of rows,
threads or the path (AVX2 or portable C). For quantized weights each x row is split per block into two int8
blocks -- hi (d = amax/127) and lo, the same quantizer on the residual x - d*q -- so the activations keep ~15
bits; for each half the integer dot of each weight block is exact and one fixed float update per block
follows, block after block from k = 0, and out = acc_hi + acc_lo. For F32/F16/BF16 weights the f32 products
go to 32 lanes (k mod 32) and one fixed reduction tree. kernels.h states the order in full; portable.c is its
plain-C reading.

    out = matmul(x, w_rows, qtype)        # x float32 [M, K], w_rows uint8 [N, row_bytes] (the GGUF rows)
    matmul(x, w_rows, qtype, out=y[:, lo:hi])   # out may have a row stride (unit column stride)
    set_threads(2); path(); use_path("portable")

Threads: at import, all CPUs this process may run on (os.sched_getaffinity); set_threads(n) changes it.

Environment: TRACELM_KERNELS=portable forces the portable path at import; TRACELM_SPIN_US (default 200) is
how long idle workers spin before they sleep.
"""

from __future__ import annotations

import atexit
import os

import numpy as np

from tracelm.kernels import _core

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
SUPPORTED = frozenset(_core.SUPPORTED)  # GGML type numbers (gguf.GGMLQuantizationType)
FLOATS = frozenset((F32, F16, BF16))  # weights met by f32 activations as they are (no scratch)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
         Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
"""qtype -> (values per block, bytes per block)"""

set_threads = _core.set_threads  # set_threads(n): n threads in all, the calling thread included
threads = _core.threads
path = _core.path  # "avx2" | "portable"
use_path = _core.use_path  # use_path("portable" | "avx2"): for tests and comparisons
paths = _core.paths  # the paths this CPU can run
quantize_rows = _core.quantize_rows  # quantize_rows(x, qtype, scratch): x's int8 blocks as matmul makes them
# (x row m -> block rows 2m = hi, 2m + 1 = lo, scratch_bytes(M, K, qtype) // (2 M) bytes each)


def default_threads() -> int:
    """All CPUs this process may run on (its affinity mask), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        n = os.cpu_count() or 1
    return max(1, min(n, 256))


def row_bytes(K: int, qtype: int) -> int:
    """Bytes of one GGUF row of K values."""
    bs, tb = BLOCK[int(qtype)]
    if K % bs:
        raise ValueError(f"row_bytes: K={K} is not a multiple of the block size {bs} of qtype {qtype}")
    return K // bs * tb


def scratch_bytes(M: int, K: int, qtype: int) -> int:
    """Bytes of the scratch buffer matmul needs for M rows of K values, both halves (0 for F32/F16/BF16)."""
    return _core.scratch_bytes(M, K, int(qtype))


def _as_bytes(w: np.ndarray, qtype: int) -> np.ndarray:
    """Float weights may come as their own dtype ([N, K] float32 / float16 / uint16): their bytes."""
    if qtype in FLOATS and w.dtype != np.uint8 and w.dtype.itemsize in (2, 4) and w.flags.c_contiguous:
        return w.view(np.uint8)
    return w


def matmul(x: np.ndarray, w_rows: np.ndarray, qtype: int, out: np.ndarray | None = None,
           scratch: np.ndarray | None = None) -> np.ndarray:
    """out = x @ W^T with W given as its GGUF rows.

    x: float32 [M, K] or [K], C-contiguous. w_rows: uint8 [N, row_bytes] (F32/F16/BF16 also as [N, K] of their
    dtype). out: float32 [M, N] (or [N]), unit column stride, rows at any stride >= N (e.g. y[:, lo:hi] of a
    wider y); scratch: >= scratch_bytes(M, K, qtype) bytes. Both are made when not given: pass them to keep a
    hot loop free of allocation."""
    qtype = int(qtype)
    w_rows = _as_bytes(w_rows, qtype)
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    if out is None:
        out = np.empty((w_rows.shape[0],) if one else (x2.shape[0], w_rows.shape[0]), np.float32)
    out2 = out.reshape(1, -1) if one and out.ndim == 1 else out  # a view: the kernel writes into `out`
    if scratch is None and qtype in SUPPORTED and qtype not in FLOATS and x2.ndim == 2:
        bs = BLOCK[qtype][0]
        scratch = np.empty(_core.scratch_bytes(x2.shape[0], x2.shape[1] // bs * bs, qtype), np.uint8)
    _core.matmul(x2, w_rows, qtype, out2, scratch)
    return out


def dequantize(w_rows: np.ndarray, qtype: int, out: np.ndarray | None = None) -> np.ndarray:
    """GGUF rows uint8 [R, row_bytes] -> float32 [R, K], the same bits as gguf.quants.dequantize."""
    qtype = int(qtype)
    w_rows = _as_bytes(w_rows, qtype)
    if out is None:
        bs, tb = BLOCK.get(qtype, (1, 1))
        out = np.empty((w_rows.shape[0], w_rows.shape[-1] // tb * bs), np.float32)
    return _core.dequantize(w_rows, qtype, out)


set_threads(default_threads())
atexit.register(_core.shutdown)  # join the workers before the interpreter goes
