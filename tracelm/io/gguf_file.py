"""GGUF files: the header (metadata and tensor table) read, the metadata turned into a ModelConfig, tensors
memory-mapped by name and dequantized to f32 on request (tracelm.io.dequant)."""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tracelm.io import checks
from tracelm.io.dequant import CHUNK_VALUES, dequantize
from tracelm.io.families import BY_ARCH
from tracelm.state.errors import ModelFormatError, TracelmError
from tracelm.state.model_config import ModelConfig

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (8 string, 9 array are handled apart).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")
# the fewest bytes a value of each type takes (a string: its length; an array: its type and count)
_MIN_SIZE = {**{t: struct.calcsize("<" + f) for t, f in _SCALAR.items()}, 8: 8, 9: 12}
_MIN_KV = 8 + 4 + 1  # a key's length, its value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # a name's length, n_dims, type, offset
MAX_ARRAY_DEPTH = 8  # arrays of arrays: GGUF files nest none; a deep nest is corrupt (and would exhaust the stack)
MAX_DIMS = 4  # GGML_MAX_DIMS
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

    def peek(self, fmt: str) -> Any:
        """The value `take` would read next, without moving on."""
        pos = self.pos
        value = self.take(fmt)
        self.pos = pos
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

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("I"), self.take("Q")
            self._fits(count, _MIN_SIZE.get(etype, 1), "array")
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
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelFormatError(f"{self.name}: corrupt GGUF file (arrays nested more than {MAX_ARRAY_DEPTH} "
                                       f"deep at byte {self.pos})")
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise ModelFormatError(f"{self.name}: corrupt GGUF file (unknown metadata value type {vtype} at byte "
                               f"{self.pos})")

    def _fits(self, count: int, min_size: int, what: str) -> None:
        """A count read from the file: its items, at least `min_size` bytes each, must fit in the bytes left."""
        left = len(self.buf) - self.pos
        if count * min_size > left:
            raise ModelFormatError(f"{self.name}: truncated or corrupt GGUF file ({what} of {count} items at byte "
                                   f"{self.pos} needs at least {count * min_size} bytes, {left} are left)")


class GGUFFile:
    """An opened GGUF file: its metadata (numeric arrays as read-only numpy arrays, the rest plain Python) plus
    memory-mapped tensors by name.

    The header is parsed here rather than by gguf.GGUFReader, which is slow on a large vocabulary (it makes
    one numpy memmap view per string); tensor types and block sizes come from the gguf package.
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
        cur._fits(n_kv, _MIN_KV, "metadata")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[int, ...]] = {}  # key -> its GGUF value type (an array: and its items')
        for _ in range(n_kv):
            key = cur.string()
            if key in self.metadata:
                raise ModelFormatError(f"{name}: metadata key {key} appears twice")
            vtype = cur.take("I")
            self.value_types[key] = (vtype, cur.peek("I")) if vtype == 9 else (vtype,)
            self.metadata[key] = cur.value(vtype)
        cur._fits(n_tensors, _MIN_TENSOR_INFO, "tensor table")
        infos = [_tensor_info(cur) for _ in range(n_tensors)]
        align = checks.power_of_two(self.metadata.get("general.alignment", 32), f"{name}: general.alignment", 8)
        data_start = -(-cur.pos // align) * align
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, 0, cur.pos)  # the header is read: let its pages go
        self.tensors: dict[str, TensorInfo] = {}
        for tname, dims, tcode, offset in infos:
            if tname in self.tensors:
                raise ModelFormatError(f"{name}: tensor {tname} appears twice in the tensor table")
            self.tensors[tname] = _tensor(name, tname, dims, tcode, offset, align, data_start, size)
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


def _tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
    """One entry of the tensor table: name, dims (GGUF order), type code, offset from the data start."""
    tname = cur.string()
    n_dims = cur.take("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelFormatError(f"{cur.name}: tensor {tname} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = [cur.take("Q") for _ in range(n_dims)]
    return tname, dims, cur.take("I"), cur.take("Q")


def _tensor(file: str, tname: str, dims: list[int], tcode: int, offset: int, align: int, data_start: int,
            size: int) -> TensorInfo:
    """A tensor table entry checked: a known type, positive dims of whole blocks, its offset aligned, its bytes
    inside the file."""
    try:
        qtype = QType(tcode)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFormatError(f"{file}: tensor {tname} has unknown type {tcode}") from None
    if min(dims) < 1:
        raise ModelFormatError(f"{file}: tensor {tname} has shape {list(reversed(dims))}: dimensions must be positive")
    n = math.prod(dims)
    if n % block:
        raise ModelFormatError(f"{file}: tensor {tname}: {n} values is not a whole number of "
                               f"{qtype.name} blocks of {block}")
    if offset % align:
        raise ModelFormatError(f"{file}: tensor {tname}: offset {offset} is not a multiple of the alignment {align}")
    info = TensorInfo(tname, tuple(reversed(dims)), qtype, data_start + offset, n // block * type_size)
    if info.offset + info.n_bytes > size:
        raise ModelFormatError(f"{file}: truncated GGUF file: tensor {tname} ends at byte "
                               f"{info.offset + info.n_bytes}, file has {size}")
    return info


def _get(meta: Mapping[str, Any], key: str, file: str, default: Any = None) -> Any:
    if key in meta:
        return meta[key]
    if default is None:
        raise TracelmError(f"{file}: missing metadata field {key}")
    return default


# Optional metadata of an architecture -> (ModelConfig field, its check): values of the file override the family's
_OPTIONS = {
    "attention.sliding_window": ("sliding_window", lambda v, w: checks.integer(v, w, lo=0)),
    "attention.sliding_window_pattern": ("swa_pattern", lambda v, w: checks.integer(v, w, lo=0)),
    "rope.freq_base_swa": ("rope_base_swa", lambda v, w: checks.number(v, w, lo=0.0, lo_open=True)),
    "attention.scale": ("attn_scale", lambda v, w: checks.number(v, w, lo=0.0)),
}


def model_config(gf: GGUFFile) -> ModelConfig:
    """The ModelConfig the metadata describes, every field it reads checked by type and range first."""
    meta, name = gf.metadata, gf.name
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFormatError(f"{name}: missing metadata field general.architecture")
    checks.string(arch, f"{name}: general.architecture")
    if arch not in BY_ARCH:
        raise ModelFormatError(f"{name}: unknown architecture {arch!r} (supported: {', '.join(BY_ARCH)})")
    if "token_embd.weight" not in gf.tensors:
        raise ModelFormatError(f"{name}: missing tensor token_embd.weight (a vocabulary-only GGUF has no model)")

    def positive(key: str, default: int | None = None) -> int:
        return checks.integer(_get(meta, f"{arch}.{key}", name, default), f"{name}: {arch}.{key}", lo=1)

    def real(key: str, default: float) -> float:
        return checks.number(_get(meta, f"{arch}.{key}", name, default), f"{name}: {arch}.{key}", lo=0.0, lo_open=True)

    n_embd, n_head = positive("embedding_length"), positive("attention.head_count")
    if f"{arch}.attention.key_length" not in meta and n_embd % n_head:
        raise ModelFormatError(f"{name}: {arch}.embedding_length {n_embd} is not a multiple of "
                               f"{arch}.attention.head_count {n_head} (and no attention.key_length is given)")
    head_dim = checks.integer(positive("attention.key_length", n_embd // n_head),
                              f"{name}: {arch}.attention.key_length", hi=checks.MAX_HEAD_DIM)
    n_head_kv = positive("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelFormatError(f"{name}: {arch}.attention.head_count {n_head} is not a multiple of "
                               f"{arch}.attention.head_count_kv {n_head_kv}")
    embd = gf.tensors["token_embd.weight"]
    if len(embd.shape) != 2 or embd.shape[1] != n_embd:
        raise ModelFormatError(f"{name}: tensor token_embd.weight has shape {list(embd.shape)}, expected "
                               f"[vocabulary, {n_embd}]")
    opts = BY_ARCH[arch].gguf_options(n_embd)
    for key, (field, check) in _OPTIONS.items():
        if f"{arch}.{key}" in meta:
            opts[field] = check(meta[f"{arch}.{key}"], f"{name}: {arch}.{key}")
    if "rope_freqs.weight" in gf.tensors:
        factors = gf.tensor_f32("rope_freqs.weight").ravel()
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelFormatError(f"{name}: tensor rope_freqs.weight holds values that are not finite and positive")
        opts["rope_freq_factors"] = tuple(float(f) for f in factors)
    try:
        return ModelConfig(
            arch=arch,
            n_vocab=embd.shape[0],
            n_embd=n_embd,
            n_layer=positive("block_count"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=positive("feed_forward_length"),
            rope_base=real("rope.freq_base", 10000.0),
            rope_dim=positive("rope.dimension_count", head_dim),
            rms_eps=real("attention.layer_norm_rms_epsilon", 1e-5),
            n_ctx_train=positive("context_length"),
            tied_head="output.weight" not in gf.tensors,
            **opts,
        )
    except ValueError as e:
        raise ModelFormatError(f"{name}: {e}") from None


def bytes_into(path: str | os.PathLike, offset: int, n: int, out: np.ndarray, what: str) -> np.ndarray:
    """n bytes of a file from `offset` copied into `out` (uint8, at least n) by file reads, not through a map: the
    page cache then holds the file, not this process's resident memory."""
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out[:n]))
    if got != n:
        raise TracelmError(f"{what}: read {got} of {n} bytes")
    return out
