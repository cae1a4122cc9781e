"""The weight product y = x W^T of every stage (W is [out, in], as stored).

W as the model file's blocks (a QMatrix, `compute: kernels`) goes to tracelm's compiled kernels, which
compute on the blocks themselves and give each output the same bits whatever the rows beside it, the
thread count or the CPU's path (tracelm/kernels). W in f32 (`compute: reference`) goes to numpy's BLAS:

A BLAS chooses its kernel, and so the order of each dot product's sum, by CPU and by the shape of the call
(OpenBLAS: per core type, per block of rows, small-matrix kernels...). No bitwise promise may rest on
that. What holds on every BLAS is that the same call on the same numbers gives the same bits, so:

- W is cut into blocks of rows by `block_rows(out, in)` -- a partition that depends on W's shape alone --
  and every block is one call per pass, the same whatever else is in the pass.
- Up to GEMV_ROWS rows of x (a decode step, speculative drafts, batched sequences) each row of x is one
  matrix-vector product per block: a row alone and the same row among 15 others meet the same calls, so a
  token's numbers do not depend on what shared its pass. W still crosses from memory once per pass: a
  block (2-4 MB) stays in the core caches while every row of x meets it.
- More rows (prefill) are one matrix-matrix product per block: deterministic for a given pass, but another
  call than the few-row one, so a prompt's positions match decoding's within rounding, not bitwise.
- Streamed weights (`linear_rows`) are made a few whole blocks at a time and meet the same calls, so their
  numbers are resident mode's for any number of rows.
"""

from __future__ import annotations

import functools

import numpy as np

import tracelm.kernels as kernels
from tracelm.state.records import QMatrix, RowSource

GEMV_ROWS = 16  # up to this many rows: a matrix-vector product per row and block; more: matrix-matrix products
# OpenBLAS runs a matrix-vector product of fewer than about 460k elements on one thread (measured: 442k
# one, 553k both), so a block must hold at least this many; above that, smaller blocks stay in L2 (2 MiB).
MIN_BLOCK_ELEMENTS = 1 << 19
ROW_ALIGN = 64  # blocks of whole cache lines of rows


@functools.lru_cache(maxsize=256)
def block_rows(n_out: int, n_in: int) -> int:
    """Rows per block: a multiple of ROW_ALIGN holding at least MIN_BLOCK_ELEMENTS, preferring one that divides
    n_out (up to twice the least); all n_out rows when the matrix is smaller than that."""
    least = -(-MIN_BLOCK_ELEMENTS // n_in // ROW_ALIGN) * ROW_ALIGN
    if least >= n_out:
        return n_out
    dividing = [r for r in range(least, 2 * least, ROW_ALIGN) if n_out % r == 0]
    return dividing[0] if dividing else least


def linear(x: np.ndarray, w: np.ndarray | QMatrix) -> np.ndarray:
    """x [M, in] @ w[out, in]^T -> [M, out]: the kernels on a QMatrix's blocks, one call per part; on f32, one
    BLAS call per block of `block_rows(out, in)` rows of w."""
    if isinstance(w, QMatrix):
        return _kernel_product(np.ascontiguousarray(x, np.float32), w)
    return _blocks(x, w, block_rows(*w.shape))


def _kernel_product(x: np.ndarray, w: QMatrix) -> np.ndarray:
    """x @ W^T by the kernels, part after part into its columns of the output."""
    return linear_into(x, w, np.empty((x.shape[0], w.shape[0]), np.float32))


def linear_into(x: np.ndarray, w: QMatrix, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """linear(x, w) on the kernels into `out` [M, out] (x float32 C-contiguous), the same bits; `scratch` (at
    least `kernel_scratch_bytes(M, w)` bytes) keeps a hot loop free of allocation."""
    lo = 0
    for blocks, qtype in w.parts:
        hi = lo + blocks.shape[0]
        kernels.matmul(x, blocks, qtype, out=out[:, lo:hi], scratch=scratch, halves=w.halves,
                       packed=w.packed and kernels.packable(qtype, blocks.shape[0]))
        lo = hi
    return out


def kernel_scratch_bytes(M: int, w: QMatrix) -> int:
    """Bytes of the scratch `linear_into` needs for M rows against w (the largest of its parts')."""
    return max(kernels.scratch_bytes(M, w.shape[1], qtype, w.halves) for _b, qtype in w.parts)


def _blocks(x: np.ndarray, w: np.ndarray, r: int) -> np.ndarray:
    """x @ w.T with w cut into blocks of r rows (the last block holds the rest)."""
    M, d = x.shape
    n = w.shape[0]
    c, tail = divmod(n, r)
    y = np.empty((M, n), np.float32)
    if M > GEMV_ROWS:
        for lo in range(0, n, r):
            np.matmul(x, w[lo : lo + r].T, out=y[:, lo : lo + r])
        return y
    # [c, 1, r, d] @ [1, M, d, 1]: one matrix-vector product per (block, row of x), blocks outermost -> [c, M, r, 1]
    if c:
        blocks = np.matmul(w[: c * r].reshape(c, 1, r, d), x.reshape(1, M, d, 1))
        y[:, : c * r] = blocks.reshape(c, M, r).transpose(1, 0, 2).reshape(M, c * r)
    if tail:
        y[:, c * r :] = np.matmul(w[c * r :], x.reshape(M, d, 1)).reshape(M, tail)
    return y


def linear_rows(x: np.ndarray, w: RowSource) -> np.ndarray:
    """linear(x, w) for a weight matrix made a few rows at a time (streamed weights), with the same numbers:
    each piece is whole blocks of `block_rows`' partition (as many as fit `w.max_rows`, at least one), so
    every block meets the call `linear` gives it."""
    n, d = w.shape
    r = block_rows(n, d)
    step = max(1, w.max_rows // r) * r
    out = np.empty((x.shape[0], n), np.float32)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        out[:, lo:hi] = _blocks(x, w.rows(lo, hi), r)
    return out
