"""Dequantization of GGUF tensor data to f32: `gguf.quants` for every type, and numpy kernels with exactly its
arithmetic for the four main types (Q4_1, Q5_0, Q4_K, Q6_K), run a slice of blocks at a time so that their
temporaries stay small and in cache."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from tracelm.state.errors import TracelmError


def _nibbles(qs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Packed 4-bit values [n, k] -> [n, 2k] uint8 as ggml lays them: low nibbles first, then high."""
    k = qs.shape[1]
    np.bitwise_and(qs, 0x0F, out=out[:, :k])
    np.right_shift(qs, 4, out=out[:, k:])
    return out


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1 blocks [n, 20] (f16 d, f16 m, 16 bytes of nibbles) -> out [n, 32] = d * q + m."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    np.copyto(out, _nibbles(blocks[:, 4:], np.empty(out.shape, np.uint8)), casting="unsafe")
    out *= d
    out += m


def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_0 blocks [n, 22] (f16 d, 32 high bits, 16 bytes of nibbles) -> out [n, 32] = d * (q - 16)."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = _nibbles(blocks[:, 6:], np.empty(out.shape, np.uint8))
    q |= np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little") << 4
    np.copyto(out, q, casting="unsafe")
    out -= 16
    out *= d


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K super-blocks [n, 144] (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles)
    -> out [n, 256]: sub-block j (32 values) = (d * sc_j) * q - dmin * m_j."""
    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    a, b, c = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=1).astype(np.float32)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=1).astype(np.float32)
    qs = blocks[:, 16:].reshape(n, 4, 32)  # 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high
    q = np.empty((n, 4, 2, 32), np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    np.copyto(out, q.reshape(n, 256), casting="unsafe")
    o = out.reshape(n, 8, 32)
    o *= (d * sc)[:, :, None]
    o -= (dmin * mn)[:, :, None]


def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K super-blocks [n, 210] (128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d)
    -> out [n, 256]: sub-block j (16 values) = (d * sc_j) * (q - 32)."""
    n = len(blocks)
    ql = blocks[:, :128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    q = np.empty((n, 2, 2, 64), np.uint8)
    np.bitwise_and(ql, 15, out=q[:, :, 0])
    np.right_shift(ql, 4, out=q[:, :, 1])
    q4 = q.reshape(n, 2, 4, 32)
    for k in range(4):
        q4[:, :, k] |= ((qh >> (2 * k)) & 3) << 4
    np.copyto(out, q.reshape(n, 256), casting="unsafe")
    out -= 32
    o = out.reshape(n, 16, 16)
    o *= (d * sc)[:, :, None]


# Types whose gguf.quants dequantization is rewritten here with fewer temporaries (so, faster), with
# exactly its arithmetic (f32 products and sums, elementwise): the same numbers (tests/test_streamed.py
# checks value for value against gguf.quants).
_KERNELS = {QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q4_K: _q4_k, QType.Q6_K: _q6_k}
KERNEL_VALUES = 1 << 16  # values per kernel call: temporaries stay in cache


def dequantize(raw: np.ndarray, qtype: QType | int, shape: tuple[int, ...], out: np.ndarray | None = None
               ) -> np.ndarray:
    """Raw GGUF tensor bytes (or f32/f16 values) -> contiguous f32 array of `shape` (written into `out`, a
    contiguous f32 array of that many values, when given: the own kernels write there directly)."""
    try:
        qtype = QType(qtype)
    except ValueError:
        raise TracelmError(f"unknown tensor type {qtype}") from None
    n = int(np.prod(shape))
    if qtype == QType.BF16:  # bf16 is the top half of an f32
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        values = bits.view(np.float32)
    elif qtype in _KERNELS and np.asarray(raw).size % GGML_QUANT_SIZES[qtype][1] == 0:
        block, type_size = GGML_QUANT_SIZES[qtype]
        blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
        if len(blocks) * block != n:
            raise TracelmError(f"{qtype.name} data holds {len(blocks) * block} values, shape {list(shape)} "
                               f"needs {n}")
        direct = out is not None and out.flags.c_contiguous and out.dtype == np.float32 and out.size == n
        values = out.reshape(-1, block) if direct else np.empty((len(blocks), block), np.float32)
        step = max(1, KERNEL_VALUES // block)
        for i in range(0, len(blocks), step):
            _KERNELS[qtype](blocks[i : i + step], values[i : i + step])
        if direct:
            return out
    else:
        data = np.asarray(raw)
        block, type_size = GGML_QUANT_SIZES.get(qtype, (1, 1))
        if block > 1 and data.size % type_size == 0 and data.size:
            # gguf.quants works 16 rows per call: rows of ~GROUP_VALUES values (whole blocks; each block is
            # dequantized on its own, so how they are grouped changes no number) make its Python overhead small
            n_blocks, per = data.size // type_size, max(1, GROUP_VALUES // block)
            while n_blocks % per:
                per -= 1
            data = np.ascontiguousarray(data).reshape(-1, per * type_size)
        try:
            values = quants.dequantize(data, qtype)
        except NotImplementedError:
            raise TracelmError(f"unsupported tensor type {qtype.name}") from None
    if values.size != n:
        raise TracelmError(f"{qtype.name} data holds {values.size} values, shape {list(shape)} needs {n}")
    if out is not None:
        out[...] = values.reshape(out.shape)
        return out
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


GROUP_VALUES = 4096  # values per row handed to gguf.quants (it dequantizes 16 rows per call)

# Rows dequantized per call when a matrix is made a block of rows at a time: about 1 MB of f32 keeps the
# dequantizer's temporaries small and in cache (one whole-tensor call makes them as large as the tensor).
CHUNK_VALUES = 1 << 18
