"""GGUF: metadata -> ModelConfig, memory-mapped tensors, dequantization to f32 (via gguf.quants)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tracelm import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights

GGUF_MAGIC = b"GGUF"

# Architectures the graph builds, with the options their GGUF files imply.
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {"rope_mode": "adjacent", "qkv_bias": False},
}


class GGUFFile:
    """An opened GGUF file: plain-Python metadata plus memory-mapped tensors by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        name = os.path.basename(self.path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise TracelmError(f"{self.path}: cannot open model file: {e.strerror}") from None
        if magic != GGUF_MAGIC:
            raise TracelmError(f"{name}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises ValueError/IndexError/... on a damaged file
            raise TracelmError(f"{name}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
        self.metadata = {k: _field_value(f) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            end = t.data_offset + t.n_bytes
            if end > size:
                raise TracelmError(
                    f"{name}: truncated GGUF file: tensor {t.name} ends at byte {end}, file has {size}"
                )

    def tensor_f32(self, name: str) -> np.ndarray:
        """Dequantize one tensor to f32 in numpy order ([rows, cols] = GGUF [ne1, ne0])."""
        t = self.tensors.get(name)
        if t is None:
            raise TracelmError(f"{os.path.basename(self.path)}: missing tensor {name}")
        shape = tuple(int(n) for n in reversed(t.shape))
        try:
            return dequantize(t.data, t.tensor_type, shape)
        except TracelmError as e:
            raise TracelmError(f"{os.path.basename(self.path)}: tensor {name}: {e}") from None


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value


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
    meta, name = gf.metadata, os.path.basename(gf.path)
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
    n_vocab = int(gf.tensors["token_embd.weight"].shape[1])
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
            **ARCH_OPTIONS[arch],
        )
    except ValueError as e:
        raise TracelmError(f"{name}: {e}") from None


def _stack_rows(gf: GGUFFile, names: list[str], cols: int) -> np.ndarray:
    """Dequantize tensors [rows_i, cols] into one preallocated [sum(rows_i), cols] matrix."""
    parts = [gf.tensors.get(n) for n in names]
    for n, t in zip(names, parts, strict=True):
        if t is None:
            raise TracelmError(f"{os.path.basename(gf.path)}: missing tensor {n}")
    rows = [int(t.shape[1]) if len(t.shape) > 1 else 1 for t in parts]
    out = np.empty((sum(rows), cols), np.float32)
    r = 0
    for n, k in zip(names, rows, strict=True):
        block = gf.tensor_f32(n)
        if block.size != k * cols:
            raise TracelmError(f"{os.path.basename(gf.path)}: tensor {n} has shape {list(block.shape)}, "
                               f"expected {k} x {cols}")
        out[r : r + k] = block.reshape(k, cols)
        r += k
    return out


def _checked(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    a = gf.tensor_f32(name)
    if a.shape != shape:
        raise TracelmError(f"{os.path.basename(gf.path)}: tensor {name} has shape {list(a.shape)}, "
                           f"expected {list(shape)}")
    return a


def load_weights(gf: GGUFFile, cfg: ModelConfig, progress: bool = True) -> ModelWeights:
    """Dequantize every tensor into resident f32 arrays, fusing q/k/v and gate/up per block."""
    from tqdm import tqdm

    d = cfg.n_embd
    total = sum(int(t.n_bytes) for t in gf.reader.tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress,
               leave=False)

    def done(*names: str) -> None:
        bar.update(sum(int(gf.tensors[n].n_bytes) for n in names if n in gf.tensors))

    embd = _checked(gf, "token_embd.weight", (cfg.n_vocab, d))
    done("token_embd.weight")
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        gate_up = [p + "ffn_gate.weight", p + "ffn_up.weight"]
        bias = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"] if cfg.qkv_bias else []
        lw = LayerWeights(
            attn_norm=_checked(gf, p + "attn_norm.weight", (d,)),
            wqkv=_stack_rows(gf, qkv, d),
            wo=_checked(gf, p + "attn_output.weight", (d, cfg.q_dim)),
            ffn_norm=_checked(gf, p + "ffn_norm.weight", (d,)),
            w_gate_up=_stack_rows(gf, gate_up, d),
            w_down=_checked(gf, p + "ffn_down.weight", (d, cfg.n_ff)),
            bqkv=np.concatenate([gf.tensor_f32(b) for b in bias]) if bias else None,
        )
        if lw.wqkv.shape[0] != cfg.q_dim + 2 * cfg.kv_dim or lw.w_gate_up.shape[0] != 2 * cfg.n_ff:
            raise TracelmError(f"{os.path.basename(gf.path)}: block {i} projections do not match the metadata "
                               f"(qkv rows {lw.wqkv.shape[0]}, gate/up rows {lw.w_gate_up.shape[0]})")
        layers.append(lw)
        done(p + "attn_norm.weight", *qkv, p + "attn_output.weight", p + "ffn_norm.weight", *gate_up,
             p + "ffn_down.weight", *bias)
    output_norm = _checked(gf, "output_norm.weight", (d,))
    output = embd if cfg.tied_head else _checked(gf, "output.weight", (cfg.n_vocab, d))
    done("output_norm.weight", "output.weight")
    bar.close()
    return ModelWeights(token_embd=embd, layers=tuple(layers), output_norm=output_norm, output=output)
