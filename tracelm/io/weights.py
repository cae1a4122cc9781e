"""The weight layout: which tensors make each block's LayerWeights (`layer_plan`: q/k/v and gate/up fused), and
the blocks laid out in one aligned arena in graph order -- in f32 for the numpy reference (`load_weights`,
`layer_weights`), or as the file's own blocks for the compiled kernels (`kernel_weights`). The source is a
GGUFFile, or an HFFolder under the GGUF names."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType

import tracelm.kernels as kernels
from tracelm.io.dequant import CHUNK_VALUES
from tracelm.io.gguf_file import GGUFFile
from tracelm.io.quantize import FLOAT_TYPES, quantize_rows, row_bytes, tensor_type
from tracelm.state.errors import ModelFormatError, TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights, QMatrix

# The fields of LayerWeights, each with the tensors whose rows it stacks and its f32 shape.
LayerPlan = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]


# the config's counts behind the rows of a field stacked from several tensors
_COUNTS = {"wqkv": ("n_head", "n_head_kv", "head_dim"), "bqkv": ("n_head", "n_head_kv", "head_dim"),
           "w_gate_up": ("n_ff",)}


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
    for field, (names, shape) in plan.items():
        parts = [_info(gf, n) for n in names]
        if len(parts) == 1:
            _expect_shape(gf, names[0], shape)
        for t in parts:
            if t.shape[1:] != shape[1:]:
                want = f"[rows, {shape[1]}]" if len(shape) > 1 else "a vector"
                raise TracelmError(f"{gf.name}: tensor {t.name} has shape {list(t.shape)}, expected {want}")
        if sum(t.shape[0] for t in parts) != shape[0]:
            raise TracelmError(f"{gf.name}: block {i} projections do not match the metadata ("
                               + ", ".join(f"{t.name} {list(t.shape)}" for t in parts)
                               + f": {sum(t.shape[0] for t in parts)} rows, expected {shape[0]} from "
                               + ", ".join(f"{k} {getattr(cfg, k)}" for k in _COUNTS[field]) + ")")
    return plan


BLOCK_NAME = re.compile(r"blk\.(\d{1,9})\.")  # a block's tensors, by the canonical names


def check_blocks(gf: Any, cfg: ModelConfig, field: str) -> None:
    """Before anything loops over a model's blocks or sizes memory by them: the block count (read from `field`) no
    more than the blocks whose tensors the file holds, and every block's tensors of the shapes the config's counts
    make (heads, kv heads, head dim, FFN width; `layer_plan`, header only). A ModelFormatError names the field."""
    held = {int(m.group(1)) for name in gf.tensors if (m := BLOCK_NAME.match(name))}
    if cfg.n_layer > len(held):
        raise ModelFormatError(f"{gf.name}: {field} is {cfg.n_layer}, but the file holds the tensors of "
                               f"{len(held)} block" + "s" * (len(held) != 1))
    for i in range(cfg.n_layer):
        layer_plan(gf, cfg, i)


def _expect_shape(gf: Any, name: str, shape: tuple[int, ...]) -> None:
    """A TracelmError naming the tensor unless its header gives it `shape` (no data read)."""
    if _info(gf, name).shape != shape:
        raise TracelmError(f"{gf.name}: tensor {name} has shape {list(_info(gf, name).shape)}, expected {list(shape)}")


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
    # them from 4 MiB), so a decode step's walk through the weights takes few TLB misses (a separate array
    # per matrix would leave the small ones on ordinary pages)
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


def kernel_weights(gf: Any, cfg: ModelConfig, streamed: bool = False, progress: bool = True,
                   quantize: QType | None = None) -> ModelWeights:
    """The matrices of a GGUFFile (or an HFFolder's F32/F16/BF16 tensors) as QMatrix -- their own blocks, for
    the compiled kernels (`compute: kernels`) -- and the vectors in f32. Resident: every matrix copied once
    into one arena in graph order (huge pages, the file's size), the quantized types packed for the kernels
    (`kernels.pack`); streamed: views of the mapped file as they are, paged in as the graph reads them. A type
    the kernels lack (Q2_K, Q3_K, the IQ types...) is dequantized to f32. `quantize` (resident only): every F32,
    F16 or BF16 matrix quantized as it is read, a chunk of rows at a time straight into the arena, to the type
    `tensor_type` gives it (the f32 matrices are never all in memory)."""
    d = cfg.n_embd
    plans = [layer_plan(gf, cfg, i) for i in range(cfg.n_layer)]
    # the vectors first, read through the map, whose pages go before the matrices fill the arena
    vectors = [{f: _stack(gf, names, shape) for f, (names, shape) in plan.items() if len(shape) == 1} for plan in plans]
    output_norm = np.array(_checked(gf, "output_norm.weight", (d,)))
    heads = ["token_embd.weight"] + ([] if cfg.tied_head else ["output.weight"])
    for name in heads:  # the f32 path checks them as it reads them (`_checked`); here before any is read
        _expect_shape(gf, name, (cfg.n_vocab, d))
    groups = [names for plan in plans for names, shape in plan.values() if len(shape) == 2] + [(n,) for n in heads]
    targets = quantize_targets(gf, [n for g in groups for n in g], quantize, cfg.tied_head)
    parts = _kernel_parts(gf, groups, streamed, progress, targets)

    def matrix(names: tuple[str, ...], shape: tuple[int, ...]) -> QMatrix:
        return QMatrix(shape, parts[names], packed=not streamed)

    layers = tuple(LayerWeights(**vec, **{f: matrix(n, shape) for f, (n, shape) in plan.items() if len(shape) == 2})
                   for plan, vec in zip(plans, vectors, strict=True))
    embd = matrix(("token_embd.weight",), (cfg.n_vocab, d))
    output = embd if cfg.tied_head else matrix(("output.weight",), (cfg.n_vocab, d))
    return ModelWeights(token_embd=embd, layers=layers, output_norm=output_norm, output=output)


def quantize_targets(gf: Any, names: list[str], quantize: QType | None, tied_head: bool) -> dict[str, QType]:
    """The matrices `quantize` turns into blocks -- those stored as F32, F16 or BF16 -- and the type of each."""
    if quantize is None:
        return {}
    return {n: tensor_type(n, _info(gf, n).shape, quantize, tied_head) for n in names
            if _info(gf, n).qtype in FLOAT_TYPES}


def _kernel_parts(gf: Any, groups: list[tuple[str, ...]], streamed: bool, progress: bool,
                  targets: dict[str, QType] | None = None) -> dict[tuple[str, ...], tuple[tuple[np.ndarray, int], ...]]:
    """names -> its parts (blocks, qtype) for each matrix, a group of tensors stacked row after row: views of the
    map, one part per tensor (streamed), or copied by file reads into one arena in the order given, each group
    64-byte aligned and its tensors end to end (resident; the map's pages let go before and after). Resident,
    neighbours of one type join into one part (`joinable`): one kernel call for q, k and v instead of three, the
    same bits, since every output row is its own product. `targets`: matrices quantized on the way (name -> type)."""
    from tqdm import tqdm

    targets = targets or {}
    if streamed and targets:
        raise TracelmError(f"{gf.name}: quantize needs resident weights (streamed weights stay as the file has them)")
    resident_gguf = not streamed and isinstance(gf, GGUFFile)
    if resident_gguf:
        gf.release_pages()
    group_bytes = [-(-sum(_kernel_bytes(gf, n, targets) for n in g) // 64) * 64 for g in groups]
    arena = None if streamed else aligned_bytes(sum(group_bytes))
    pos, out = 0, {}
    with tqdm(total=sum(map(len, groups)), desc="quantizing weights" if targets else "loading weights", leave=False,
              disable=None if progress else True) as bar:
        for names in groups:
            parts: list[tuple[np.ndarray, int]] = []
            for n in names:
                size = _kernel_bytes(gf, n, targets)
                dest = None if arena is None else arena[pos : pos + size]
                part = _quantized_part(gf, n, targets[n], dest) if n in targets else _kernel_part(gf, n, dest)
                if arena is not None and parts and joinable(parts[-1], part):
                    a = pos - parts[-1][0].nbytes  # the previous part ends here
                    part = (arena[a : pos + size].reshape(-1, part[0].shape[1]), part[1])
                    parts.pop()
                parts.append(part)
                pos += size
                bar.update()
            out[names] = tuple(parts)
            pos = -(-pos // 64) * 64
    if resident_gguf:
        gf.release_pages()
    return out


def _quantized_part(gf: Any, name: str, qtype: QType, out: np.ndarray) -> tuple[np.ndarray, int]:
    """(blocks, qtype) of a float matrix quantized into `out` a chunk of rows at a time (read by `rows_f32`), packed
    for the kernels; the source's pages let go after each chunk."""
    t = _info(gf, name)
    rows, cols = t.shape
    blocks = out.reshape(rows, -1)
    step = max(1, CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        end = min(r + step, rows)
        quantize_rows(gf.rows_f32(name, r, end), qtype, out=blocks[r:end])
        if isinstance(gf, GGUFFile):
            gf.release_pages()
    if kernels.packable(qtype, rows):
        kernels.pack(blocks, qtype, out=blocks)
    return blocks, qtype


def _kernel_part(gf: Any, name: str, out: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(blocks, qtype) of one matrix: a view of the map (out None) or its bytes read into `out`, the quantized types
    packed (`kernels.pack`); a type the kernels lack as F32 rows."""
    t = _info(gf, name)
    if t.qtype not in kernels.SUPPORTED:
        blocks = gf.tensor_f32(name).view(np.uint8).reshape(t.shape[0], -1)
        return (blocks if out is None else _copied(blocks, out)), QType.F32
    if out is None:
        return gf.raw_rows(name), t.qtype
    blocks = gf.read_into(name, out).reshape(t.shape[0], -1)
    if kernels.packable(t.qtype, blocks.shape[0]):
        kernels.pack(blocks, t.qtype, out=blocks)  # in place: the kernels' layout (QMatrix.packed)
    return blocks, t.qtype


def joinable(a: tuple[np.ndarray, int], b: tuple[np.ndarray, int]) -> bool:
    """Whether two parts may be one: the same type and row size, and packed alike (a quantized type packs whole
    groups of 8 rows, so both parts must have been packed)."""
    (wa, ta), (wb, tb) = a, b
    packed_alike = int(ta) not in kernels.PACKABLE or (kernels.packable(ta, wa.shape[0])
                                                       and kernels.packable(tb, wb.shape[0]))
    return ta == tb and wa.shape[1] == wb.shape[1] and packed_alike


def _kernel_bytes(gf: Any, name: str, targets: dict[str, QType] | None = None) -> int:
    """Bytes a matrix takes for the kernels: its blocks (those it is quantized to), or f32 rows for a type they
    lack."""
    t = _info(gf, name)
    if targets and name in targets:
        return t.shape[0] * row_bytes(t.shape[1], targets[name])
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
