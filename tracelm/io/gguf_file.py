"""GGUF: metadata -> ModelConfig, memory-mapped tensors, dequantization to f32 (via gguf.quants)."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from tracelm import TracelmError, kernels
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights, QMatrix

GGUF_MAGIC = b"GGUF"

# Architectures the graph builds, with the options their GGUF files imply.
# Keys read from the metadata override these (attention.sliding_window, rope.freq_base_swa, ...).
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {"rope_mode": "adjacent"},
    "qwen2": {"rope_mode": "neox", "qkv_bias": True},
    "qwen3": {"rope_mode": "neox", "qk_norm": True},
    "phi3": {"rope_mode": "neox"},
    # llama.cpp's gemma3: every 6th layer global, windowed layers on RoPE base 10000
    "gemma3": {"rope_mode": "neox", "qk_norm": True, "post_norms": True, "ffn_act": "gelu_tanh",
               "swa_pattern": 6, "rope_base_swa": 10000.0},
}


# GGUF metadata value types -> struct format (8 string, 9 array are handled apart).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@attrs.frozen(slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF's ne reversed ([rows, cols] for a matrix)
    qtype: QType
    offset: int  # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    """Little-endian reads from a byte buffer, with a clear error when it runs out."""

    def __init__(self, buf: memoryview, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise TracelmError(f"{self.name}: truncated or corrupt GGUF file (metadata at byte {self.pos} "
                               f"runs {self.pos + n - len(self.buf)} bytes past the end of the file)")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self._need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        self._need(n)
        s = str(self.buf[self.pos : self.pos + n], "utf-8", "replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary of 10^5 or more), as `string` reads them but in one loop."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = _U64.unpack_from(buf, pos)
            if pos + 8 + n > end:
                break
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        if len(out) < count:  # ran out: `string` says where
            self.string()
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("I"), self.take("Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                self._need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dt, count, self.pos)
                self.pos += count * dt.itemsize
                arr = arr.copy()  # stays numpy: 4 bytes a score, not a 32-byte Python float in a list
                arr.flags.writeable = False
                return arr
            if etype == 8:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise TracelmError(f"{self.name}: corrupt GGUF file (unknown metadata value type {vtype} at byte {self.pos})")


class GGUFFile:
    """An opened GGUF file: its metadata (numeric arrays as read-only numpy arrays, the rest plain Python) plus
    memory-mapped tensors by name.

    The header is parsed here rather than by gguf.GGUFReader, which takes ~2 s on a 49k-token vocabulary
    (one numpy memmap view per string); tensor types and block sizes come from the gguf package.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.name = name = os.path.basename(self.path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise TracelmError(f"{self.path}: cannot open model file: {e.strerror}") from None
        buf = memoryview(self._map) if self._map is not None else memoryview(b"")
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise TracelmError(f"{name}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
        cur = _Cursor(buf, name)
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise TracelmError(f"{name}: unsupported GGUF version {version} (tracelm reads 2 and 3, little-endian)")
        n_tensors, n_kv = cur.take("Q"), cur.take("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            tname = cur.string()
            dims = [cur.take("Q") for _ in range(cur.take("I"))]
            infos.append((tname, dims, cur.take("I"), cur.take("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, 0, cur.pos)  # the header is read: let its pages go
        self.tensors: dict[str, TensorInfo] = {}
        for tname, dims, tcode, offset in infos:
            try:
                qtype = QType(tcode)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise TracelmError(f"{name}: tensor {tname} has unknown type {tcode}") from None
            n = int(np.prod(dims))
            if n % block:
                raise TracelmError(f"{name}: tensor {tname}: {n} values is not a whole number of "
                                   f"{qtype.name} blocks of {block}")
            info = TensorInfo(tname, tuple(reversed(dims)), qtype, data_start + offset, n // block * type_size)
            if info.offset + info.n_bytes > size:
                raise TracelmError(f"{name}: truncated GGUF file: tensor {tname} ends at byte "
                                   f"{info.offset + info.n_bytes}, file has {size}")
            self.tensors[tname] = info
        self._buf = buf

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise TracelmError(f"{self.name}: missing tensor {name}")
        return t

    def raw(self, name: str) -> np.ndarray:
        """The bytes of one tensor, memory-mapped (no copy)."""
        t = self.tensors[name]
        return np.frombuffer(self._buf, np.uint8, t.n_bytes, t.offset)

    def raw_rows(self, name: str) -> np.ndarray:
        """The bytes of a tensor as [rows, bytes per row], memory-mapped: GGUF quantizes each row on its own
        (a row is whole blocks), so rows lo..hi are a byte range and can be dequantized alone."""
        t = self.info(name)
        rows = t.shape[0] if len(t.shape) > 1 else 1
        block = GGML_QUANT_SIZES[t.qtype][0]
        if t.shape[-1] % block:
            raise TracelmError(f"{self.name}: tensor {name}: rows of {t.shape[-1]} values are not whole "
                               f"{t.qtype.name} blocks of {block}; its rows cannot be read apart")
        return self.raw(name).reshape(rows, t.n_bytes // rows)

    def release_pages(self) -> None:
        """Unmap the file's pages from this process's resident memory (they stay in the page cache and fault
        back in if read again): after resident weights are copied out, the map's reads of small tensors would
        otherwise keep tens of MB resident, as the kernel maps the cached pages around each one it touches."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        t = self.info(name)
        return bytes_into(self.path, t.offset, t.n_bytes, out, f"{self.name}: tensor {name}")

    def rows_f32(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows lo..hi-1 of a tensor in f32 ([hi - lo, cols]; a vector is one row), dequantized about
        CHUNK_VALUES at a time into `out` (new when None). The same numbers as `tensor_f32(name)[lo:hi]`."""
        t = self.info(name)
        raw, cols = self.raw_rows(name), t.shape[-1]
        if out is None:
            out = np.empty((hi - lo, cols), np.float32)
        step = max(1, CHUNK_VALUES // cols)
        try:
            for r in range(lo, hi, step):
                end = min(r + step, hi)
                dequantize(raw[r:end], t.qtype, (end - r, cols), out[r - lo : end - lo])
        except TracelmError as e:
            raise TracelmError(f"{self.name}: tensor {name}: {e}") from None
        return out

    def take_f32(self, name: str, ids: np.ndarray) -> np.ndarray:
        """The rows `ids` of a matrix in f32, a new [len(ids), cols] array (an embedding lookup that reads
        only those rows from the file)."""
        t = self.info(name)
        raw = self.raw_rows(name)[np.asarray(ids, np.int64)]
        return dequantize(raw, t.qtype, (len(raw), t.shape[-1]))

    def tensor_f32(self, name: str) -> np.ndarray:
        """Dequantize one tensor to f32 in numpy order ([rows, cols] = GGUF [ne1, ne0])."""
        t = self.info(name)
        try:
            return dequantize(self.raw(name), t.qtype, t.shape)
        except TracelmError as e:
            raise TracelmError(f"{self.name}: tensor {name}: {e}") from None


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


# Types whose gguf.quants dequantization is rewritten here with fewer temporaries (1.4-1.9x faster), with
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


def _get(meta: Mapping[str, Any], key: str, file: str, default: Any = None) -> Any:
    if key in meta:
        return meta[key]
    if default is None:
        raise TracelmError(f"{file}: missing metadata field {key}")
    return default


def model_config(gf: GGUFFile) -> ModelConfig:
    meta, name = gf.metadata, gf.name
    arch = meta.get("general.architecture")
    if arch is None:
        raise TracelmError(f"{name}: missing metadata field general.architecture")
    if arch not in ARCH_OPTIONS:
        raise TracelmError(f"{name}: unknown architecture {arch!r} (supported: {', '.join(ARCH_OPTIONS)})")
    if "token_embd.weight" not in gf.tensors:
        raise TracelmError(f"{name}: missing tensor token_embd.weight (a vocabulary-only GGUF has no model)")
    a = lambda key, default=None: _get(meta, f"{arch}.{key}", name, default)  # noqa: E731
    n_embd = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    n_vocab = int(gf.tensors["token_embd.weight"].shape[0])
    opts = dict(ARCH_OPTIONS[arch])
    if arch == "gemma3":
        opts["embd_scale"] = float(np.float32(np.sqrt(np.float32(n_embd))))
    for key, field, conv in (("attention.sliding_window", "sliding_window", int),
                             ("attention.sliding_window_pattern", "swa_pattern", int),
                             ("rope.freq_base_swa", "rope_base_swa", float),
                             ("attention.scale", "attn_scale", float)):
        if f"{arch}.{key}" in meta:
            opts[field] = conv(meta[f"{arch}.{key}"])
    if "rope_freqs.weight" in gf.tensors:
        opts["rope_freq_factors"] = tuple(float(f) for f in gf.tensor_f32("rope_freqs.weight").ravel())
    try:
        return ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=int(a("block_count")),
            n_head=n_head,
            n_head_kv=int(a("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(a("feed_forward_length")),
            rope_base=float(a("rope.freq_base", 10000.0)),
            rope_dim=int(a("rope.dimension_count", head_dim)),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(a("context_length")),
            tied_head="output.weight" not in gf.tensors,
            **opts,
        )
    except ValueError as e:
        raise TracelmError(f"{name}: {e}") from None


GROUP_VALUES = 4096  # values per row handed to gguf.quants (it dequantizes 16 rows per call)

# Rows dequantized per call when a matrix is made a block of rows at a time: about 1 MB of f32 keeps the
# dequantizer's temporaries small and in cache (Q6_K / Q8_0 run ~1.4x faster than in one whole-tensor call).
CHUNK_VALUES = 1 << 18

# The fields of LayerWeights, each with the tensors whose rows it stacks and its f32 shape.
LayerPlan = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]


def layer_plan(gf: Any, cfg: ModelConfig, i: int) -> LayerPlan:
    """Where block i's LayerWeights come from (a GGUFFile, or an HFFolder under GGUF names), checked against
    the header (no tensor data is read):
    field -> (tensors stacked row after row, shape). q/k/v fuse into wqkv and gate/up into w_gate_up."""
    p, d, hd = f"blk.{i}.", cfg.n_embd, cfg.head_dim
    # phi3 stores q/k/v fused (attn_qkv) and gate/up fused (ffn_up of 2 n_ff rows)
    fused_qkv = p + "attn_qkv.weight" in gf.tensors
    qkv = [p + "attn_qkv"] if fused_qkv else [p + "attn_q", p + "attn_k", p + "attn_v"]
    gate_up = [p + "ffn_gate", p + "ffn_up"] if p + "ffn_gate.weight" in gf.tensors else [p + "ffn_up"]
    n_qkv = cfg.q_dim + 2 * cfg.kv_dim
    plan: LayerPlan = {
        "attn_norm": ((p + "attn_norm.weight",), (d,)),
        "wqkv": (tuple(n + ".weight" for n in qkv), (n_qkv, d)),
        "wo": ((p + "attn_output.weight",), (d, cfg.q_dim)),
        "ffn_norm": ((p + "ffn_norm.weight",), (d,)),
        "w_gate_up": (tuple(n + ".weight" for n in gate_up), (2 * cfg.n_ff, d)),
        "w_down": ((p + "ffn_down.weight",), (d, cfg.n_ff)),
    }
    if cfg.qkv_bias:
        plan["bqkv"] = (tuple(n + ".bias" for n in qkv), (n_qkv,))
    if cfg.qk_norm:
        plan["q_norm"] = ((p + "attn_q_norm.weight",), (hd,))
        plan["k_norm"] = ((p + "attn_k_norm.weight",), (hd,))
    if cfg.post_norms:
        plan["post_attn_norm"] = ((p + "post_attention_norm.weight",), (d,))
        plan["post_ffn_norm"] = ((p + "post_ffw_norm.weight",), (d,))
    for names, shape in plan.values():
        parts = [_info(gf, n) for n in names]
        if len(parts) == 1 and parts[0].shape != shape:
            raise TracelmError(f"{gf.name}: tensor {names[0]} has shape {list(parts[0].shape)}, "
                               f"expected {list(shape)}")
        for t in parts:
            if t.shape[1:] != shape[1:]:
                want = f"[rows, {shape[1]}]" if len(shape) > 1 else "a vector"
                raise TracelmError(f"{gf.name}: tensor {t.name} has shape {list(t.shape)}, expected {want}")
        if sum(t.shape[0] for t in parts) != shape[0]:
            raise TracelmError(f"{gf.name}: block {i} projections do not match the metadata ("
                               + ", ".join(f"{t.name} {list(t.shape)}" for t in parts)
                               + f": {sum(t.shape[0] for t in parts)} rows, expected {shape[0]})")
    return plan


def _info(gf: Any, name: str) -> Any:
    """A tensor's header entry (shape in numpy order, name) from a GGUFFile or an HFFolder."""
    t = gf.tensors.get(name)
    if t is None:
        raise TracelmError(f"{gf.name}: missing tensor {name}")
    return t


def _stack(gf: Any, names: tuple[str, ...], shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Tensors laid end to end (matrices row after row, vectors one after another) in one f32 array of
    `shape`: `out`, or new when None. From a GGUF a block of rows at a time (`rows_f32`)."""
    if out is None:
        out = np.empty(shape, np.float32)
    flat, pos = out.reshape(-1), 0
    for n in names:
        t = _info(gf, n)
        k = int(np.prod(t.shape))
        part = flat[pos : pos + k].reshape(-1, t.shape[-1])
        if isinstance(gf, GGUFFile):
            gf.rows_f32(n, 0, part.shape[0], part)
        else:
            part[...] = gf.tensor_f32(n).reshape(part.shape)
        pos += k
    return out


def aligned_bytes(n: int, align: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array of n bytes starting on an `align`-byte boundary (numpy gives 16)."""
    raw = np.empty(n + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + n]


def aligned_f32(n: int, align: int = 4096) -> np.ndarray:
    """An uninitialised f32 array of n values starting on an `align`-byte boundary."""
    return aligned_bytes(4 * n, align).view(np.float32)


def plan_values(plan: LayerPlan) -> int:
    """f32 values of one block's weights (the scratch a streamed layer needs), laid out by `packed`."""
    return packed_values([shape for _names, shape in plan.values()])


def packed_values(shapes: list[tuple[int, ...]]) -> int:
    """f32 values of arrays of these shapes laid end to end, each padded to 16 values (64 bytes)."""
    return sum(-(-int(np.prod(shape)) // 16) * 16 for shape in shapes)


def packed(out: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Views of the flat f32 `out` with these shapes, one after another, each starting 64-byte aligned (a block's
    fields in graph order: a decode step walks its weights front to back)."""
    views, pos = {}, 0
    for field, shape in shapes.items():
        views[field] = out[pos : pos + int(np.prod(shape))].reshape(shape)
        pos += packed_values([shape])
    return views


def layer_weights(gf: Any, plan: LayerPlan, out: np.ndarray) -> LayerWeights:
    """Block weights in f32 as `plan` lays them out, every field written into a view of `out` (flat f32 of at
    least `plan_values(plan)`): the block's slice of the resident arena, or the streamed mode's scratch
    buffer (overwritten by the next call)."""
    views = packed(out, {field: shape for field, (_names, shape) in plan.items()})
    return LayerWeights(**{field: _stack(gf, names, shape, views[field]) for field, (names, shape) in plan.items()})


def load_weights(gf: GGUFFile, cfg: ModelConfig, progress: bool = True) -> ModelWeights:
    """Dequantize every tensor into resident f32 arrays, fusing q/k/v and gate/up per block."""
    from tqdm import tqdm

    total = sum(t.n_bytes for t in gf.tensors.values())
    # a bar only on a terminal: captured stderr gets nothing but real messages
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False,
              disable=None if progress else True) as bar:
        return _load_all(gf, cfg, bar)


def _load_all(gf: GGUFFile, cfg: ModelConfig, bar: Any) -> ModelWeights:
    d = cfg.n_embd

    def done(*names: str) -> None:
        bar.update(sum(gf.tensors[n].n_bytes for n in names if n in gf.tensors))

    embd = _checked(gf, "token_embd.weight", (cfg.n_vocab, d))
    done("token_embd.weight")
    # every block in one arena, in graph order: one allocation large enough for huge pages (numpy advises
    # them from 4 MiB), so a decode step's walk through the weights takes few TLB misses (~9 % faster decode
    # on SmolLM2 than a separate array per matrix, where the small ones get ordinary pages)
    plans = [layer_plan(gf, cfg, i) for i in range(cfg.n_layer)]
    ends = np.cumsum([0, *(plan_values(p) for p in plans)]).tolist()
    arena, layers = aligned_f32(ends[-1]), []
    for plan, a, b in zip(plans, ends, ends[1:], strict=False):
        layers.append(layer_weights(gf, plan, arena[a:b]))
        done(*(n for names, _shape in plan.values() for n in names))
    output_norm = _checked(gf, "output_norm.weight", (d,))
    output = embd if cfg.tied_head else _checked(gf, "output.weight", (cfg.n_vocab, d))
    done("output_norm.weight", "output.weight")
    return ModelWeights(token_embd=embd, layers=tuple(layers), output_norm=output_norm, output=output)


def kernel_weights(gf: Any, cfg: ModelConfig, streamed: bool = False, progress: bool = True) -> ModelWeights:
    """The matrices of a GGUFFile (or an HFFolder's F32/F16/BF16 tensors) as QMatrix -- their own blocks, for
    the compiled kernels (`compute: kernels`) -- and the vectors in f32. Resident: every matrix copied once
    into one arena in graph order (huge pages, the file's size); streamed: views of the mapped file, paged in
    as the graph reads them. A type the kernels lack (Q2_K, Q3_K, the IQ types...) is dequantized to f32."""
    d = cfg.n_embd
    plans = [layer_plan(gf, cfg, i) for i in range(cfg.n_layer)]
    # the vectors first, read through the map, whose pages go before the matrices fill the arena
    vectors = [{f: _stack(gf, names, shape) for f, (names, shape) in plan.items() if len(shape) == 1} for plan in plans]
    output_norm = np.array(_checked(gf, "output_norm.weight", (d,)))
    heads = ["token_embd.weight"] + ([] if cfg.tied_head else ["output.weight"])
    names = [n for plan in plans for names, shape in plan.values() if len(shape) == 2 for n in names] + heads
    parts = _kernel_parts(gf, names, streamed, progress)

    def matrix(names: tuple[str, ...], shape: tuple[int, ...]) -> QMatrix:
        return QMatrix(shape, tuple(parts[n] for n in names))

    layers = tuple(LayerWeights(**vec, **{f: matrix(n, shape) for f, (n, shape) in plan.items() if len(shape) == 2})
                   for plan, vec in zip(plans, vectors, strict=True))
    embd = matrix(("token_embd.weight",), (cfg.n_vocab, d))
    output = embd if cfg.tied_head else matrix(("output.weight",), (cfg.n_vocab, d))
    return ModelWeights(token_embd=embd, layers=layers, output_norm=output_norm, output=output)


def _kernel_parts(gf: Any, names: list[str], streamed: bool, progress: bool) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (blocks, qtype) of each matrix: views of the map (streamed), or copied by file reads into one arena
    in the order given, each 64-byte aligned (resident; the map's pages let go before and after)."""
    from tqdm import tqdm

    resident_gguf = not streamed and isinstance(gf, GGUFFile)
    if resident_gguf:
        gf.release_pages()
    arena = None if streamed else aligned_bytes(sum(-(-_kernel_bytes(gf, n) // 64) * 64 for n in names))
    pos, parts = 0, {}
    with tqdm(total=len(names), desc="loading weights", leave=False, disable=None if progress else True) as bar:
        for n in names:
            t, size = _info(gf, n), _kernel_bytes(gf, n)
            if t.qtype not in kernels.SUPPORTED:
                blocks, qtype = gf.tensor_f32(n).view(np.uint8).reshape(t.shape[0], -1), QType.F32
                if arena is not None:
                    blocks = _copied(blocks, arena[pos : pos + size])
            elif arena is None:
                blocks, qtype = gf.raw_rows(n), t.qtype
            else:
                blocks, qtype = gf.read_into(n, arena[pos : pos + size]).reshape(t.shape[0], -1), t.qtype
            parts[n] = (blocks, qtype)
            pos += -(-size // 64) * 64
            bar.update()
    if resident_gguf:
        gf.release_pages()
    return parts


def bytes_into(path: str | os.PathLike, offset: int, n: int, out: np.ndarray, what: str) -> np.ndarray:
    """n bytes of a file from `offset` copied into `out` (uint8, at least n) by file reads, not through a map: the
    page cache then holds the file, not this process's resident memory."""
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out[:n]))
    if got != n:
        raise TracelmError(f"{what}: read {got} of {n} bytes")
    return out


def _kernel_bytes(gf: Any, name: str) -> int:
    """Bytes a matrix takes for the kernels: its blocks, or f32 rows for a type they lack."""
    t = _info(gf, name)
    return t.n_bytes if t.qtype in kernels.SUPPORTED else 4 * int(np.prod(t.shape))


def _copied(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    flat = out.reshape(-1)
    flat[...] = a.reshape(-1)
    return flat.reshape(a.shape)


def _checked(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    a = gf.tensor_f32(name)
    if a.shape != shape:
        raise TracelmError(f"{gf.name}: tensor {name} has shape {list(a.shape)}, "
                           f"expected {list(shape)}")
    return a
