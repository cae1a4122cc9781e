"""Write a model (any format tracelm reads) as a GGUF file with gguf.GGUFWriter: f32, or quantized
(tracelm.io.quantize), with its vocabulary, tokenizer metadata and chat template.

The GGUF architecture is the model's own when it is one of the families (tracelm.io.families) and
`llama` otherwise (a llama2.c checkpoint). Hugging Face llama/mistral weights rotate halves (NEOX) where
GGUF llama rotates adjacent pairs, so their q and k rows are permuted on the way. The written file is
read back and its ModelConfig must equal the model's: an option the target architecture cannot express
fails here rather than giving a file that computes something else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from tqdm import tqdm

from tracelm.io.families import BY_ARCH
from tracelm.io.gguf_file import GGUFFile, model_config
from tracelm.io.quantize import quantize_rows, row_bytes, tensor_type
from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import ModelWeights


def neox_to_adjacent(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of each head from halves (i, i + hd/2) to adjacent pairs (2i, 2i+1)."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(rows, *w.shape[1:])


def _tokenizer_kv(w: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """Copy the tokenizer.* metadata of a GGUF source (strings, ids, flags, token arrays)."""
    str_keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores([float(s) for s in value])
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types([int(t) for t in value])
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)
        elif key in str_keys or isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)


def export_gguf(cfg: ModelConfig, weights: ModelWeights | Any, out: str | os.PathLike,
                metadata: dict[str, Any] | None = None, name: str = "", qtype: QType | None = None,
                progress: bool = False) -> Path:
    """Write the model as a GGUF file: f32 (`qtype` None) or quantized as `tensor_type` says for `qtype`.
    `weights`: resident ModelWeights, or a model file's tensor source (a GGUFFile or an HFFolder under the GGUF
    names), whose tensors are then read, quantized and written one at a time (the f32 model is never whole in
    memory). `metadata`: the tokenizer.* keys to carry (a GGUF's own, or `hf_vocab_metadata` of a folder)."""
    out = Path(out)
    arch = cfg.arch if cfg.arch in BY_ARCH else "llama"
    implied = BY_ARCH[arch].gguf_options(cfg.n_embd)
    permute = cfg.rope_mode != implied["rope_mode"]
    if permute and (cfg.rope_mode, cfg.rope_dim) != ("neox", cfg.head_dim):
        raise TracelmError(f"export: cannot express {cfg.rope_mode} RoPE over {cfg.rope_dim} of {cfg.head_dim} dims "
                           f"as GGUF {arch}")
    if isinstance(weights, ModelWeights):
        tensors = _weight_tensors(cfg, weights, arch, permute)
    else:
        tensors = _source_tensors(cfg, weights, permute)
    try:
        w = gguf.GGUFWriter(str(out), arch)
    except OSError as e:
        raise TracelmError(f"{out}: cannot write: {e.strerror}") from None
    _model_kv(w, cfg, arch, implied, name)
    if qtype is not None:
        w.add_file_type(FILE_TYPES[qtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_kv(w, metadata or {})
    types = {n: QType.F32 if qtype is None or len(shape) < 2 else tensor_type(n, shape, qtype, cfg.tied_head)
             for n, (shape, _read) in tensors.items()}
    for n, (shape, _read) in tensors.items():
        w.add_tensor_info(n, (*shape[:-1], row_bytes(shape[-1], types[n])), np.dtype(np.uint8),
                          int(np.prod(shape[:-1])) * row_bytes(shape[-1], types[n]), raw_dtype=types[n])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for n, (shape, read) in tqdm(tensors.items(), desc=f"writing {out.name}", leave=False,
                                     disable=None if progress else True):
            a = np.ascontiguousarray(read(), np.float32).reshape(shape)
            if not np.isfinite(a).all():
                raise TracelmError(f"export: tensor {n} holds values that are not finite")
            w.write_tensor_data(quantize_rows(a.reshape(-1, shape[-1]), types[n]))
        w.close()
    except BaseException:
        w.close()
        out.unlink(missing_ok=True)
        raise

    back = model_config(GGUFFile(out))
    expected = _as_written(cfg, arch, permute)
    if back != expected:
        diff = [f"{f.name}: {getattr(expected, f.name)!r} -> {getattr(back, f.name)!r}"
                for f in attrs.fields(ModelConfig) if getattr(back, f.name) != getattr(expected, f.name)]
        out.unlink(missing_ok=True)
        raise TracelmError(f"export: GGUF {arch} cannot express this model ({'; '.join(diff)})")
    return out


# llama_ftype of a file whose matrices are mostly of one type (general.file_type)
FILE_TYPES = {QType.Q4_0: 2, QType.Q4_1: 3, QType.Q8_0: 7, QType.Q5_0: 8, QType.Q5_1: 9, QType.Q4_K: 14,
              QType.Q5_K: 16, QType.Q6_K: 18}

Tensors = dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]


def _model_kv(w: gguf.GGUFWriter, cfg: ModelConfig, arch: str, implied: dict[str, Any], name: str) -> None:
    """The architecture's metadata: what `model_config` reads back as `cfg`."""
    if name:
        w.add_name(name)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    if cfg.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if cfg.swa_pattern != implied.get("swa_pattern", 0):
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg.swa_pattern)
    if cfg.rope_base_swa != implied.get("rope_base_swa", 0.0):
        w.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_base_swa)
    if cfg.attn_scale:
        w.add_float32(f"{arch}.attention.scale", cfg.attn_scale)


def _source_tensors(cfg: ModelConfig, src: Any, permute: bool) -> Tensors:
    """Every tensor of a GGUFFile or HFFolder by GGUF name, read (in f32) only when written; a NEOX model's q and k
    rows (weights and biases) reordered for GGUF llama's adjacent pairs; rope_freqs from the config."""
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv}

    def reader(name: str) -> Callable[[], np.ndarray]:
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if permute and kind in heads:
            return lambda: neox_to_adjacent(src.tensor_f32(name), heads[kind])
        return lambda: src.tensor_f32(name)

    tensors: Tensors = {n: (tuple(t.shape), reader(n)) for n, t in src.tensors.items() if n != "rope_freqs.weight"}
    if cfg.rope_freq_factors is not None:
        factors = np.asarray(cfg.rope_freq_factors, np.float32)
        tensors["rope_freqs.weight"] = (factors.shape, lambda: factors)
    return tensors


def _weight_tensors(cfg: ModelConfig, weights: ModelWeights, arch: str, permute: bool) -> Tensors:
    """Resident f32 ModelWeights under the GGUF names the architecture reads (q/k/v and gate/up split again,
    unless llama.cpp reads the family fused)."""
    arrays = {"token_embd.weight": weights.token_embd, "output_norm.weight": weights.output_norm}
    if not cfg.tied_head:
        arrays["output.weight"] = weights.output
    if cfg.rope_freq_factors is not None:
        arrays["rope_freqs.weight"] = np.asarray(cfg.rope_freq_factors, np.float32)
    q, kv, ff = cfg.q_dim, cfg.kv_dim, cfg.n_ff
    for i, lw in enumerate(weights.layers):
        p = f"blk.{i}."
        wq, wk, wv = lw.wqkv[:q], lw.wqkv[q : q + kv], lw.wqkv[q + kv :]
        bias = (lw.bqkv[:q], lw.bqkv[q : q + kv], lw.bqkv[q + kv :]) if lw.bqkv is not None else None
        if permute:
            wq, wk = neox_to_adjacent(wq, cfg.n_head), neox_to_adjacent(wk, cfg.n_head_kv)
            if bias is not None:
                bias = (neox_to_adjacent(bias[0], cfg.n_head), neox_to_adjacent(bias[1], cfg.n_head_kv), bias[2])
        tensors = {"attn_norm.weight": lw.attn_norm}
        if BY_ARCH[arch].gguf_fused:  # llama.cpp reads this family's q/k/v and gate/up fused
            tensors |= {"attn_qkv.weight": lw.wqkv, "ffn_up.weight": lw.w_gate_up}
            if bias is not None:
                tensors["attn_qkv.bias"] = lw.bqkv
        else:
            tensors |= {"attn_q.weight": wq, "attn_k.weight": wk, "attn_v.weight": wv,
                        "ffn_gate.weight": lw.w_gate_up[:ff], "ffn_up.weight": lw.w_gate_up[ff:]}
            if bias is not None:
                tensors |= {"attn_q.bias": bias[0], "attn_k.bias": bias[1], "attn_v.bias": bias[2]}
        tensors |= {"attn_output.weight": lw.wo, "ffn_norm.weight": lw.ffn_norm, "ffn_down.weight": lw.w_down}
        for key, a in (("attn_q_norm.weight", lw.q_norm), ("attn_k_norm.weight", lw.k_norm),
                       ("post_attention_norm.weight", lw.post_attn_norm), ("post_ffw_norm.weight", lw.post_ffn_norm)):
            if a is not None:
                tensors[key] = a
        arrays |= {p + k: a for k, a in tensors.items()}
    return {n: (tuple(np.shape(a)), (lambda a=a: a)) for n, a in arrays.items()}


def _as_written(cfg: ModelConfig, arch: str, permute: bool) -> ModelConfig:
    """The config a GGUF reader gets back: float metadata is stored as f32."""
    f = lambda x: float(np.float32(x))  # noqa: E731
    factors = None if cfg.rope_freq_factors is None else tuple(f(x) for x in cfg.rope_freq_factors)
    return attrs.evolve(cfg, arch=arch, rope_mode="adjacent" if permute else cfg.rope_mode, rms_eps=f(cfg.rms_eps),
                        rope_base=f(cfg.rope_base), rope_base_swa=f(cfg.rope_base_swa), attn_scale=f(cfg.attn_scale),
                        rope_freq_factors=factors)


def vocab_metadata(folder_or_file: Path, kind: str, own: dict[str, Any], tokenizer: str | None = None,
                   n_vocab: int = 0) -> dict[str, Any]:
    """The tokenizer.* metadata a written GGUF carries: the `tokenizer` file's when one is named (a GGUF, or a
    Hugging Face tokenizer.json or its folder), else the model's own (a GGUF's keys, a folder's tokenizer.json as
    `gguf_vocab_metadata`, padded to `n_vocab` tokens); none for a llama2.c checkpoint unless `tokenizer` names a
    GGUF or a tokenizer.json."""
    from tracelm.io.tokenizer_formats import gguf_vocab_metadata

    if tokenizer is not None:
        t = Path(tokenizer).expanduser()
        if t.is_dir() or t.suffix == ".json":
            return gguf_vocab_metadata(t if t.is_dir() else t.parent, n_vocab)
        if t.suffix == ".gguf":
            return GGUFFile(t).metadata
        return {}
    if kind == "hf":
        return gguf_vocab_metadata(folder_or_file, n_vocab)
    return own if kind == "gguf" else {}
