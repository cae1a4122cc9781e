"""Synthetic models: a registry model's family at a named size, with random weights -- `synth:NAME[@SEED][?layers=N]`.

A synthetic model has its family's tensor names and types (those of the registry file the family comes from), the
dimensions of the named size as its published config states them (`SIZES`), that file's tokenizer and metadata with
the dimensions replaced, and random quantized blocks whose scales give outputs of about unit size for unit inputs.
Speed does not depend on the values, so a 7B-shaped bench runs on any machine without a download.

The bytes depend on the name, the seed and the registry file alone: each tensor's own PCG64 stream (numpy keeps the
raw words of a bit generator stable) seeded by the seed and the tensor's name, drawn in chunks of fixed size, turned
into values by element-wise + - * / and IEEE rounding to f16 -- nothing depends on threads, platform or numpy's
distribution code. A file is written once, tensor by tensor (one tensor in memory at a time), through a temporary
file renamed into the registry's folder for them (`TRACELM_HOME/synth`), and read from there afterwards.

Types where the size differs from the registry file's: llama.cpp falls back from a K-quant to a 32-value type for
rows that are not whole 256-value super-blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; the output matrix in
Q8_0 rather than Q6_K): such a fall-back is undone where the new rows are whole super-blocks and made where they are
not. A role whose layers mix two types (Q4_K_M's attn_v and ffn_down) keeps the rule the file follows -- llama.cpp's
`use_more_bits` over the layers in their order, or in their names' order as some converters wrote them -- at the
new layer count; failing that, the mix is spread in proportion.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType
from gguf import GGMLQuantizationType as QType
from tqdm import tqdm

from tracelm.io.gguf_file import GGUFFile
from tracelm.state.errors import TracelmError

PREFIX = "synth:"
GENERATOR = 1  # the version of the bytes below: bump it when they change (a file name then says `.gN`)
QK_K = 256  # values in a K-quant super-block
_CHUNK_ROWS = 256  # rows drawn at a time (a constant: the stream's chunking is part of the bytes)


@attrs.frozen
class Shape:
    """A model's dimensions (the vocabulary stays the registry file's)."""

    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    sliding_window: int = 0  # 0: the registry file's


@attrs.frozen
class Size:
    base: str  # the registry model whose file gives the names, types, tokenizer and metadata
    shape: Shape
    config: str  # the published checkpoint whose config.json states the shape


def _sizes(base: str, rows: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Size]:
    return {name: Size(base, Shape(*dims), config) for name, (dims, config) in rows.items()}


# n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim[, sliding_window]: hidden_size, intermediate_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (or hidden / heads), sliding_window
SIZES: dict[str, Size] = {
    **_sizes("qwen2.5-coder-0.5b-instruct", {
        "qwen2.5-0.5b": ((896, 4864, 24, 14, 2, 64), "Qwen/Qwen2.5-0.5B"),
        "qwen2.5-1.5b": ((1536, 8960, 28, 12, 2, 128), "Qwen/Qwen2.5-1.5B"),
        "qwen2.5-3b": ((2048, 11008, 36, 16, 2, 128), "Qwen/Qwen2.5-3B"),
        "qwen2.5-7b": ((3584, 18944, 28, 28, 4, 128), "Qwen/Qwen2.5-7B"),
        "qwen2.5-14b": ((5120, 13824, 48, 40, 8, 128), "Qwen/Qwen2.5-14B"),
    }),
    **_sizes("smollm2-135m-instruct", {
        "smollm2-135m": ((576, 1536, 30, 9, 3, 64), "HuggingFaceTB/SmolLM2-135M"),
        "smollm2-360m": ((960, 2560, 32, 15, 5, 64), "HuggingFaceTB/SmolLM2-360M"),
        "smollm2-1.7b": ((2048, 8192, 24, 32, 32, 64), "HuggingFaceTB/SmolLM2-1.7B"),
    }),
    **_sizes("gemma3-270m", {
        "gemma3-270m": ((640, 2048, 18, 4, 1, 256, 512), "google/gemma-3-270m"),
        "gemma3-1b": ((1152, 6912, 26, 4, 1, 256, 512), "google/gemma-3-1b-pt"),
        "gemma3-4b": ((2560, 10240, 34, 8, 4, 256, 1024), "google/gemma-3-4b-pt (text_config)"),
    }),
}  # fmt: skip


# ---- names ----


@attrs.frozen
class SynthName:
    """A parsed `synth:NAME[@SEED][?layers=N]`."""

    name: str
    seed: int = 0
    layers: int | None = None  # fewer (or more) layers than the size has: small models for tests

    @property
    def size(self) -> Size:
        return SIZES[self.name]

    @property
    def shape(self) -> Shape:
        shape = self.size.shape
        return shape if self.layers is None else attrs.evolve(shape, n_layer=self.layers)

    @property
    def filename(self) -> str:
        layers = "" if self.layers is None else f"-layers{self.layers}"
        generator = "" if GENERATOR == 1 else f".g{GENERATOR}"  # a file of older bytes is not taken for these
        return f"{self.name}{layers}-{self.seed}{generator}.gguf"

    def __str__(self) -> str:
        layers = "" if self.layers is None else f"?layers={self.layers}"
        return f"{PREFIX}{self.name}@{self.seed}{layers}"


_NAME = re.compile(r"(?P<name>[^@?]*)(?:@(?P<seed>[^?]*))?(?:\?(?P<options>.*))?", re.S)


def known() -> str:
    return ", ".join(PREFIX + name for name in SIZES)


def parse(text: str) -> SynthName:
    """`synth:NAME[@SEED][?layers=N]` -> its parts, or a TracelmError naming what is wrong and the known names."""
    m = _NAME.fullmatch(text.removeprefix(PREFIX))
    name = m["name"]
    if name not in SIZES:
        raise TracelmError(f"unknown synthetic model '{text}': known are {known()} (then optionally @SEED and "
                           "?layers=N)")
    seed = 0
    if m["seed"] is not None:
        if not m["seed"].isdigit() or int(m["seed"]) >= 1 << 64:
            raise TracelmError(f"'{text}': the seed after @ must be an integer from 0 to 2^64-1, got {m['seed']!r}")
        seed = int(m["seed"])
    layers = None
    for option in m["options"].split("&") if m["options"] is not None else ():
        key, _, value = option.partition("=")
        if key != "layers" or not value.isdigit() or not 1 <= int(value) <= 1024:
            raise TracelmError(f"'{text}': unknown option {option!r} (the one option is layers=N, N from 1 to 1024)")
        layers = int(value)
    return SynthName(name, seed, layers)


def resolve(text: str, folder: Path, base: Callable[[str], tuple[Path, str]], download: bool = True) -> Path:
    """The file of a synthetic model in `folder`: written there on first use from its registry model's file
    (`base(name)`: its path, pulled if need be, and sha256), read from there afterwards."""
    sn = parse(text)
    path = folder / sn.filename
    if path.is_file():
        return path
    if not download:
        raise TracelmError(f"synthetic model '{sn}' is not written yet (its first use writes {path})")
    return write(sn, *base(sn.size.base), path)


def list_synth(folder: Path) -> list[tuple[str, bool, Path]]:
    """Every synthetic size at seed 0 as (name, written into `folder`?, path)."""
    paths = {PREFIX + name: folder / SynthName(name).filename for name in SIZES}
    return [(name, path.is_file(), path) for name, path in paths.items()]


# ---- the plan: tensor names, shapes and types ----


@attrs.frozen
class Planned:
    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols] for a matrix
    qtype: QType


_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}  # llama.cpp's, rows % 256 != 0
_UNDO = {v: k for k, v in _FALLBACK.items()}
_K_TYPES = frozenset({QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def tensor_shapes(s: Shape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a family's GGUF may hold (after `blk.N.` for a layer's), numpy order."""
    d, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    return {
        "token_embd.weight": (n_vocab, d), "output.weight": (n_vocab, d), "output_norm.weight": (d,),
        "attn_norm.weight": (d,), "ffn_norm.weight": (d,), "post_attention_norm.weight": (d,),
        "post_ffw_norm.weight": (d,), "attn_q_norm.weight": (s.head_dim,), "attn_k_norm.weight": (s.head_dim,),
        "attn_q.weight": (q, d), "attn_k.weight": (kv, d), "attn_v.weight": (kv, d), "attn_output.weight": (d, q),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
        "ffn_gate.weight": (s.n_ff, d), "ffn_up.weight": (s.n_ff, d), "ffn_down.weight": (d, s.n_ff),
    }  # fmt: skip


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of n layers and every third between get the larger type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _orders(n: int) -> tuple[list[int], ...]:
    """The layers in the orders a quantizer may have counted them: by number, and by name (blk.10 before blk.2)."""
    return list(range(n)), sorted(range(n), key=str)


def _bits(t: QType) -> float:
    block, size = GGML_QUANT_SIZES[t]
    return size / block


def layer_types(base: list[QType], n: int) -> list[QType]:
    """One role's types over n layers, from the registry file's over its own layers (see the module's text)."""
    if n == len(base) or len(set(base)) == 1:
        return [base[i % len(base)] for i in range(n)]
    if len(set(base)) == 2:
        small, large = sorted(set(base), key=_bits)
        for base_order, order in zip(_orders(len(base)), _orders(n), strict=True):
            if all((base[layer] == large) == _more_bits(rank, len(base)) for rank, layer in enumerate(base_order)):
                types = [small] * n
                for rank, layer in enumerate(order):
                    types[layer] = large if _more_bits(rank, n) else small
                return types
    return [base[i * len(base) // n] for i in range(n)]


def _fit(t: QType, base_cols: int, cols: int, undo: bool) -> QType:
    """The type a matrix of `cols`-value rows gets where the registry file's has `base_cols` and type t."""
    if base_cols % QK_K and undo and t in _UNDO:
        t = _UNDO[t]
    return _FALLBACK[t] if cols % QK_K and t in _FALLBACK else t


def plan(base: GGUFFile, shape: Shape) -> list[Planned]:
    """Every tensor of the synthetic model, in the registry file's order (its layers in layer order)."""
    shapes = tensor_shapes(shape, base.info("token_embd.weight").shape[0])
    k_mix = any(t.qtype in _K_TYPES for t in base.tensors.values())
    output = "output.weight" if "output.weight" in base.tensors else "token_embd.weight"
    roles: dict[str, dict[int, Any]] = {}
    for t in base.tensors.values():
        if m := _BLOCK.fullmatch(t.name):
            roles.setdefault(m[2], {})[int(m[1])] = t

    def planned(name: str, role: str, qtype: QType, base_shape: tuple[int, ...]) -> Planned:
        if role not in shapes:
            raise TracelmError(f"{base.name}: tensor {name}: no synthetic shape for a {role} tensor")
        new = shapes[role]
        undo = k_mix or (name == output and qtype == QType.Q8_0)  # llama.cpp: the output is Q6_K where it can be
        return Planned(name, new, _fit(qtype, base_shape[-1], new[-1], undo) if len(new) > 1 else qtype)

    out: list[Planned] = []
    for t in base.tensors.values():
        if not _BLOCK.fullmatch(t.name):
            out.append(planned(t.name, t.name, t.qtype, t.shape))
        elif roles:  # the layers, where the file's first layer tensor is
            out += _layers(base.name, roles, shape.n_layer, planned)
            roles = {}
    return out


def _layers(file: str, roles: dict[str, dict[int, Any]], n: int,
            planned: Callable[[str, str, QType, tuple[int, ...]], Planned]) -> list[Planned]:
    """Every layer's tensors, layer by layer, each in the order of the file's first layer."""
    n_base = 1 + max(max(layers) for layers in roles.values())
    types = {}
    for role, layers in roles.items():
        if sorted(layers) != list(range(n_base)):
            raise TracelmError(f"{file}: tensor {role} is not in every one of its {n_base} layers")
        types[role] = layer_types([layers[i].qtype for i in range(n_base)], n)
    return [planned(f"blk.{i}.{role}", role, types[role][i], layers[0].shape)
            for i in range(n) for role, layers in roles.items()]


# ---- metadata ----


def metadata(base: GGUFFile, sn: SynthName, base_sha256: str) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(key, value, GGUF value types) of the synthetic file: the registry file's, the dimensions replaced."""
    meta, arch, s = base.metadata, base.metadata["general.architecture"], sn.shape
    base_head = meta.get(f"{arch}.attention.key_length",
                         meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"])
    dims = {"embedding_length": s.n_embd, "feed_forward_length": s.n_ff, "block_count": s.n_layer,
            "attention.head_count": s.n_head, "attention.head_count_kv": s.n_head_kv}
    if f"{arch}.attention.key_length" in meta or s.n_embd != s.n_head * s.head_dim:
        dims |= {"attention.key_length": s.head_dim, "attention.value_length": s.head_dim}
    if f"{arch}.rope.dimension_count" in meta:
        dims["rope.dimension_count"] = meta[f"{arch}.rope.dimension_count"] * s.head_dim // base_head
    if s.sliding_window:
        dims["attention.sliding_window"] = s.sliding_window
    u32, string = (GGUFValueType.UINT32,), (GGUFValueType.STRING,)
    replaced = {f"{arch}.{k}": (v, u32) for k, v in dims.items()} | {"general.name": (str(sn), string)}
    out = [(k, *replaced.pop(k, (v, base.value_types[k]))) for k, v in meta.items()
           if k not in ("general.architecture", "general.size_label")]
    out += [(k, v, types) for k, (v, types) in replaced.items()]
    return out + [("tracelm.synth.name", str(sn), string), ("tracelm.synth.generator", GENERATOR, u32),
                  ("tracelm.synth.base", sn.size.base, string), ("tracelm.synth.base_sha256", base_sha256, string)]


def _add_kv(w: gguf.GGUFWriter, key: str, value: Any, types: tuple[int, ...]) -> None:
    vtype = GGUFValueType(types[0])
    if vtype != GGUFValueType.ARRAY:
        w.add_key_value(key, value, vtype)
    elif types[1] == GGUFValueType.ARRAY:
        raise TracelmError(f"synthetic model: metadata {key} is an array of arrays, which is not copied")
    else:
        w.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else list(value), vtype,
                        sub_type=GGUFValueType(types[1]))


# ---- values ----


@attrs.frozen
class _Layout:
    """A block type as the generator fills it: value = d * sub-scale * (code - centre)."""

    d_at: int  # byte offset of the f16 scale d
    codes: int  # how many codes a value takes (16: 4 bits, ...)
    centre: float
    m_at: int | None = None  # a second f16 field, set to m_factor * d: Q4_1/Q5_1's offset m, a K-quant's dmin
    m_factor: float = 0.0
    sub_scales: range = range(1, 2)  # the sub-block scales' values as drawn (K-quants), each equally likely
    k_mins: bool = False  # Q4_K/Q5_K: each sub-block's 6-bit min made equal to its scale (value = d sc (q - c))


_LAYOUTS = {
    QType.Q4_0: _Layout(0, 16, 8.0),
    QType.Q4_1: _Layout(0, 16, 7.5, m_at=2, m_factor=-7.5),
    QType.Q5_0: _Layout(0, 32, 16.0),
    QType.Q5_1: _Layout(0, 32, 15.5, m_at=2, m_factor=-15.5),
    QType.Q8_0: _Layout(0, 256, 128.0),  # int8 codes: byte - 128 in distribution
    QType.Q4_K: _Layout(0, 16, 7.5, m_at=2, m_factor=7.5, sub_scales=range(64), k_mins=True),
    QType.Q5_K: _Layout(0, 32, 15.5, m_at=2, m_factor=15.5, sub_scales=range(64), k_mins=True),
    QType.Q6_K: _Layout(208, 64, 32.0, sub_scales=range(-128, 128)),  # int8 sub-block scales
}
FLOAT_TYPES = (QType.F32, QType.F16)


def _rms(lay: _Layout) -> float:
    """The root mean square of d's multiplier over random codes and sub-scales."""
    codes = sum((k - lay.centre) ** 2 for k in range(lay.codes)) / lay.codes
    subs = sum(k * k for k in lay.sub_scales) / len(lay.sub_scales)
    return math.sqrt(codes * subs)


def _f16(x: np.ndarray) -> np.ndarray:
    """f64 values rounded to f16 (IEEE, to nearest even) as little-endian bytes, two per value."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _blocks(raw: np.ndarray, qtype: QType, d0: float) -> np.ndarray:
    """Random blocks [n, size] made sane in place: d within 12.5 % of d0, offsets centring the values, K-quant mins
    equal to their scales."""
    lay = _LAYOUTS[qtype]
    d = d0 * (0.875 + raw[:, lay.d_at] / 1024.0)  # jitter from the byte d then covers
    raw[:, lay.d_at : lay.d_at + 2] = _f16(d)
    if lay.m_at is not None:
        raw[:, lay.m_at : lay.m_at + 2] = _f16(lay.m_factor * raw[:, lay.d_at : lay.d_at + 2].copy().view("<f2")
                                               .astype(np.float64))
    if lay.k_mins:  # the 12 scale bytes (6-bit scales and mins packed): each min equal to its scale
        scales = raw[:, 4:16]
        scales[:, 4:8] = scales[:, 0:4]
        scales[:, 8:12] = (scales[:, 8:12] & 0x0F) * 0x11
    return raw


def _uniform(rng: np.random.PCG64, n: int) -> np.ndarray:
    """n values uniform in [0, 1) from 53 bits of each raw word."""
    return (rng.random_raw(n).astype("<u8") >> np.uint64(11)) * (1.0 / (1 << 53))


def _floats(rng: np.random.PCG64, name: str, n: int, cols: int, one_d: bool) -> np.ndarray:
    u = _uniform(rng, n) - 0.5
    if not one_d:
        return u * (math.sqrt(12.0 / cols))  # unit variance over sqrt(cols)
    return 1.0 + 0.2 * u if name.endswith("norm.weight") else 0.2 * u


def tensor_rng(seed: int, name: str) -> np.random.PCG64:
    key = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")
    return np.random.PCG64(np.random.SeedSequence([seed, key]))


def tensor_data(t: Planned, seed: int) -> np.ndarray:
    """The tensor's bytes (a quantized one: uint8 [rows, bytes per row]; a float one in its own dtype)."""
    rng = tensor_rng(seed, t.name)
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    if t.qtype in FLOAT_TYPES:
        out = np.empty((rows, cols), "<f4" if t.qtype == QType.F32 else "<f2")
        for r in range(0, rows, _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, rows - r)
            out[r : r + n] = _floats(rng, t.name, n * cols, cols, len(t.shape) == 1).reshape(n, cols)
        return out.reshape(t.shape)
    if t.qtype not in _LAYOUTS:
        raise TracelmError(f"synthetic model: tensor {t.name} is {t.qtype.name}, which the generator does not make "
                           f"(it makes {', '.join(q.name for q in (*FLOAT_TYPES, *_LAYOUTS))})")
    block, size = GGML_QUANT_SIZES[t.qtype]
    per_row = cols // block
    out = np.empty((rows, per_row * size), np.uint8)
    d0 = 1.0 / (math.sqrt(cols) * _rms(_LAYOUTS[t.qtype]))
    for r in range(0, rows, _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, rows - r)
        nbytes = n * per_row * size
        raw = rng.random_raw(-(-nbytes // 8)).astype("<u8").view(np.uint8)[:nbytes].reshape(n * per_row, size)
        out[r : r + n] = _blocks(raw, t.qtype, d0).reshape(n, per_row * size)
    return out


def nbytes(t: Planned) -> int:
    block, size = GGML_QUANT_SIZES[t.qtype]
    return math.prod(t.shape) // block * size


# ---- the file ----


def write(sn: SynthName, base_path: str | os.PathLike, base_sha256: str, out: Path) -> Path:
    """Write the synthetic model `sn` from its registry file at `base_path` to `out` (through a temporary file)."""
    base = GGUFFile(base_path)
    tensors = plan(base, sn.shape)
    for t in tensors:
        if t.shape[-1] % GGML_QUANT_SIZES[t.qtype][0]:
            raise TracelmError(f"synthetic model {sn}: tensor {t.name} has rows of {t.shape[-1]} values, not whole "
                               f"{t.qtype.name} blocks")
    kvs = metadata(base, sn, base_sha256)
    total = sum(nbytes(t) for t in tensors)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".part", delete=False) as f:
            tmp = Path(f.name)
    except OSError as e:
        raise TracelmError(f"{out.parent}: cannot write the synthetic model there: {e.strerror or e}") from None
    if free < total + (64 << 20):
        tmp.unlink(missing_ok=True)
        raise TracelmError(f"not enough disk space in {out.parent} for {sn} ({total / 2**20:.0f} MiB needed, "
                           f"{free / 2**20:.0f} MiB free)")
    w = gguf.GGUFWriter(tmp, base.metadata["general.architecture"])
    try:
        try:
            _write(w, kvs, tensors, sn)
        finally:
            w.close()
        tmp.chmod(0o644)  # as a pulled model's (a temporary file starts private)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise TracelmError(f"{out}: cannot write the synthetic model: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _write(w: gguf.GGUFWriter, kvs: list[tuple[str, Any, tuple[int, ...]]], tensors: list[Planned],
           sn: SynthName) -> None:
    """The header, the metadata, the tensor table, then each tensor made and written in turn."""
    for key, value, types in kvs:
        _add_kv(w, key, value, types)
    for t in tensors:
        if t.qtype in FLOAT_TYPES:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.qtype == QType.F32 else np.float16), nbytes(t))
        else:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes(t), raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with tqdm(total=sum(nbytes(t) for t in tensors), unit="B", unit_scale=True, unit_divisor=1024, desc=str(sn),
              disable=None, file=sys.stderr) as bar:
        for t in tensors:
            w.write_tensor_data(tensor_data(t, sn.seed))
            bar.update(nbytes(t))
