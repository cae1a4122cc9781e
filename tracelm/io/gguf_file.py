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

from tracelm import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights

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
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

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
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise TracelmError(f"{self.name}: corrupt GGUF file (unknown metadata value type {vtype} at byte {self.pos})")


class GGUFFile:
    """An opened GGUF file: plain-Python metadata plus memory-mapped tensors by name.

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

    def raw(self, name: str) -> np.ndarray:
        """The bytes of one tensor, memory-mapped (no copy)."""
        t = self.tensors[name]
        return np.frombuffer(self._buf, np.uint8, t.n_bytes, t.offset)

    def tensor_f32(self, name: str) -> np.ndarray:
        """Dequantize one tensor to f32 in numpy order ([rows, cols] = GGUF [ne1, ne0])."""
        t = self.tensors.get(name)
        if t is None:
            raise TracelmError(f"{self.name}: missing tensor {name}")
        try:
            return dequantize(self.raw(name), t.qtype, t.shape)
        except TracelmError as e:
            raise TracelmError(f"{self.name}: tensor {name}: {e}") from None


def dequantize(raw: np.ndarray, qtype: QType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor bytes (or f32/f16 values) -> contiguous f32 array of `shape`."""
    try:
        qtype = QType(qtype)
    except ValueError:
        raise TracelmError(f"unknown tensor type {qtype}") from None
    if qtype == QType.BF16:  # bf16 is the top half of an f32
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        out = bits.view(np.float32)
    else:
        try:
            out = quants.dequantize(np.asarray(raw), qtype)
        except NotImplementedError:
            raise TracelmError(f"unsupported tensor type {qtype.name}") from None
    n = int(np.prod(shape))
    if out.size != n:
        raise TracelmError(f"{qtype.name} data holds {out.size} values, shape {list(shape)} needs {n}")
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


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


def _stack_rows(gf: GGUFFile, names: list[str], cols: int) -> np.ndarray:
    """Dequantize tensors [rows_i, cols] into one preallocated [sum(rows_i), cols] matrix."""
    parts = [gf.tensors.get(n) for n in names]
    for n, t in zip(names, parts, strict=True):
        if t is None:
            raise TracelmError(f"{gf.name}: missing tensor {n}")
    rows = [t.shape[0] if len(t.shape) > 1 else 1 for t in parts]
    out = np.empty((sum(rows), cols), np.float32)
    r = 0
    for n, k in zip(names, rows, strict=True):
        block = gf.tensor_f32(n)
        if block.size != k * cols:
            raise TracelmError(f"{gf.name}: tensor {n} has shape {list(block.shape)}, "
                               f"expected {k} x {cols}")
        out[r : r + k] = block.reshape(k, cols)
        r += k
    return out


def _checked(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    a = gf.tensor_f32(name)
    if a.shape != shape:
        raise TracelmError(f"{gf.name}: tensor {name} has shape {list(a.shape)}, "
                           f"expected {list(shape)}")
    return a


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
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        # phi3 stores q/k/v fused (attn_qkv) and gate/up fused (ffn_up of 2 n_ff rows)
        fused_qkv = p + "attn_qkv.weight" in gf.tensors
        qkv = [p + "attn_qkv.weight"] if fused_qkv else [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        gate_up = [p + "ffn_gate.weight", p + "ffn_up.weight"] if p + "ffn_gate.weight" in gf.tensors else [
            p + "ffn_up.weight"]
        bias = []
        if cfg.qkv_bias:
            bias = [p + "attn_qkv.bias"] if fused_qkv else [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        hd = cfg.head_dim
        norms = [p + "attn_q_norm.weight", p + "attn_k_norm.weight"] if cfg.qk_norm else []
        if cfg.post_norms:
            norms += [p + "post_attention_norm.weight", p + "post_ffw_norm.weight"]
        lw = LayerWeights(
            attn_norm=_checked(gf, p + "attn_norm.weight", (d,)),
            wqkv=_stack_rows(gf, qkv, d),
            wo=_checked(gf, p + "attn_output.weight", (d, cfg.q_dim)),
            ffn_norm=_checked(gf, p + "ffn_norm.weight", (d,)),
            w_gate_up=_stack_rows(gf, gate_up, d),
            w_down=_checked(gf, p + "ffn_down.weight", (d, cfg.n_ff)),
            bqkv=np.concatenate([gf.tensor_f32(b).ravel() for b in bias]) if bias else None,
            q_norm=_checked(gf, p + "attn_q_norm.weight", (hd,)) if cfg.qk_norm else None,
            k_norm=_checked(gf, p + "attn_k_norm.weight", (hd,)) if cfg.qk_norm else None,
            post_attn_norm=_checked(gf, p + "post_attention_norm.weight", (d,)) if cfg.post_norms else None,
            post_ffn_norm=_checked(gf, p + "post_ffw_norm.weight", (d,)) if cfg.post_norms else None,
        )
        if lw.wqkv.shape[0] != cfg.q_dim + 2 * cfg.kv_dim or lw.w_gate_up.shape[0] != 2 * cfg.n_ff:
            raise TracelmError(f"{gf.name}: block {i} projections do not match the metadata "
                               f"(qkv rows {lw.wqkv.shape[0]}, gate/up rows {lw.w_gate_up.shape[0]})")
        layers.append(lw)
        done(p + "attn_norm.weight", *qkv, p + "attn_output.weight", p + "ffn_norm.weight", *gate_up,
             p + "ffn_down.weight", *bias, *norms)
    output_norm = _checked(gf, "output_norm.weight", (d,))
    output = embd if cfg.tied_head else _checked(gf, "output.weight", (cfg.n_vocab, d))
    done("output_norm.weight", "output.weight")
    return ModelWeights(token_embd=embd, layers=tuple(layers), output_norm=output_norm, output=output)
