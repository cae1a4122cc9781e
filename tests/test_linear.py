"""The weight product of every stage: x W^T, with a row's numbers independent of the rows beside it."""

import numpy as np
import pytest

from tracelm.stages.linear import GEMV_ROWS, MIN_BLOCK_ELEMENTS, ROW_ALIGN, block_rows, linear


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (960, 576), (100, 7)])
def test_linear_matches_plain_product(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    for m in (1, 2, 3, 8, 9, 64):
        x = rng.standard_normal((m, shape[1]), dtype=np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(linear(x, w), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape", [(3072, 576), (75968, 64), (1152, 896), (576, 1536)])
def test_few_rows_are_bitwise_the_one_row_product(shape):
    """Up to GEMV_ROWS rows (speculative drafts, batched sequences) each row gets exactly the numbers
    it gets alone: the audit trail of a token does not depend on what shared its pass. (75968 = 64 x 1187
    rows, like Qwen2.5's 151936-token head: blocks of 8192 rows and a tail of 2496.)"""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((GEMV_ROWS, shape[1]), dtype=np.float32)
    alone = np.stack([linear(x[i : i + 1], w)[0] for i in range(GEMV_ROWS)])
    for m in (2, 3, 5, 8, GEMV_ROWS):
        assert np.array_equal(linear(x[:m], w), alone[:m]), m


def test_blocks_are_aligned_and_large_enough_to_thread():
    for n, d, want in [(3072, 576, 1024), (49152, 576, 1024), (151936, 896, 640), (9728, 896, 1216), (576, 576, 576),
                       (7, 3, 7)]:
        r = block_rows(n, d)
        assert r == want, (n, d, r)
        assert r == n or (r % ROW_ALIGN == 0 and r * d >= MIN_BLOCK_ELEMENTS)
