"""The compiled kernels (tracelm.kernels): y = x W^T on GGUF blocks, against gguf's dequantization and float64.

Three kinds of check:
- exactness of the pieces: the split activation quantization (hi = int8 blocks of x, lo = int8 blocks of the
  residual x - d*q) equals its numpy statement byte for byte, on every path; dequantize equals gguf.quants bit
  for bit; the product of the *quantized* activations (hi + lo) with the weights equals float64 up to f32
  rounding only, and against the unquantized x the error is the residual's rounding, ~1e-4 relative or less;
- the promise: out[i, j] depends on (x row i, w row j) alone -- same bits for any batch, thread count, path,
  and whether out is contiguous or a column slice of a wider array;
- bad input is refused with a ValueError naming the argument.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tracelm import kernels

QUANT32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
KQUANT = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT = [Q.F32, Q.F16, Q.BF16]
ALL = FLOAT + QUANT32 + KQUANT
PATHS = kernels.paths()
EPS = 2.0**-23  # f32 unit roundoff, generously (2^-24 would do)
XBLOCK32 = np.dtype([("d", "<f4"), ("sum", "<i4"), ("q", "i1", 32)])
XBLOCK256 = np.dtype([("q", "i1", 256), ("d", "<f4"), ("bsum", "<i2", 16), ("bsum32", "<i2", 8), ("pad", "u1", 12)])
XQ_ALIGN = 64  # the quantized rows start at the scratch's first 64-byte boundary


pytestmark = pytest.mark.usefixtures("kernels_restored")  # each test may switch path and threads


def weights(qt: Q, N: int, K: int, seed: int = 0) -> np.ndarray:
    """GGUF rows [N, row_bytes]: gguf's own quantization where it has one; random bytes with finite f16 scales
    for the K-quants (gguf cannot quantize them)."""
    rng = np.random.default_rng(seed)
    if qt in KQUANT:
        bs, tb = gguf.GGML_QUANT_SIZES[qt]
        w = rng.integers(0, 256, size=(N, K // bs * tb), dtype=np.uint8)
        blk = w.reshape(N, K // bs, tb)
        half = lambda s: (rng.standard_normal((N, K // bs)) * s).astype(np.float16).view(np.uint8).reshape(N, -1, 2)
        if qt == Q.Q6_K:
            blk[:, :, 208:210] = half(0.01)
        else:
            blk[:, :, 0:2], blk[:, :, 2:4] = half(0.01), half(0.01)
        return w
    wf = rng.standard_normal((N, K)).astype(np.float32)
    if qt == Q.F32:
        return wf.view(np.uint8)
    return np.ascontiguousarray(quants.quantize(wf, qt)).view(np.uint8)


def dequant(w: np.ndarray, qt: Q) -> np.ndarray:
    return w.view(np.float32) if qt == Q.F32 else quants.dequantize(w, qt)


def offset_part(w: np.ndarray, qt: Q) -> np.ndarray:
    """The weights' additive part (the min of Q4_1/Q5_1, -dmin*min of Q4_K/Q5_K; 0 otherwise): gguf's
    dequantization with the scale d zeroed."""
    if qt not in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
        return np.zeros(1, np.float32)
    w0 = w.copy()
    tb = gguf.GGML_QUANT_SIZES[qt][1]
    w0.reshape(w.shape[0], -1, tb)[:, :, 0:2] = 0
    return quants.dequantize(w0, qt)


def xblocks(scratch: np.ndarray, qt: Q, M: int, halves: int = 2) -> np.ndarray:
    """The scratch of quantize_rows/matmul (as scratch_bytes sizes it) as blocks [M, halves, blocks per row]: [:, 0]
    the hi half, [:, 1] the lo (from the scratch's first 64-byte boundary on; Q4_0's and Q5_0's unsigned copy after
    them all)."""
    dtype = XBLOCK256 if qt in KQUANT else XBLOCK32
    per_block = dtype.itemsize * (2 if qt in (Q.Q4_0, Q.Q5_0) else 1)
    n = (scratch.nbytes - XQ_ALIGN) // (M * halves * per_block) * M * halves
    start = -scratch.ctypes.data % XQ_ALIGN
    return scratch[start:start + n * dtype.itemsize].view(dtype).reshape(M, halves, -1)


def quantized_x(x: np.ndarray, qt: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """kernels.quantize_rows -> per value, float64 [M, K]: the hi half d_h*q_h and the lo half d_l*q_l as the
    kernel sees them, and their steps d_h, d_l."""
    M, K = x.shape
    scratch = np.empty(kernels.scratch_bytes(M, K, qt), np.uint8)
    kernels.quantize_rows(x, qt, scratch)
    blocks = xblocks(scratch, qt, M)
    bs = blocks["q"].shape[-1]
    halves = []
    for h in (0, 1):
        d = np.repeat(blocks["d"][:, h].astype(np.float64), bs, axis=1)
        halves += [blocks["q"][:, h].reshape(M, K).astype(np.float64) * d, d]
    xh, dh, xl, dl = halves
    return xh, xl, dh, dl


def quantize_reference(x: np.ndarray, bs: int):
    """One int8 quantizer, stated in numpy: per block d = amax/127 (f32), q = rint(x * (1/d)) half to even;
    a non-finite block: d = NaN, q = 0; amax below 2^-100: d = 0, q = 0."""
    b = x.reshape(x.shape[0], -1, bs)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    finite = np.isfinite(b).all(axis=-1, keepdims=True)
    live = finite & (amax >= np.float32(2.0**-100))
    d = np.where(live, amax / np.float32(127), np.where(finite, np.float32(0), np.float32(np.nan))).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(live, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.where(live, np.rint(b * inv), 0).astype(np.int8)
    return d[..., 0], q


def split_reference(x: np.ndarray, bs: int):
    """The split, stated in numpy: hi = quant(x); r = x - d_h*q_h (f32 multiply, then subtract); lo = quant(r)."""
    dh, qh = quantize_reference(x, bs)
    with np.errstate(invalid="ignore"):
        r = (x.reshape(qh.shape) - dh[..., None] * qh.astype(np.float32)).astype(np.float32).reshape(x.shape)
    dl, ql = quantize_reference(r, bs)
    return (dh, qh), (dl, ql)


def shapes(qt: Q) -> list[tuple[int, int, int]]:
    """(M, N, K): N odd and not a multiple of 4/8/16; K from 256 to 2048 (F32: not a multiple of 32)."""
    if qt == Q.F32:
        return [(5, 37, 515), (3, 21, 1000)]
    return [(5, 37, 256), (3, 21, 2048)] if qt in KQUANT else [(5, 37, 288), (3, 21, 2048)]


# ---------------------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_quantize_rows_is_the_stated_split(qt):
    """Both halves, byte for byte as split_reference states them, and the same bytes on every path."""
    bs = 256 if qt in KQUANT else 32
    rng = np.random.default_rng(1)
    M = 6
    x = (rng.standard_normal((M, 2 * bs)) * rng.choice([1e-3, 1.0, 300.0], size=(M, 1))).astype(np.float32)
    x[0, :bs] = 0.0  # a zero block: both halves d = 0
    x[1, :bs] = np.float32(2.0**-110)  # below 2^-100: all zeros, d = 0; r = x, so lo too
    x[2, :bs] = [127.0, 2.5, -3.5, 0.5, 1.5, -0.5] + [0.0] * (bs - 6)  # d = 1: ties go to even; r = +-0.5
    x[3, bs + 1] = np.inf  # a non-finite block: d = NaN, q = 0 in both halves
    x[4, :bs] = rng.integers(-127, 128, bs)  # with an amax of 127 hi is exact: r = 0, lo is zeros (d = 0)
    x[4, 0] = 127.0
    x[5] = rng.standard_normal(2 * bs) * np.float32(2.0**-95)  # hi live, the residual's amax below 2^-100: lo zeros
    (dh, qh), (dl, ql) = split_reference(x, bs)
    seen = []
    for path in PATHS:
        kernels.use_path(path)
        scratch = np.full(kernels.scratch_bytes(M, 2 * bs, qt), 0xA5, np.uint8)   # not zeros: the padding is written
        kernels.quantize_rows(x, qt, scratch)
        got = xblocks(scratch, qt, M)
        for h, (d, q) in enumerate([(dh, qh), (dl, ql)]):
            np.testing.assert_array_equal(got["d"][:, h].view(np.uint32), d.view(np.uint32), err_msg=f"{path} half {h}")
            np.testing.assert_array_equal(got["q"][:, h], q, err_msg=f"{path} half {h}")
            if qt in KQUANT:
                np.testing.assert_array_equal(got["bsum"][:, h], q.reshape(M, 2, 16, 16).astype(np.int32).sum(-1))
                np.testing.assert_array_equal(got["bsum32"][:, h], q.reshape(M, 2, 8, 32).astype(np.int32).sum(-1))
                assert not got["pad"][:, h].any()   # written (zeros): the self-test compares the blocks' bytes
            else:
                np.testing.assert_array_equal(got["sum"][:, h], q.astype(np.int32).sum(-1))
        assert list(got["q"][2, 0, 0, :6]) == [127, 2, -4, 0, 2, 0]
        assert list(got["q"][2, 1, 0, :6]) == [0, 127, 127, 127, -127, -127]  # r = 0, .5, .5, .5, -.5, -.5
        assert (got["d"][4, 1, 0] == 0) and not got["q"][4, 1, 0].any()
        assert (got["d"][5, 0] > 0).all() and (got["d"][5, 1] == 0).all() and not got["q"][5, 1].any()
        assert np.isnan(got["d"][3, :, 1]).all() and not got["q"][3, :, 1].any()
        seen.append(got)
    fields = ("q", "d", "bsum", "bsum32", "pad") if qt in KQUANT else ("q", "d", "sum")
    for other in seen[1:]:
        for f in fields:
            np.testing.assert_array_equal(other[f], seen[0][f])
    for path in PATHS:  # one half (activations: int8): the hi blocks alone, the same bytes
        kernels.use_path(path)
        one = np.empty(kernels.scratch_bytes(M, 2 * bs, qt, 1), np.uint8)
        assert xblocks(one, qt, M, 1).size * 2 == seen[0].size   # one half: half the blocks
        kernels.quantize_rows(x, qt, one, 1)
        for f in fields:
            np.testing.assert_array_equal(xblocks(one, qt, M, 1)[f][:, 0], seen[0][f][:, 0], err_msg=path)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_quantize_rows_long_rows(qt):
    """Rows of many blocks (the AVX2 paths take 32-value blocks 8 at a time: whole groups and a short last one),
    every block its own scale, the edge blocks at places in and across those groups -- byte for byte the stated
    split on every path, both halves and one."""
    bs = 256 if qt in KQUANT else 32
    nb = 5 if qt in KQUANT else 21
    rng = np.random.default_rng(7)
    M = 4
    x = (rng.standard_normal((M, nb, bs)) * 10.0 ** rng.uniform(-6, 6, (M, nb, 1))).astype(np.float32)
    x[0, 1] = 0.0
    x[0, nb - 1, 3] = -np.inf
    x[1, 3] = np.float32(2.0**-110)
    x[1, nb - 2, 0] = np.nan
    x[2, 2] = rng.integers(-127, 128, bs)   # exact in hi: lo zeros
    x[2, 2, 0] = 127.0
    x[2, nb - 1] = np.finfo(np.float32).max * np.sign(rng.standard_normal(bs))  # d q may round past the max: r inf
    x[3, 0] = rng.standard_normal(bs) * np.float32(2.0**-95)  # hi live, lo below 2^-100
    x[3, 1, :] = -0.0
    x = x.reshape(M, nb * bs)
    with np.errstate(over="ignore"):
        (dh, qh), (dl, ql) = split_reference(x, bs)
    for path in PATHS:
        kernels.use_path(path)
        for halves in (2, 1):
            scratch = np.full(kernels.scratch_bytes(M, nb * bs, qt, halves), 0xA5, np.uint8)
            kernels.quantize_rows(x, qt, scratch, halves)
            got = xblocks(scratch, qt, M, halves)
            for h, (d, q) in enumerate([(dh, qh), (dl, ql)][:halves]):
                np.testing.assert_array_equal(got["d"][:, h].view(np.uint32), d.view(np.uint32), err_msg=f"{path} {h}")
                np.testing.assert_array_equal(got["q"][:, h], q, err_msg=f"{path} half {h}")
                if qt in KQUANT:
                    sums = q.reshape(M, nb, 16, 16).astype(np.int32).sum(-1)
                    np.testing.assert_array_equal(got["bsum"][:, h], sums, err_msg=path)
                    np.testing.assert_array_equal(got["bsum32"][:, h], sums.reshape(M, nb, 8, 2).sum(-1))
                    assert not got["pad"][:, h].any()
                else:
                    np.testing.assert_array_equal(got["sum"][:, h], q.astype(np.int32).sum(-1), err_msg=path)
    assert np.isnan(dl[0, nb - 1]) and np.isnan(dl[1, nb - 2]) and np.isnan(dl[2, nb - 1]).all()
    assert (dl[2, 2] == 0).all() and (dl[3, 0] == 0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_matmul_one_half_against_float64(qt, path):
    """halves=1 (int8 activations, llama.cpp's precision): out = acc_hi alone. Given the hi blocks, the error is f32
    rounding only (bound 1 of test_matmul_against_float64 with x^l = 0); against the unquantized x the rounding
    errors of hi, up to d^h/2 each, give by Hoeffding |err| <= 3.8 ||w^ d^h||_2 (P < 1e-12 per output), and in
    plain numbers |err| <= 2e-2 sqrt(sum (x_i w^_i)^2) -- about 250 times the two halves' bound."""
    kernels.use_path(path)
    for M, N, K in shapes(qt):
        w = weights(qt, N, K, seed=K)
        x = np.random.default_rng(K + 1).standard_normal((M, K)).astype(np.float32)
        out = kernels.matmul(x, w, qt, halves=1)
        wd, x64 = dequant(w, qt).astype(np.float64), x.astype(np.float64)
        off = np.abs(offset_part(w, qt)).astype(np.float64)
        xh, _xl, dh, _dl = quantized_x(x, qt)
        nb = K // (256 if qt in KQUANT else 32)
        rounding = (nb + 7) * EPS * (np.abs(xh) @ (np.abs(wd) + off).T) + 1e-30
        np.testing.assert_array_less(np.abs(out - xh @ wd.T), rounding)
        err = np.abs(out - x64 @ wd.T)
        np.testing.assert_array_less(err, 3.8 * np.sqrt(dh**2 @ (wd**2).T) + rounding)
        np.testing.assert_array_less(err, 2e-2 * np.sqrt(x64**2 @ (wd**2).T))
        assert err.max() > 1e-4 * np.sqrt(x64**2 @ (wd**2).T).max()  # one half really is coarser than two


@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
def test_dequantize_is_gguf_bit_for_bit(qt):
    w = weights(qt, 7, 512)
    for path in PATHS:
        kernels.use_path(path)
        got = kernels.dequantize(w, qt)
        assert got.shape == (7, 512)
        np.testing.assert_array_equal(got.view(np.uint32), dequant(w, qt).view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
def test_matmul_against_float64(qt, path):
    """Three bounds per output, w^ = gguf's dequantization of the weights, x^ = x^h + x^l the two int8 halves.

    1. Given the quantized halves (read back through quantize_rows), the kernel's only error is f32 rounding:
       each block's update rounds ~4 times, each half's running sum over nb blocks (F32/F16/BF16: the 32 lanes
       of K/32 terms, then 5 tree levels) adds at most nb roundings of partial sums, and acc_hi + acc_lo one
       more, so |out - x^ . w^| <= (nb + 7) eps S, S = sum (|x^h_i| + |x^l_i|) (|w^_i| + |offset_i|) (offset:
       the weights' additive part, whose product the kernel forms separately).
    2. Against the unquantized x: x - x^ = (r - x^l) + (r_exact - r). The lo rounding errors r_i - x^l_i are
       bounded by d^l_i/2 and, for random x, independent with mean 0; Hoeffding gives P(|sum w^_i e_i| > t) <=
       2 exp(-2 t^2 / sum (w^_i d^l_i)^2), so t = 3.8 ||w^ d^l||_2 is exceeded with probability < 1e-12 per
       output. The residual r = x - d^h q^h is computed in f32: |r_exact - r| <= 2^-24 |d^h q^h| per value, a
       deterministic term. With one int8 pass the step was d^h = amax/127; the lo step is d^l <= d^h/254, so
       this bound is ~250 times tighter than it was.
    3. In plain numbers: |out - x . w^| <= 3e-4 sqrt(sum_i (x_i w^_i)^2) for every output, 1e-6 for the
       F32/F16/BF16 weights (f32 rounding only). For Gaussian x, |e_i| <= amax/(4 * 127^2) ~ 1.6e-5 amax with
       amax ~ 3 sigma over a block, so the error is ~1e-4 of the norm scale at worst and ~2e-5 typically.
    """
    kernels.use_path(path)
    for M, N, K in shapes(qt):
        w = weights(qt, N, K, seed=K)
        x = np.random.default_rng(K + 1).standard_normal((M, K)).astype(np.float32)
        out = kernels.matmul(x, w, qt)
        assert out.shape == (M, N) and out.dtype == np.float32
        wd = dequant(w, qt).astype(np.float64)
        off = np.abs(offset_part(w, qt)).astype(np.float64)
        x64 = x.astype(np.float64)
        if qt in FLOAT:
            xh, xl, dl, nb = x64, np.zeros_like(x64), np.zeros_like(x64), -(-K // 32) + 5
        else:
            xh, xl, dh, dl = quantized_x(x, qt)
            nb = K // (256 if qt in KQUANT else 32)
        S = (np.abs(xh) + np.abs(xl)) @ (np.abs(wd) + off).T
        rounding = (nb + 7) * EPS * S + 1e-30
        np.testing.assert_array_less(np.abs(out - (xh + xl) @ wd.T), rounding)
        hoeffding = 3.8 * np.sqrt(dl**2 @ (wd**2).T)
        residual = 2.0**-24 * np.abs(xh) @ np.abs(wd).T
        err = np.abs(out - x64 @ wd.T)
        np.testing.assert_array_less(err, hoeffding + residual + rounding)
        scale = np.sqrt(x64**2 @ (wd**2).T)
        np.testing.assert_array_less(err, (1e-6 if qt in FLOAT else 3e-4) * scale)


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda q: q.name)
def test_special_activations(qt):
    K = 256
    w = weights(qt, 9, K)
    x = np.zeros((3, K), np.float32)
    x[1, 3] = np.inf
    x[2] = np.float32(2.0**-110)
    outs = []
    for path in PATHS:
        kernels.use_path(path)
        out = kernels.matmul(x, w, qt)
        assert (out[0] == 0).all()
        assert (~np.isfinite(out[1])).all() if qt in FLOAT else np.isnan(out[1]).all()  # a non-finite block: d NaN
        if qt not in FLOAT:
            assert (out[2] == 0).all()  # a block below 2^-100 quantizes to zeros
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[-1])


# ---------------------------------------------------------------------------------------------------- the promise


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


@pytest.mark.parametrize("halves", (1, 2))
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
def test_same_bits_for_any_batch_thread_count_and_path(qt, halves):
    """out[i] of a row alone = the same row in passes of 2..16, 24, 33 and 256 rows, on 1 or 2 threads, on either
    path (the direct few-row and the tiled many-row kernels included; with one half, odd tiles of rows too)."""
    K = 1000 if qt == Q.F32 else 512
    N = 75
    w = weights(qt, N, K)
    x = np.random.default_rng(2).standard_normal((256, K)).astype(np.float32)
    ref = None
    for path in PATHS:
        kernels.use_path(path)
        for threads in (1, 2):
            kernels.set_threads(threads)
            full = kernels.matmul(x, w, qt, halves=halves)
            if ref is None:
                ref = full
                alone = np.stack([kernels.matmul(x[i], w, qt, halves=halves) for i in (0, 1, 100, 255)])
                np.testing.assert_array_equal(bits(alone), bits(ref[[0, 1, 100, 255]]))
            np.testing.assert_array_equal(bits(full), bits(ref), err_msg=f"{path} threads={threads}")
            for b in (2, 3, 4, 5, 7, 8, 16, 24, 33, 67):
                lo = 37 % (256 - b)
                got = kernels.matmul(x[lo:lo + b], w, qt, halves=halves)
                np.testing.assert_array_equal(bits(got), bits(ref[lo:lo + b]),
                                              err_msg=f"{path} threads={threads} pass of {b}")


@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_extreme_values(qt):
    """Weights at their ends (every quant 0 or its maximum, scales of either sign at their ends) against activations
    whose every int8 is +-127: the integer sums at the edge of what the many-row kernels keep in int16 (AVX2's
    maddubs lanes: Q4_0, Q4_1 over 8 quads up to 8*2*15*127 = 30480, Q5_0, Q5_1 over 4 quads up to 4*2*31*127 =
    31496, Q8_0 one pair up to 2*128*127 = 32512; Q4_0's and Q5_0's signed tile, sum (u - off) q over 8 quads up to
    16*16*127 = 32512; Q6_K: a sub-block's sum of (u - 32) q, up to 8*32*127 = 32512 per
    int16; AMX's byte planes of the scaled weights, up to 32*128 = 4096 and 15*63 = 945) -- the same bits as a row
    alone, on every path, and within f32 rounding of the product of the quantized halves in float64."""
    K, rng = 1024, np.random.default_rng(5)
    bs, tb = gguf.GGML_QUANT_SIZES[qt]
    w = np.concatenate([np.full((8, K // bs * tb), fill, np.uint8) for fill in (0x00, 0xFF, 0x55, 0xAA, 0x0F)])
    blk = w.reshape(w.shape[0], -1, tb)
    one = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qt == Q.Q6_K:
        blk[:, :, 192:208] = rng.choice(np.array([-128, 127, -1], np.int8), blk.shape[:2] + (16,)).view(np.uint8)
        blk[:, :, 208:210] = one
    else:
        blk[:, :, 0:2], blk[:, :, 2:4] = one, one
    signs = np.where(rng.random((8, K)) < 0.5, 1.0, -1.0)
    x = np.concatenate([np.ones((4, K)), -np.ones((4, K)), signs, rng.standard_normal((8, K))]).astype(np.float32)
    x = np.concatenate([x, x[::-1], x])   # 72 rows: the tiled kernels
    packed = kernels.pack(w, qt)   # and the packed ones, one to three rows at a time (direct) and tiled
    ref = None
    for path in PATHS:
        kernels.use_path(path)
        out = kernels.matmul(x, w, qt)
        alone = np.stack([kernels.matmul(x[i], w, qt) for i in range(0, x.shape[0], 5)])
        np.testing.assert_array_equal(bits(alone), bits(out[::5]), err_msg=path)
        if ref is None:
            ref = out
        np.testing.assert_array_equal(bits(out), bits(ref), err_msg=path)
        for lo, hi in ((0, 72), (5, 6), (6, 8), (9, 12), (16, 24)):
            got = kernels.matmul(x[lo:hi], packed, qt, packed=True)
            np.testing.assert_array_equal(bits(got), bits(ref[lo:hi]), err_msg=f"{path} packed rows {lo}..{hi}")
    xh, xl, _, _ = quantized_x(x, qt)
    wd = dequant(w, qt).astype(np.float64)
    S = (np.abs(xh) + np.abs(xl)) @ (np.abs(wd) + np.abs(offset_part(w, qt)).astype(np.float64)).T
    np.testing.assert_array_less(np.abs(ref - (xh + xl) @ wd.T), (K // bs + 7) * EPS * S + 1e-30)


def q6_regrouped(w: np.ndarray) -> np.ndarray:
    """Q6_K rows with each block's 6-bit values regrouped as packing does (kernels.h): for h = 0, 1 and l = 0..31,
    a = ql[64h + l], b = ql[64h + 32 + l], c = qh[32h + l] become a' = (a & 15) | (c & 3) << 4 | (c >> 4 & 3) << 6
    (the 6 bits of value 128h + l, the top bits of + 64), b' = (b & 15) | (c >> 2 & 3) << 4 | (c >> 6) << 6 and
    c' = (a >> 4) | (b >> 4) << 4."""
    out = w.copy()
    blk, src = out.reshape(w.shape[0], -1, 210), w.reshape(w.shape[0], -1, 210).astype(np.uint16)
    for h in (0, 1):
        ia, ib, ic = slice(64 * h, 64 * h + 32), slice(64 * h + 32, 64 * h + 64), slice(128 + 32 * h, 160 + 32 * h)
        a, b, c = src[..., ia], src[..., ib], src[..., ic]
        blk[..., ia] = (a & 15) | (c & 3) << 4 | (c >> 4 & 3) << 6
        blk[..., ib] = (b & 15) | (c >> 2 & 3) << 4 | (c >> 6) << 6
        blk[..., ic] = (a >> 4) | (b >> 4) << 4
    return out


@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_pack_moves_bytes_and_qh_bits_and_unpacks_back(qt):
    """kernels.pack reorders a group's blocks (and spreads Q5's qh bits by quad, kernels.h); unpack_rows gives the
    file's rows back, byte for byte, for any row of any group."""
    w = weights(qt, 24, 512 if qt in KQUANT else 256, seed=5)
    p = kernels.pack(w, qt)
    assert p.tobytes() != w.tobytes()
    ids = np.array([23, 0, 9, 9, 16, 7])
    assert kernels.unpack_rows(p, qt, ids).tobytes() == w[ids].tobytes()
    if qt in KQUANT:  # kernels.h: byte f of a field of unit u (f16: 2, else 4) of row r's block b of group g at
        # 8 g row_bytes + 8 b tb + 8 f0 + 8 u k + u r + j, f = f0 + u k + j (f0: where the field's run of units starts)
        tb = gguf.GGML_QUANT_SIZES[qt][1]
        runs = [(0, 4), (208, 2)] if qt == Q.Q6_K else [(0, 2), (4, 4)]  # (f0, u) from f0 on
        flat, rb = p.reshape(-1), w.shape[1]
        moved = q6_regrouped(w) if qt == Q.Q6_K else w
        for g, r, b in ((0, 0, 0), (1, 5, 1), (2, 7, 1)):
            for f in range(tb):
                f0, u = max(run for run in runs if run[0] <= f)
                at = 8 * g * rb + 8 * b * tb + 8 * f0 + 8 * u * ((f - f0) // u) + u * r + (f - f0) % u
                assert flat[at] == moved[8 * g + r, b * tb + f], (g, r, b, f)
    if qt in (Q.Q5_0, Q.Q5_1):  # row r's qh of block 0 in the packed block: bit 8b + c = the file's bit 4c + b
        at, pqh = (2, 16) if qt == Q.Q5_0 else (4, 32)
        for r in range(8):
            h = int.from_bytes(w[r, at : at + 4].tobytes(), "little")
            s = int.from_bytes(p[0, pqh + 4 * r : pqh + 4 * r + 4].tobytes(), "little")  # K = 256: row 0 of p is
            # 8 blocks of bytes, group 0's first block (8 x 22 or 8 x 24 bytes) at its start
            assert all((s >> (8 * b + c) & 1) == (h >> (4 * c + b) & 1) for c in range(8) for b in range(4))


@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_two_group_tiles_packed_or_not(qt):
    """The many-row kernels of the quantized types take two groups of 8 weight rows at a time (on 512-bit vectors
    two such pairs at once, from 16 rows on for the K-quants): an odd number of groups (a last one alone), a last
    group of fewer rows, packed weights (`kernels.pack`; 1-3 rows: the packed direct kernels, the 4/5-bit ones up to
    16 rows on 512-bit vectors, up to 8 (4-bit) or 4 (5-bit) on 256-bit ones, 4, 3, 2 or 1 a pass; Q4_K on 512-bit
    vectors up to 4 rows, 2 a pass; more: the tiled ones), K-quant rows of more super-blocks than a
    chunk -- the same bits as a row alone, on either path, on 1 or 2 threads."""
    K = 1280 if qt in KQUANT else 320
    x = np.random.default_rng(3).standard_normal((70, K)).astype(np.float32)
    for N in (40, 24, 21):
        w = weights(qt, N, K, seed=N)
        forms = [(w, False)] + ([(kernels.pack(w, qt), True)] if kernels.packable(qt, N) else [])
        for halves in (1, 2):
            ref = np.stack([kernels.matmul(x[i], w, qt, halves=halves) for i in range(x.shape[0])])
            for path in PATHS:
                kernels.use_path(path)
                for threads in (1, 2):
                    kernels.set_threads(threads)
                    for wf, packed in forms:
                        for lo, hi in ((0, 70), (4, 5), (3, 5), (3, 6), (3, 7), (3, 8), (3, 9), (3, 10), (0, 8),
                                       (1, 14), (2, 18), (2, 19), (5, 38), (6, 70)):
                            got = kernels.matmul(x[lo:hi], wf, qt, halves=halves, packed=packed)
                            np.testing.assert_array_equal(bits(got), bits(ref[lo:hi]), err_msg=(
                                f"N={N} halves={halves} {path} threads={threads} packed={packed} rows {lo}..{hi}"))


@pytest.mark.parametrize("qt", QUANT32 + KQUANT, ids=lambda q: q.name)
def test_portable_packed_rows_are_unpacked_a_chunk_at_a_time(qt):
    """The portable path reads a packed group back a chunk of 16 blocks at a time into a buffer on its stack (no
    allocation in a kernel), 16 x rows at a time: rows past one chunk (17 blocks) and past 16 x rows (20) give
    the bits of the file's rows."""
    bs = gguf.GGML_QUANT_SIZES[qt][0]
    K, N = 17 * bs, 16
    x = np.random.default_rng(8).standard_normal((20, K)).astype(np.float32)
    w = weights(qt, N, K, seed=4)
    kernels.use_path("portable")
    for halves in (1, 2):
        for lo, hi in ((0, 20), (3, 4), (1, 18)):
            want = kernels.matmul(x[lo:hi], w, qt, halves=halves)
            got = kernels.matmul(x[lo:hi], kernels.pack(w, qt), qt, halves=halves, packed=True)
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"halves={halves} rows {lo}..{hi}")


@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
def test_out_with_a_row_stride(qt):
    """out may be a column slice of a wider array (the engine writes fused parts of different types side by side):
    the same bits as a contiguous out, on the few-row, many-row and float kernels, and nothing outside it
    written."""
    K, N = (300 if qt == Q.F32 else 256), 21
    w = weights(qt, N, K)
    x = np.random.default_rng(4).standard_normal((70, K)).astype(np.float32)
    for path in PATHS:
        kernels.use_path(path)
        for M in (1, 2, 3, 5, 70):
            ref = kernels.matmul(x[:M], w, qt)
            wide = np.full((M, N + 13), 7.0, np.float32)
            got = kernels.matmul(x[:M], w, qt, out=wide[:, 5 : 5 + N])
            assert got.base is wide
            np.testing.assert_array_equal(bits(wide[:, 5 : 5 + N]), bits(ref), err_msg=f"{path} M={M}")
            assert (wide[:, :5] == 7.0).all() and (wide[:, 5 + N :] == 7.0).all()


def test_env_var_forces_portable_path():
    """TRACELM_KERNELS=portable at import: the portable path, the same bits as in this process."""
    code = ("import numpy as np, sys; from tracelm import kernels; assert kernels.path() == 'portable'; "
            "x = np.load(sys.argv[1]); w = np.load(sys.argv[2]); "
            "sys.stdout.write(kernels.matmul(x, w, 12).view(np.uint32).tobytes().hex())")
    w = weights(Q.Q4_K, 13, 512)
    x = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/x.npy", x)
        np.save(f"{tmp}/w.npy", w)
        env = dict(os.environ, TRACELM_KERNELS="portable")
        res = subprocess.run([sys.executable, "-c", code, f"{tmp}/x.npy", f"{tmp}/w.npy"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    here = kernels.matmul(x, w, Q.Q4_K)
    assert res.stdout == bits(here).tobytes().hex()


@pytest.mark.parametrize("ahead", ["0", "64"])
def test_decode_prefetch_distance_leaves_every_bit(tmp_path, ahead):
    """TRACELM_K_AHEAD (the K-quants' decode pairs' prefetch, for a bench's sweep) moves no bit: one and two x rows
    on packed Q4_K and Q6_K rows, 4 pairs of groups, as this process computes them on its path."""
    code = ("import numpy as np, sys; from tracelm import kernels; "
            "x = np.load(sys.argv[1]); out = [str(kernels.k_ahead())] \n"
            "for t in (12, 14):\n"
            "    w = kernels.pack(np.load(sys.argv[2] + f'{t}.npy'), t)\n"
            "    out += [kernels.matmul(x[:m], w, t, packed=True).view(np.uint32).tobytes().hex() for m in (1, 2)]\n"
            "sys.stdout.write(' '.join(out))")
    x = np.random.default_rng(5).standard_normal((2, 1024)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    here = []
    for t in (Q.Q4_K, Q.Q6_K):
        w = weights(t, 64, 1024)
        np.save(tmp_path / f"w{int(t)}.npy", w)
        here += [bits(kernels.matmul(x[:m], kernels.pack(w, t), t, packed=True)).tobytes().hex() for m in (1, 2)]
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.npy"), str(tmp_path / "w")],
                         env=dict(os.environ, TRACELM_K_AHEAD=ahead), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == " ".join([ahead, *here])  # the distance taken, and the same bits


def test_prefetch_distance_set_in_process_leaves_every_bit():
    """set_k_ahead moves the decode pairs' prefetch (none, 1, the default, 64 super-blocks ahead) and no bit: one and
    two x rows on packed Q4_K and Q6_K rows; a distance out of 0..64 is refused, the one in use kept."""
    x = np.random.default_rng(6).standard_normal((2, 1024)).astype(np.float32)
    mats = [(t, kernels.pack(weights(t, 64, 1024), t)) for t in (Q.Q4_K, Q.Q6_K)]
    before = kernels.k_ahead()
    try:
        outs = {}
        for ahead in (0, 1, before, 64):
            kernels.set_k_ahead(ahead)
            assert kernels.k_ahead() == ahead
            outs[ahead] = [bits(kernels.matmul(x[:m], w, t, packed=True)).tobytes() for t, w in mats for m in (1, 2)]
        assert all(o == outs[before] for o in outs.values())
        for bad in (-1, 65):
            with pytest.raises(ValueError, match="0..64 super-blocks"):
                kernels.set_k_ahead(bad)
        assert kernels.k_ahead() == 64
    finally:
        kernels.set_k_ahead(before)


def test_prefetch_hint_leaves_every_bit():
    """set_prefetch_hint moves the weights' software prefetch between every cache level (t0) and non-temporal (nta)
    and no bit, on every path: 1, 2 and 40 x rows (the direct kernels and the tiles' unpacking) on packed and plain
    rows of each prefetching kind (32-value, Q8_0, K-quant, f16); another hint is refused, the one in use kept."""
    x = np.random.default_rng(7).standard_normal((40, 1024)).astype(np.float32)
    mats = [(t, pk, kernels.pack(weights(t, 64, 1024), t) if pk else weights(t, 64, 1024))
            for t in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K) for pk in (False, True)]
    mats.append((Q.F16, False, weights(Q.F16, 64, 1024)))
    before = kernels.prefetch_hint()
    try:
        for path in PATHS:
            kernels.use_path(path)
            outs = {}
            for hint in kernels.PREFETCH_HINTS:
                kernels.set_prefetch_hint(hint)
                assert kernels.prefetch_hint() == hint
                outs[hint] = [bits(kernels.matmul(x[:m], w, t, packed=pk)).tobytes()
                              for t, pk, w in mats for m in (1, 2, 40)]
            assert outs["nta"] == outs["t0"], path
        with pytest.raises(ValueError, match="hint must be 't0' or 'nta', got 'nt'"):
            kernels.set_prefetch_hint("nt")
        assert kernels.prefetch_hint() == "nta"
    finally:
        kernels.set_prefetch_hint(before)


@pytest.mark.parametrize("value", ["65", "+5", "x"])
def test_an_unusable_prefetch_distance_in_the_environment_is_named(value):
    """TRACELM_K_AHEAD that is not digits for 0..64 leaves the default and says so, naming the value."""
    res = subprocess.run([sys.executable, "-c", "from tracelm import kernels; print(kernels.k_ahead())"],
                         env=dict(os.environ, TRACELM_K_AHEAD=value), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "4"
    assert f"TRACELM_K_AHEAD='{value}' is not a number of super-blocks 0..64" in res.stderr


def test_the_prefetch_hint_from_the_environment_or_the_cpu():
    """TRACELM_PREFETCH_HINT sets the weights' prefetch hint at import; unset, it is nta on AMD's CPUs and t0 on
    others; another value leaves that default and says so, naming the value."""
    def hint(value: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TRACELM_PREFETCH_HINT"}
        return subprocess.run([sys.executable, "-c", "from tracelm import kernels; print(kernels.prefetch_hint())"],
                              env=env if value is None else dict(env, TRACELM_PREFETCH_HINT=value),
                              capture_output=True, text=True, timeout=60)

    amd = platform.machine() in ("x86_64", "AMD64") and "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    default = "nta" if amd else "t0"
    assert hint(None).stdout.strip() == default
    for value in kernels.PREFETCH_HINTS:
        assert hint(value).stdout.strip() == value
    res = hint("t1")
    assert res.returncode == 0 and res.stdout.strip() == default
    assert f"TRACELM_PREFETCH_HINT='t1' is not one of t0, nta; prefetching with {default}" in res.stderr


def test_threads_and_paths_api():
    assert kernels.SUPPORTED == {0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30}
    assert kernels.path() in ("amx", "avx512vnni", "avxvnni", "avx2", "portable") and "portable" in PATHS
    # the best path that passed its self-test, unless TRACELM_KERNELS picked one (CI's portable-path run)
    assert kernels.path() == os.environ.get("TRACELM_KERNELS", PATHS[0])
    kernels.set_threads(2)
    assert kernels.threads() == 2
    kernels.set_threads(1)
    assert kernels.threads() == 1
    with pytest.raises(ValueError, match="n must be"):
        kernels.set_threads(0)
    with pytest.raises(ValueError, match="not available"):
        kernels.use_path("neon")
    # rows x halves x blocks x bytes (Q4_0, Q5_0: twice, the second time unsigned)
    assert kernels.scratch_bytes(3, 64, Q.Q4_0) == 3 * 2 * 2 * 40 * 2 + XQ_ALIGN
    assert kernels.scratch_bytes(3, 64, Q.Q8_0) == 3 * 2 * 2 * 40 + XQ_ALIGN
    assert kernels.scratch_bytes(2, 512, Q.Q6_K) == 2 * 2 * 2 * 320 + XQ_ALIGN
    assert kernels.scratch_bytes(5, 100, Q.F16) == 0
    assert kernels.row_bytes(512, Q.Q4_K) == 288


def test_dot_peak_times_each_paths_own_integer_dot_on_every_thread(kernels_restored):
    """bench's integer bound: each vector path times its own dot (AVX2: maddubs; the VNNI paths: vpdpbusd on their
    vectors) on the pool's threads; the portable path has none."""
    insn = {"amx": "vpdpbusd zmm", "avx512vnni": "vpdpbusd zmm", "avxvnni": "vpdpbusd ymm", "avx2": "vpmaddubsw ymm"}
    kernels.set_threads(2)
    for p in PATHS:
        kernels.use_path(p)
        peak = kernels.dot_peak(seconds=0.002, repeat=2)
        if p == "portable":
            assert peak is None
            continue
        assert peak["instruction"] == insn[p] and peak["path"] == p and peak["threads"] == 2
        assert peak["int8_products_g_s"] > 0
        # 8 tasks a thread, 12 accumulators of 64 (zmm) or 32 (ymm) products each round
        products, _ = kernels._core.dot_peak(3)
        assert products == 2 * 8 * 3 * 12 * (64 if insn[p].endswith("zmm") else 32)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        kernels._core.dot_peak(0)


def test_pool_counts_its_jobs_only_while_asked(kernels_restored):
    """kernels.pool_counts: the jobs run on the pool while counting, each one's wall x the threads (offered) and its
    threads' time inside tasks (busy <= offered); reset when counting starts, still when it stops; a serial job (one
    thread) is not the pool's."""
    x = np.random.default_rng(0).standard_normal((16, 512), dtype=np.float32)
    w = weights(Q.Q4_0, 512, 512)
    kernels.set_threads(2)
    kernels.pool_counting(True)
    assert kernels.pool_counts() == (0, 0.0, 0.0)
    for _ in range(3):
        kernels.matmul(x, w, Q.Q4_0)
    jobs, offered, busy = kernels.pool_counts()
    assert jobs >= 3 and 0 < busy <= offered  # each matmul: its activations' job, then the products'
    kernels.pool_counting(False)
    kernels.matmul(x, w, Q.Q4_0)
    assert kernels.pool_counts() == (jobs, offered, busy)
    kernels.set_threads(1)
    kernels.pool_counting(True)
    kernels.matmul(x, w, Q.Q4_0)
    assert kernels.pool_counts() == (0, 0.0, 0.0)
    kernels.pool_counting(False)


@pytest.mark.parametrize("threads", (2, 3))
def test_every_task_of_a_long_job_runs_once_its_takes_shrinking(threads):
    """The pool's guided takes (a job's chunk while many tasks remain, then a share of the rest down to one task):
    jobs of many tasks -- 600 groups of rows, one row or 40; 400 pieces of an activation -- leave no output unwritten
    (out starts as NaN) and give the one-thread bits at 2 and 3 threads."""
    w = weights(Q.Q4_0, 4800, 64)
    g = np.random.default_rng(3).standard_normal((2, 2 * 400 * 2048)).astype(np.float32)
    for m in (1, 40):
        x = np.random.default_rng(m).standard_normal((m, 64)).astype(np.float32)
        kernels.set_threads(1)
        ref = kernels.matmul(x, w, Q.Q4_0)
        kernels.set_threads(threads)
        out = np.full((m, 4800), np.nan, np.float32)
        kernels.matmul(x, w, Q.Q4_0, out=out)
        np.testing.assert_array_equal(bits(out), bits(ref), err_msg=f"{m} rows at {threads} threads")
    kernels.set_threads(1)
    ref = kernels.silu_mul(g, 400 * 2048, np.empty((2, 400 * 2048), np.float32))
    kernels.set_threads(threads)
    out = kernels.silu_mul(g, 400 * 2048, np.full((2, 400 * 2048), np.nan, np.float32))
    np.testing.assert_array_equal(bits(out), bits(ref))


def test_default_threads_are_the_cpus_we_may_use():
    """At import: as many threads as CPUs in the process's affinity mask (here narrowed to one CPU, then all)."""
    code = "import os; from tracelm import kernels; print(kernels.threads(), len(os.sched_getaffinity(0)))"
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    cpus = sorted(os.sched_getaffinity(0))
    one = f"import os; os.sched_setaffinity(0, {{{cpus[0]}}}); " + code
    for prog in (code, one):
        res = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        n, affinity = res.stdout.split()
        assert n == affinity
    assert kernels.default_threads() == len(cpus)


# ---------------------------------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument():
    w = weights(Q.Q4_0, 8, 64)
    x = np.ones((2, 64), np.float32)
    out = np.empty((2, 8), np.float32)
    scratch = np.empty(kernels.scratch_bytes(2, 64, Q.Q4_0), np.uint8)
    mm = kernels._core.matmul
    cases = [
        (lambda: mm(x.astype(np.float64), w, 2, out, scratch), r"x must be float32, .* shape \[2, 64\]"),
        (lambda: mm(x, w.view(np.int8), 2, out, scratch), "w must be uint8"),
        (lambda: mm(x, w[:, :30], 2, out, scratch), "C-contiguous"),
        (lambda: mm(x, np.ascontiguousarray(w[:, :30]), 2, out, scratch), "not a whole number of qtype 2 blocks"),
        (lambda: mm(x[:, :32].copy(), w, 2, out, scratch), "x has 32 values per row"),
        (lambda: mm(x, w, 2, out[:, :5].copy(), scratch), r"out must have shape \[2, 8\]"),
        (lambda: mm(x, w, 2, out.astype(np.float64), scratch), "out must be float32"),
        (lambda: mm(x, w, 2, out, scratch[:10]), "scratch must be"),
        (lambda: mm(x, w, 2, out, None), "scratch must be"),
        (lambda: mm(x[:, ::2], w, 2, out, scratch), r"x \(shape \[2, 32\]\) must be C-contiguous"),
        (lambda: mm(x[0], w, 2, out, scratch), r"x must be 2-D, got shape \[64\]"),
        (lambda: mm(x, w, 4, out, scratch), "qtype 4 is not supported"),
        (lambda: mm(x, w, 2, out.copy().view(np.uint32).view(np.float32)[:, :8].T, scratch), "out"),
        (lambda: mm(x, w, 2, np.empty((2, 16), np.float32)[:, ::2], scratch),
         r"out \(shape \[2, 8\], .* unit column stride"),
        (lambda: mm(x, w, 2, np.empty((2, 8), np.float32)[::-1], scratch), "out .* rows at least a row apart"),
        (lambda: mm(x, w, 2, np.lib.stride_tricks.as_strided(np.empty(12, np.float32), (2, 8), (16, 4)), scratch),
         "out .* rows at least a row apart"),
        (lambda: kernels.dequantize(w, Q.Q4_0, np.empty((8, 63), np.float32)), r"out must have shape \[8, 64\]"),
        (lambda: kernels.quantize_rows(x[:, :48].copy(), Q.Q4_0, scratch), "not a multiple of 32"),
        (lambda: kernels.scratch_bytes(2, 100, Q.Q4_0), "multiple of 32"),
        (lambda: kernels.pack(weights(Q.F16, 8, 64), Q.F16), "qtype 1 cannot be packed"),
        (lambda: kernels.pack(weights(Q.Q6_K, 12, 256), Q.Q6_K), "groups of 8 rows, got 12 rows"),
        (lambda: mm(np.ones((2, 256), np.float32), weights(Q.Q4_K, 12, 256), Q.Q4_K, out[:, :12].copy(), None, 2,
                    True), "groups of 8 rows, got 12 rows"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable"):
        mm(x, w, 2, ro, scratch)


def test_every_path_passed_its_self_test():
    """Every path this CPU has met the portable path bit for bit on the self-test's battery before it ran."""
    report = kernels.selftest()
    assert report["portable"][0] == "passed" and set(PATHS) <= set(report)
    for name in PATHS:
        status, detail = report[name]
        assert status == "passed", (name, detail)
    for name, (status, _) in report.items():
        assert status in ("passed", "unsupported"), (name, status)  # paths() tested every one the CPU has


SELFTEST_FAULT = """
import sys, warnings
broken = sys.argv[1]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from tracelm import kernels
    assert broken not in kernels.paths() and kernels.path() != broken, kernels.paths()
status, detail = kernels.selftest()[broken]
assert status == "refused" and "differs from the portable path" in detail, (status, detail)
assert any(broken in str(w.message) and "refused" in str(w.message) for w in seen), [str(w.message) for w in seen]
try:
    kernels.use_path(broken)
    raise SystemExit("use_path took a refused path")
except ValueError as e:
    assert "self-test failed" in str(e), e
print(kernels.path())
"""


@pytest.mark.parametrize("broken", [p for p in PATHS if p != "portable"] or ["(none)"])
def test_a_path_that_differs_in_one_bit_is_refused(broken):
    """TRACELM_SELFTEST_FAULT flips one bit of one product of that path's self-test: the path is refused (not in
    paths(), not chosen, use_path says why) with a warning, and the next best runs."""
    if broken == "(none)":
        pytest.skip("this CPU runs only the portable path, which is the reference")
    env = dict(os.environ, TRACELM_SELFTEST_FAULT=broken)
    env.pop("TRACELM_KERNELS", None)
    res = subprocess.run([sys.executable, "-c", SELFTEST_FAULT, broken], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == next(p for p in PATHS if p != broken)


def test_env_var_picks_each_path():
    """TRACELM_KERNELS=NAME at import runs that path (each path this CPU has)."""
    for name in PATHS:
        env = dict(os.environ, TRACELM_KERNELS=name)
        res = subprocess.run([sys.executable, "-c", "from tracelm import kernels; print(kernels.path())"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.strip() == name, (name, res.stderr)
