"""The weight product y = x W^T of every stage (W is [out, in], as stored), with the BLAS call chosen by
the number of rows of x.

One row is a matrix-vector product: it reads W once and runs at memory bandwidth. OpenBLAS's
matrix-matrix product at 2..16 rows costs 2.5-3x that (it packs W before multiplying), which would eat the
gain of reading the weights once for several tokens (speculative drafts, batched sequences). So for a few
rows W is cut into blocks of rows that fit the core caches, and each block does one matrix-vector product
per row of x while it is cached: W still crosses from memory once, and every output element is the same
dot product, in the same order, as the one-row product computes -- a token's numbers do not depend on
how many tokens shared its pass.
"""

from __future__ import annotations

import functools

import numpy as np

from tracelm.state.records import RowSource

GEMV_ROWS = 16  # up to this many rows: cache-blocked matrix-vector products; more: one matrix-matrix product
# OpenBLAS runs a matrix-vector product of fewer than about 460k elements on one thread (measured: 442k
# one, 553k both), so a block must hold at least this many; above that, smaller blocks stay in L2 (2 MiB).
MIN_BLOCK_ELEMENTS = 1 << 19


ROW_ALIGN = 64  # OpenBLAS gives a row the same dot product in any block that starts at a multiple of 64 rows


@functools.lru_cache(maxsize=256)
def block_rows(n_out: int, n_in: int) -> int:
    """Rows per block: a multiple of ROW_ALIGN holding at least MIN_BLOCK_ELEMENTS, preferring one that divides
    n_out (up to twice the least); all n_out rows when the matrix is smaller than that."""
    least = -(-MIN_BLOCK_ELEMENTS // n_in // ROW_ALIGN) * ROW_ALIGN
    if least >= n_out:
        return n_out
    dividing = [r for r in range(least, 2 * least, ROW_ALIGN) if n_out % r == 0]
    return dividing[0] if dividing else least


def linear(x: np.ndarray, w: np.ndarray, rows_per_block: int | None = None) -> np.ndarray:
    """x [M, in] @ w[out, in]^T -> [M, out] (`rows_per_block`: the blocks' rows, default `block_rows`)."""
    M = x.shape[0]
    if M == 1 or M > GEMV_ROWS:
        return x @ w.T
    n, d = w.shape
    r = min(n, rows_per_block or block_rows(n, d))
    c, tail = divmod(n, r)
    y = np.empty((M, n), np.float32)
    # [c, 1, r, d] @ [1, M, d, 1]: numpy loops blocks outermost, rows of x inside -> [c, M, r, 1]
    blocks = np.matmul(w[: c * r].reshape(c, 1, r, d), x.reshape(1, M, d, 1))
    y[:, : c * r] = blocks.reshape(c, M, r).transpose(1, 0, 2).reshape(M, c * r)
    if tail:  # the last rows, as one more (smaller) block
        y[:, c * r :] = np.matmul(w[c * r :], x.reshape(M, d, 1)).reshape(M, tail)
    return y


MIN_STREAM_VALUES = 1 << 20  # linear_rows: blocks of rows hold at least this many weights (4 MB in f32)


def linear_rows(x: np.ndarray, w: RowSource) -> np.ndarray:
    """linear(x, w) for a weight matrix made a block of rows at a time (streamed weights), with the same
    numbers: for 2..GEMV_ROWS rows of x every block is whole blocks of the partition `linear` cuts the
    whole matrix into (and is cut alike again, its tail last); otherwise the blocks are about `w.max_rows` rows, a
    multiple of 64 and of at least MIN_STREAM_VALUES values, all of nearly one size -- a matrix-vector
    product gives each row the same dot product whatever block holds it, and so does OpenBLAS's
    matrix-matrix product while no block is small enough for its small-matrix kernel (measured at d = 576:
    blocks of 64 rows differ at M = 9, blocks of >= 640 do not)."""
    M = x.shape[0]
    n, d = w.shape
    if 1 < M <= GEMV_ROWS:  # whole blocks of `linear`'s partition, so the tail block stays the same
        r = block_rows(n, d)
        step = max(1, w.max_rows // r) * r
    else:
        r = None
        cap = max(-(-MIN_STREAM_VALUES // d // ROW_ALIGN) * ROW_ALIGN, w.max_rows // ROW_ALIGN * ROW_ALIGN)
        count = -(-n // cap)
        step = n if count == 1 else -(-n // count // ROW_ALIGN) * ROW_ALIGN
    out = np.empty((M, n), np.float32)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        out[:, lo:hi] = linear(x, w.rows(lo, hi), r)
    return out
