"""The weight product of every stage: x W^T, with a row's numbers independent of the rows beside it."""

import numpy as np
import pytest

from tracelm.stages.linear import GEMV_ROWS, MIN_BLOCK_ELEMENTS, linear, n_blocks


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (960, 576), (100, 7)])
def test_linear_matches_plain_product(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape, dtype=np.float32)
    for m in (1, 2, 3, 8, 9, 64):
        x = rng.standard_normal((m, shape[1]), dtype=np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(linear(x, w), ref, rtol=1e-4, atol=1e-3)


def test_few_rows_are_bitwise_the_one_row_product():
    """Up to GEMV_ROWS rows (speculative drafts, batched sequences) each row gets exactly the numbers
    it gets alone: the audit trail of a token does not depend on what shared its pass."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3072, 576), dtype=np.float32)
    assert n_blocks(3072, 576) > 1  # the blocked path is the one under test
    x = rng.standard_normal((GEMV_ROWS, 576), dtype=np.float32)
    alone = np.stack([linear(x[i : i + 1], w)[0] for i in range(GEMV_ROWS)])
    for m in range(2, GEMV_ROWS + 1):
        assert np.array_equal(linear(x[:m], w), alone[:m])


def test_blocks_divide_rows_and_stay_large_enough_to_thread():
    for n, d in [(3072, 576), (49152, 576), (151936, 896), (576, 576), (7, 3)]:
        c = n_blocks(n, d)
        assert n % c == 0
        assert c == 1 or (n // c) * d >= MIN_BLOCK_ELEMENTS
