"""f32 rows -> GGUF blocks: the quantization `tracelm quantize` writes and `--quantize` applies on load.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are `gguf.quants.quantize` (gguf-py's statement of llama.cpp's reference
quantizers: the same bytes). gguf-py has no quantizer for the K-quants, so Q4_K, Q5_K and Q6_K are written here in
numpy, over whole arrays of blocks (the only Python loops run over a fixed list of candidate scales):

- Q4_K / Q5_K (super-blocks of 256 = 8 sub-blocks of 32, x ~ d*sc_j*q - dmin*m_j, q in 0..15 / 0..31, sc_j and m_j
  6-bit): per sub-block, the rule of llama.cpp's `make_qkx2_quants` -- weights w = rms(x) + |x|; the min-max
  scale (max - min) / nmax with min = min(x, 0), and 21 candidate inverse scales (nmax - 1 + 0.1 k) / (max - min),
  k = 0..20: each rounds x, then fits scale and offset by weighted least squares (offset kept <= 0); the candidate
  with the least weighted squared error wins. Then d = max sc / 63 and dmin = max m / 63 (f16), each sub-block's
  scale and min rounded to 6 bits, and x rounded again on the rounded scales.
- Q6_K (16 sub-blocks of 16, x ~ d*sc_j*q, q in -32..31, sc_j int8): per sub-block, the rule of llama.cpp's
  `make_qx_quants` (weights x^2): the inverse scales -(32 + 0.1 k) / amax for k = -9..9, where amax is the value of
  largest magnitude, each scored by (sum w x q)^2 / sum w q^2, the best giving scale = sum w x q / sum w q^2; then
  d = max |sc| / 128 (f16) with the sign that maps it to -128, the scales rounded to int8, x rounded again.

Rounding is to nearest, ties to even (numpy's rint); every block is a function of its own values only, so rows
can be quantized in any grouping. tests/test_quantize.py bounds the RMS error of each K-quant against f32.

Which tensors get which type follows llama-quantize's habits (`tensor_type`): vectors (norms, biases) stay F32;
the output matrix -- or the token embedding when the head is tied to it -- is Q6_K (Q8_0 when the type asked is
Q8_0 or its rows are not whole 256-value super-blocks); every other matrix the type asked, with llama.cpp's
fallback when its rows are not whole blocks of that type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from tracelm.state.errors import TracelmError

QUANT_TYPES: dict[str, QType] = {
    "q8_0": QType.Q8_0, "q4_0": QType.Q4_0, "q4_1": QType.Q4_1, "q5_0": QType.Q5_0, "q5_1": QType.Q5_1,
    "q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K,
}
FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}
FLOAT_TYPES = frozenset((QType.F32, QType.F16, QType.BF16))
ROWS_PER_CHUNK_VALUES = 1 << 20  # f32 values quantized per call (`quantize_rows` chunks larger arrays)
K_CHUNK_VALUES = 1 << 15  # ... for the K-quants, whose many passes over a chunk then stay in the CPU's cache


def quant_type(name: str) -> QType:
    """The GGML type of a --quantize / --type name (q8_0, q4_0, q4_k, ...), a TracelmError naming the choices."""
    qtype = QUANT_TYPES.get(str(name).lower())
    if qtype is None:
        raise TracelmError(f"quantize type {name!r}: expected one of {', '.join(QUANT_TYPES)}")
    return qtype


def tensor_type(name: str, shape: tuple[int, ...], qtype: QType, tied_head: bool) -> QType:
    """The type llama-quantize gives tensor `name` of `shape` (numpy order) when asked for `qtype`."""
    if len(shape) < 2:
        return QType.F32
    cols = shape[-1]
    if name == "output.weight" or (tied_head and name == "token_embd.weight"):
        return QType.Q8_0 if qtype == QType.Q8_0 or cols % 256 else QType.Q6_K
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else QType.F16


def row_bytes(cols: int, qtype: QType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


def quantize_rows(x: np.ndarray, qtype: QType, out: np.ndarray | None = None) -> np.ndarray:
    """f32 rows [n, cols] as `qtype` blocks [n, row_bytes] (uint8), a chunk of rows at a time into `out`."""
    x = np.asarray(x, np.float32)
    n, cols = x.shape
    if out is None:
        out = np.empty((n, row_bytes(cols, qtype)), np.uint8)
    if qtype == QType.F32:
        out[...] = x.view(np.uint8)
        return out
    if qtype == QType.F16:
        out[...] = x.astype(np.float16).view(np.uint8)
        return out
    blocks = _K_QUANTS.get(qtype)
    step = max(1, (ROWS_PER_CHUNK_VALUES if blocks is None else K_CHUNK_VALUES) // cols)
    for r in range(0, n, step):  # chunks of rows (bounded temporaries), never single blocks
        rows = x[r : r + step]
        if blocks is not None:
            q = blocks(rows.reshape(-1, 256)).reshape(len(rows), -1)
        else:
            q = quants.quantize(rows, qtype)
        out[r : r + len(rows)] = q
    return out


def _f16(a: np.ndarray) -> np.ndarray:
    """f32 -> the f32 value of its nearest f16 (what the block stores and the dequantizer reads)."""
    return a.astype(np.float16).astype(np.float32)


def _safe_inverse(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(a == 0, np.float32(0), np.float32(1) / np.where(a == 0, 1, a)).astype(np.float32)


def _min_scale(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qkx2_quants over sub-blocks x [m, k]: (scale >= 0, min >= 0) with x ~ scale * q - min. Each candidate's
    weighted squared error comes from its sums (sum w (s q + o - x)^2 expanded), not from another pass over x."""
    x = x.astype(np.float32)
    w = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=1, keepdims=True), 0)
    span = x.max(axis=1, keepdims=True) - lo
    sw, sx, sxx = w.sum(1, keepdims=True), (w * x).sum(1, keepdims=True), (w * x * x).sum(1, keepdims=True)
    inv_span = _safe_inverse(span)
    shifted = x - lo

    def fit(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        wq = w * q
        sl, sl2, sxl = wq.sum(1, keepdims=True), (wq * q).sum(1, keepdims=True), (wq * x).sum(1, keepdims=True)
        return sl, sl2, sxl, sl2 > 0

    def error(scale, offset, sl, sl2, sxl):  # noqa: ANN001, ANN202
        return (scale * scale * sl2 + 2 * scale * offset * sl - 2 * scale * sxl + offset * offset * sw
                - 2 * offset * sx + sxx)

    best_scale, best_min = span / nmax, lo
    sl, sl2, sxl, _ = fit(np.clip(np.rint(shifted * (nmax * inv_span)), 0, nmax))
    best_err = error(best_scale, best_min, sl, sl2, sxl)
    for k in range(21):
        sl, sl2, sxl, _ = fit(np.clip(np.rint(shifted * ((nmax - 1 + 0.1 * k) * inv_span)), 0, nmax))
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = np.where(ok, det, 1)
        scale = (sw * sxl - sx * sl) / det
        offset = (sl2 * sx - sl * sxl) / det
        positive = offset > 0  # an offset above zero: fit the scale alone with offset 0
        scale = np.where(positive, sxl / np.where(sl2 > 0, sl2, 1), scale)
        offset = np.where(positive, 0, offset)
        err = error(scale, offset, sl, sl2, sxl)
        better = ok & (err < best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, offset, best_min)
        best_err = np.where(better, err, best_err)
    return np.maximum(best_scale, 0)[:, 0], (-best_min)[:, 0]


def _kx_blocks(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks x [n, 256] -> (d f16 bytes, dmin f16 bytes, 12 bytes of 6-bit scales and mins, q [n, 8, 32])."""
    n = len(x)
    sub = x.reshape(n, 8, 32)
    scale, mn = (a.reshape(n, 8) for a in _min_scale(sub.reshape(n * 8, 32), nmax))
    d = _f16(scale.max(axis=1, keepdims=True) / 63)
    dmin = _f16(mn.max(axis=1, keepdims=True) / 63)
    sc = np.clip(np.rint(scale * _safe_inverse(d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mn * _safe_inverse(dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[:, :, None]
    q = np.clip(np.rint((sub + (dmin * m)[:, :, None]) * _safe_inverse(step)), 0, nmax).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    return (d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), packed, q)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] -> [n, 128]: sub-block 2i in the low nibbles of 32 bytes, 2i + 1 in the high."""
    q = q.reshape(len(q), 4, 2, 32)
    return ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(len(q), 128)


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] f32 -> Q4_K [n, 144]."""
    d, dmin, scales, q = _kx_blocks(x, 15)
    return np.concatenate([d, dmin, scales, _nibble_pairs(q)], axis=1)


def q5_k_blocks(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] f32 -> Q5_K [n, 176] (the fifth bits: bit j of byte l is sub-block j's value l)."""
    d, dmin, scales, q = _kx_blocks(x, 31)
    high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([d, dmin, scales, qh, _nibble_pairs(q)], axis=1)


def _symmetric_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants over sub-blocks x [m, k] (weights x^2): the scale with x ~ scale * q, q in -nmax..nmax-1."""
    w = x * x
    amax_at = np.abs(x).argmax(axis=1)[:, None]
    amax = np.take_along_axis(x, amax_at, axis=1)
    inv_amax = _safe_inverse(amax)
    best_score = np.full((len(x), 1), -1.0, np.float32)
    best_scale = np.zeros((len(x), 1), np.float32)
    for k in range(-9, 10):
        q = np.clip(np.rint(-(nmax + 0.1 * k) * inv_amax * x), -nmax, nmax - 1)
        slx, sl2 = (w * x * q).sum(1, keepdims=True), (w * q * q).sum(1, keepdims=True)
        ok = sl2 > 0
        sl2 = np.where(ok, sl2, 1)
        score = np.where(ok, slx * slx / sl2, -1)
        better = score > best_score
        best_scale = np.where(better, slx / sl2, best_scale)
        best_score = np.where(better, score, best_score)
    return best_scale[:, 0]


def q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] f32 -> Q6_K [n, 210]: ql (128 bytes), qh (64), 16 int8 scales, f16 d."""
    n = len(x)
    sub = x.reshape(n, 16, 16).astype(np.float32)
    scale = _symmetric_scale(sub.reshape(n * 16, 16), 32).reshape(n, 16)
    at = np.abs(scale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scale, at, axis=1)
    inv = -128 * _safe_inverse(max_scale)
    sc = np.clip(np.rint(inv * scale), -128, 127).astype(np.int8)
    d = _f16(_safe_inverse(inv))
    step = (d * sc)[:, :, None]
    q = np.clip(np.rint(sub * _safe_inverse(step)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, value]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d.astype(np.float16).view(np.uint8)], axis=1)


_K_QUANTS = {QType.Q4_K: q4_k_blocks, QType.Q5_K: q5_k_blocks, QType.Q6_K: q6_k_blocks}
