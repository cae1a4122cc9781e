"""Known-answer tests for dequantization: GGML blocks built byte by byte here, expected floats by hand.

Q5_K is Q4_K plus qh[32] (after the scales) whose bit e//32 of byte e%32 is bit 4 of element e;
Q3_K and Q2_K are described in their tests.

Block layouts (little-endian; "f16" is an IEEE half):
  Q4_0  18 B / 32:  f16 d, 16 B nibbles          y[j] = d*(lo(qs[j]) - 8), y[j+16] = d*(hi(qs[j]) - 8)
  Q4_1  20 B / 32:  f16 d, f16 m, 16 B nibbles   y = d*q + m, same element order as Q4_0
  Q5_0  22 B / 32:  f16 d, u32 qh, 16 B nibbles  q = nibble | bit j of qh << 4 (j = element), y = d*(q-16)
  Q8_0  34 B / 32:  f16 d, 32 x int8             y = d*q
  Q4_K 144 B / 256: f16 d, f16 dmin, 12 B packed 6-bit (scale, min) x 8, 128 B nibbles;
        qs[32c + l] holds element 64c + l (low nibble) and 64c + 32 + l (high nibble);
        y = d*scale[e//32]*q - dmin*min[e//32]
  Q6_K 210 B / 256: 128 B ql (low 4 bits), 64 B qh (high 2 bits), 16 x int8 scales, f16 d;
        in each half of 128 (ql += 64, qh += 32): ql[l] low/high nibble -> elements l / l+64,
        ql[l+32] low/high -> l+32 / l+96, qh[l] bits 0-1, 2-3, 4-5, 6-7 -> l, l+32, l+64, l+96;
        y = d*scales[e//16]*(q - 32)
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tracelm import TracelmError
from tracelm.io.dequant import dequantize


def f16(x: float) -> bytes:
    return struct.pack("<e", x)


def nibbles(lo: list[int], hi: list[int]) -> bytes:
    return bytes(a | b << 4 for a, b in zip(lo, hi, strict=True))


def raw(*parts: bytes) -> np.ndarray:
    return np.frombuffer(b"".join(parts), np.uint8)


# --- float types --------------------------------------------------------------------------------


def test_f32_round_trip():
    x = np.array([[1.0, -2.5, 3.0e-8], [np.pi, -0.0, 1e30]], np.float32)
    out = dequantize(x.view(np.uint8).ravel(), QType.F32, (2, 3))
    assert out.dtype == np.float32 and out.shape == (2, 3)
    np.testing.assert_array_equal(out, x)


def test_f16_round_trip():
    raw_bytes = raw(f16(1.0), f16(-2.5), f16(0.000061035156), f16(65504.0))
    np.testing.assert_array_equal(dequantize(raw_bytes, QType.F16, (4,)), [1.0, -2.5, 2.0**-14, 65504.0])


def test_bf16_round_trip():
    # bf16 is the upper 16 bits of the f32: 1.0 = 0x3F80, -2.5 = 0xC020, 3.140625 = 0x4049, 2^-100 = 0x0D80
    raw_bytes = raw(struct.pack("<4H", 0x3F80, 0xC020, 0x4049, 0x0D80))
    out = dequantize(raw_bytes, QType.BF16, (2, 2))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[1.0, -2.5], [3.140625, 2.0**-100]])
    x = np.array([0.15625, -7.0, 1e20, -3.5e-20], np.float32)  # the f32 -> bf16 -> f32 trip drops nothing here
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    top = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(dequantize(top.view(np.uint8), QType.BF16, (4,)), x)


# --- 32-element blocks --------------------------------------------------------------------------


def test_q4_0_by_hand():
    lo, hi = list(range(16)), list(range(15, -1, -1))  # low nibbles 0..15, high nibbles 15..0
    block0 = f16(0.5) + nibbles(lo, hi)
    block1 = f16(-2.0) + nibbles([8] * 15 + [0], [9] * 16)
    out = dequantize(raw(block0, block1), QType.Q4_0, (2, 32))
    expected0 = [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
                 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, -4.0]
    expected1 = [0.0] * 15 + [16.0] + [-2.0] * 16  # -2*(8-8), -2*(0-8), -2*(9-8)
    np.testing.assert_array_equal(out, [expected0, expected1])


def test_q4_0_accepts_rows_of_bytes():
    """GGUFReader hands quantized tensors over as [rows, bytes per row]."""
    block = f16(0.25) + nibbles([1] * 16, [15] * 16)
    rows = raw(block, block, block).reshape(3, 18)
    out = dequantize(rows, QType.Q4_0, (3, 32))
    np.testing.assert_array_equal(out, np.array([[-1.75] * 16 + [1.75] * 16] * 3))


def test_q4_1_by_hand():
    lo, hi = list(range(16)), [15, 0] * 8
    out = dequantize(raw(f16(0.25), f16(-1.0), nibbles(lo, hi)), QType.Q4_1, (32,))
    expected = [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75]
    expected += [2.75, -1.0] * 8  # 0.25*15 - 1, 0.25*0 - 1
    np.testing.assert_array_equal(out, expected)


def test_q5_0_by_hand():
    # qh bit j is the 5th bit of element j: set it for elements 1, 3 and 16..31
    qh = (1 << 1) | (1 << 3) | (0xFFFF << 16)
    lo, hi = [0, 0, 15, 15] + [8] * 12, [0] * 8 + [15] * 8
    out = dequantize(raw(f16(0.5), struct.pack("<I", qh), nibbles(lo, hi)), QType.Q5_0, (32,))
    # element = 0.5 * (q - 16); q: 0, 16, 15, 31, then 8 ...; high half: 16 (x8), 31 (x8)
    expected = [-8.0, 0.0, -0.5, 7.5] + [-4.0] * 12 + [0.0] * 8 + [7.5] * 8
    np.testing.assert_array_equal(out, expected)


def test_q8_0_by_hand():
    qs = [-128, 127, 0, 1, -1, 64, -64, 100] + list(range(-12, 12))
    out = dequantize(raw(f16(0.125), struct.pack("<32b", *qs)), QType.Q8_0, (32,))
    expected = [-16.0, 15.875, 0.0, 0.125, -0.125, 8.0, -8.0, 12.5] + [0.125 * i for i in range(-12, 12)]
    np.testing.assert_array_equal(out, expected)


# --- 256-element super-blocks -------------------------------------------------------------------


def pack_k4_scales(scale: list[int], mins: list[int]) -> bytes:
    """Eight 6-bit (scale, min) pairs into the 12 bytes of Q4_K/Q5_K.

    Bytes 0-3: scale[0..3] in bits 0-5, bits 4-5 of scale[4..7] in bits 6-7;
    bytes 4-7: min[0..3] in bits 0-5, bits 4-5 of min[4..7] in bits 6-7;
    bytes 8-11: low 4 bits of scale[4..7] | low 4 bits of min[4..7] << 4.
    """
    b = [0] * 12
    for j in range(4):
        b[j] = scale[j] | (scale[j + 4] >> 4) << 6
        b[j + 4] = mins[j] | (mins[j + 4] >> 4) << 6
        b[j + 8] = (scale[j + 4] & 0xF) | (mins[j + 4] & 0xF) << 4
    return bytes(b)


def test_pack_k4_scales_by_hand():
    # scale 4 = 17 = 0b01_0001 -> top bits 01 into byte 0 bits 6-7, low 0001 into byte 8;
    # min 4 = 48 = 0b11_0000 -> top bits 11 into byte 4 bits 6-7, low 0000 into byte 8's high nibble
    got = pack_k4_scales([1, 2, 3, 4, 17, 0, 0, 0], [5, 6, 7, 8, 48, 0, 0, 0])
    assert got == bytes([0x41, 2, 3, 4, 0xC5, 6, 7, 8, 0x01, 0, 0, 0])


Q4K_SCALES = [1, 2, 3, 4, 17, 33, 63, 40]  # sub-blocks 4..7 have high bits set: the split-byte path
Q4K_MINS = [0, 1, 5, 63, 16, 20, 48, 7]


def test_q4_k_by_hand():
    d, dmin = 0.5, 0.25
    q = [(e * 5 + e // 16) % 16 for e in range(256)]  # the 4-bit value of element e
    qs = bytes(q[64 * c + t] | q[64 * c + 32 + t] << 4 for c in range(4) for t in range(32))
    block = f16(d) + f16(dmin) + pack_k4_scales(Q4K_SCALES, Q4K_MINS) + qs
    assert len(block) == 144
    out = dequantize(raw(block), QType.Q4_K, (256,))
    expected = [d * Q4K_SCALES[e // 32] * q[e] - dmin * Q4K_MINS[e // 32] for e in range(256)]
    np.testing.assert_array_equal(out, expected)
    # a few by hand: e=0: 0.5*1*0 - 0; e=33: q=(165+2)%16=7 -> 0.5*2*7 - 0.25*1 = 6.75;
    # e=200 (sub-block 6): q=(1000+12)%16=4 -> 0.5*63*4 - 0.25*48 = 114.0;
    # e=255 (sub-block 7): q=(1275+15)%16=10 -> 0.5*40*10 - 0.25*7 = 198.25
    assert (out[0], out[33], out[200], out[255]) == (0.0, 6.75, 114.0, 198.25)


def test_q6_k_by_hand():
    d = 0.25
    q = [(e * 7 + 3) % 64 for e in range(256)]  # the 6-bit value of element e (stored as q, means q-32)
    sc = [1, -2, 3, -4, 5, -6, 7, -8, 127, -128, 0, 1, 2, 3, 4, 5]  # one int8 scale per 16 elements
    ql, qh = bytearray(128), bytearray(64)
    for half in range(2):
        for t in range(32):
            a, b, c, e = (128 * half + t + 32 * i for i in range(4))
            ql[64 * half + t] = (q[a] & 0xF) | (q[c] & 0xF) << 4
            ql[64 * half + t + 32] = (q[b] & 0xF) | (q[e] & 0xF) << 4
            qh[32 * half + t] = q[a] >> 4 | (q[b] >> 4) << 2 | (q[c] >> 4) << 4 | (q[e] >> 4) << 6
    block = bytes(ql) + bytes(qh) + struct.pack("<16b", *sc) + f16(d)
    assert len(block) == 210
    out = dequantize(raw(block), QType.Q6_K, (256,))
    expected = [d * sc[e // 16] * (q[e] - 32) for e in range(256)]
    np.testing.assert_array_equal(out, expected)
    # by hand: e=0: q=3 -> 0.25*1*(3-32) = -7.25; e=130 (scale 8 = 127): q=(910+3)%64=17 -> 0.25*127*(-15)
    # = -476.25; e=150 (scale 9 = -128): q=(1050+3)%64=29 -> 0.25*-128*(-3) = 96.0
    assert (out[0], out[130], out[150]) == (-7.25, -476.25, 96.0)


def test_q5_k_by_hand():
    d, dmin = 0.5, 0.25
    q = [(e * 11 + e // 64) % 32 for e in range(256)]  # the 5-bit value of element e
    qh = bytes(sum(((q[32 * b + t] >> 4) & 1) << b for b in range(8)) for t in range(32))  # bit e//32
    qs = bytes((q[64 * c + t] & 0xF) | (q[64 * c + 32 + t] & 0xF) << 4 for c in range(4) for t in range(32))
    block = f16(d) + f16(dmin) + pack_k4_scales(Q4K_SCALES, Q4K_MINS) + qh + qs
    assert len(block) == 176
    out = dequantize(raw(block), QType.Q5_K, (256,))
    expected = [d * Q4K_SCALES[e // 32] * q[e] - dmin * Q4K_MINS[e // 32] for e in range(256)]
    np.testing.assert_array_equal(out, expected)
    # by hand: e=3: q=33%32=1 -> 0.5*1*1 - 0 = 0.5; e=201: q=(2211+3)%32=6 -> 0.5*63*6 - 0.25*48 = 177.0
    assert (out[3], out[201]) == (0.5, 177.0)


def test_q3_k_by_hand():
    """Q3_K 110 B / 256: hmask[32], qs[64], 12 B packed 6-bit scales, f16 d.

    Element e: low 2 bits in qs[32*(e//128) + e%32] at bit 2*((e%128)//32), high bit in hmask[e%32] at
    bit e//32 (set means +0, clear means -4); y = d*(scale[e//16] - 32)*(v - 4) for the 3-bit v.
    Scales: bytes 0-7 hold the low nibbles of scale[i] (low half) and scale[i+8] (high half); byte 8+k
    holds the top 2 bits of scale[k], scale[k+4], scale[k+8], scale[k+12] at bits 0, 2, 4, 6.
    """
    d = 0.5
    v = [(e * 3 + e // 32) % 8 for e in range(256)]
    sc = [32, 33, 31, 0, 63, 40, 20, 16, 47, 48, 1, 62, 34, 30, 32, 50]
    hmask = bytes(sum((v[32 * b + t] >> 2) << b for b in range(8)) for t in range(32))
    qs = bytes(sum((v[128 * h + 32 * j + t] & 3) << (2 * j) for j in range(4)) for h in range(2) for t in range(32))
    scales = [(sc[i] & 0xF) | (sc[i + 8] & 0xF) << 4 for i in range(8)]
    scales += [sum((sc[k + 4 * j] >> 4) << (2 * j) for j in range(4)) for k in range(4)]
    block = hmask + qs + bytes(scales) + f16(d)
    assert len(block) == 110
    out = dequantize(raw(block), QType.Q3_K, (256,))
    expected = [d * (sc[e // 16] - 32) * (v[e] - 4) for e in range(256)]
    np.testing.assert_array_equal(out, expected)
    # by hand: e=16 (scale 33): v=48%8=0 -> 0.5*1*(-4) = -2.0; e=70 (scale 4 = 63): v=(210+2)%8=4 -> 0.0;
    # e=71: v=(213+2)%8=7 -> 0.5*31*3 = 46.5; e=254 (scale 50): v=(762+7)%8=1 -> 0.5*18*(-3) = -27.0;
    # e=255: v=(765+7)%8=4 -> 0.0
    assert (out[16], out[70], out[71], out[254], out[255]) == (-2.0, 0.0, 46.5, -27.0, 0.0)


def test_q2_k_by_hand():
    """Q2_K 84 B / 256: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.

    Element e: 2 bits in qs[32*(e//128) + e%32] at bit 2*((e%128)//32); y = d*sc*v - dmin*m with
    (sc, m) from scales[e//16].
    """
    d, dmin = 0.5, 0.25
    v = [(e * 3 + e // 64) % 4 for e in range(256)]
    sc = [(i * 5) % 16 for i in range(16)]
    mins = [(i * 7 + 3) % 16 for i in range(16)]
    qs = bytes(sum(v[128 * h + 32 * j + t] << (2 * j) for j in range(4)) for h in range(2) for t in range(32))
    block = bytes(a | b << 4 for a, b in zip(sc, mins, strict=True)) + qs + f16(d) + f16(dmin)
    assert len(block) == 84
    out = dequantize(raw(block), QType.Q2_K, (256,))
    expected = [d * sc[e // 16] * v[e] - dmin * mins[e // 16] for e in range(256)]
    np.testing.assert_array_equal(out, expected)
    # by hand: e=0: 0 - 0.25*3 = -0.75; e=17 (sc 5, m 10): v=51%4=3 -> 7.5 - 2.5 = 5.0;
    # e=200 (sc (12*5)%16=12, m (84+3)%16=7): v=(600+3)%4=3 -> 18.0 - 1.75 = 16.25
    assert (out[0], out[17], out[200]) == (-0.75, 5.0, 16.25)


def test_two_q6_k_super_blocks_keep_their_own_d():
    zero_q = bytes(128) + bytes(64)  # every q = 0 -> q - 32 = -32
    blocks = [zero_q + struct.pack("<16b", *[1] * 16) + f16(d) for d in (1.0, -0.5)]
    out = dequantize(raw(*blocks), QType.Q6_K, (2, 256))
    np.testing.assert_array_equal(out, [[-32.0] * 256, [16.0] * 256])


# --- errors -------------------------------------------------------------------------------------


def test_shape_mismatch_raises():
    block = raw(f16(1.0), bytes(16))
    with pytest.raises(TracelmError, match=r"Q4_0 data holds 32 values, shape \[2, 32\] needs 64"):
        dequantize(block, QType.Q4_0, (2, 32))
    with pytest.raises(TracelmError, match="BF16"):
        dequantize(raw(bytes(8)), QType.BF16, (5,))


def test_unsupported_type_is_named():
    assert QType.Q8_K not in quants._type_traits  # gguf.quants has no Q8_K (an internal dot-product type)
    with pytest.raises(TracelmError, match="unsupported tensor type Q8_K"):
        dequantize(raw(bytes(292)), QType.Q8_K, (256,))


def test_unknown_type_number_raises():
    with pytest.raises(TracelmError, match="unknown tensor type 999"):
        dequantize(raw(bytes(4)), 999, (1,))


# --- round trip through gguf.quants.quantize ----------------------------------------------------

# Worst-case |error| as a fraction of |x| (float types, per element) or of the block's largest |x|
# (quantized types, per block; the f16 block scale adds up to 2^-10 of it). Symmetric types put the
# largest |x| at one end of the grid, so the other end can be a whole step off. The K-quant bounds
# are loose and untested: they apply only if gguf.quants ever learns to quantize those types.
FLOAT_BOUNDS = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}
BLOCK_BOUNDS = {
    "Q4_0": 1 / 8,  # step amax/8, q clipped at +7
    "Q4_1": 1 / 15,  # step (max-min)/15 <= 2 amax/15, half a step
    "Q5_0": 1 / 16,  # step amax/16, q clipped at +15
    "Q5_1": 1 / 31,
    "Q8_0": 1 / 254,  # step amax/127, half a step
    "Q2_K": 1 / 2,
    "Q3_K": 1 / 4,
    "Q4_K": 1 / 8,
    "Q5_K": 1 / 16,
    "Q6_K": 1 / 32,
}


@pytest.mark.parametrize("name", list(FLOAT_BOUNDS) + list(BLOCK_BOUNDS))
def test_round_trip_through_gguf_quantize(name):
    qtype = QType[name]
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    x[1] *= 0.02  # rows of different magnitude (weights-like): each block has its own scale
    x[2] += 2.0  # and one with an offset (the min of Q4_1/Q5_1 and the K-quants)
    try:
        q = quants.quantize(x, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf.quants cannot quantize {name} (dequantize only); the known-answer blocks cover it")
    out = dequantize(np.ascontiguousarray(q).view(np.uint8), qtype, x.shape)
    assert out.shape == x.shape and out.dtype == np.float32
    if name in FLOAT_BOUNDS:
        rel = np.abs(out - x) / np.abs(x)
        assert np.all(rel <= FLOAT_BOUNDS[name]), f"{name}: worst {rel.max():.4g} x |x|"
    else:
        block = quants._type_traits[qtype].block_size
        err = np.abs(out - x).reshape(-1, block).max(axis=1)
        amax = np.abs(x).reshape(-1, block).max(axis=1)
        worst = float(np.max(err / amax))
        assert worst <= BLOCK_BOUNDS[name] + 2.0**-10, f"{name}: worst {worst:.4g} x amax"
    assert name == "F32" or np.any(out != x)  # it really went through a lossy format
