"""Write a loaded model (any format tracelm reads) as an f32 GGUF file with gguf.GGUFWriter.

The GGUF architecture is the model's own when it is one of the families (tracelm.io.families) and
`llama` otherwise (a llama2.c checkpoint). Hugging Face llama/mistral weights rotate halves (NEOX) where
GGUF llama rotates adjacent pairs, so their q and k rows are permuted on the way. The written file is
read back and its ModelConfig must equal the model's: an option the target architecture cannot express
fails here rather than giving a file that computes something else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from tracelm.io.families import BY_ARCH
from tracelm.io.gguf_file import GGUFFile, model_config
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


def export_gguf(cfg: ModelConfig, weights: ModelWeights, out: str | os.PathLike,
                metadata: dict[str, Any] | None = None, name: str = "") -> Path:
    out = Path(out)
    arch = cfg.arch if cfg.arch in BY_ARCH else "llama"
    implied = BY_ARCH[arch].gguf_options(cfg.n_embd)
    permute = cfg.rope_mode != implied["rope_mode"]
    if permute and (cfg.rope_mode, cfg.rope_dim) != ("neox", cfg.head_dim):
        raise TracelmError(f"export: cannot express {cfg.rope_mode} RoPE over {cfg.rope_dim} of {cfg.head_dim} dims "
                           f"as GGUF {arch}")
    try:
        w = gguf.GGUFWriter(str(out), arch)
    except OSError as e:
        raise TracelmError(f"{out}: cannot write: {e.strerror}") from None
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
    _tokenizer_kv(w, metadata or {})

    f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(weights.token_embd))
    w.add_tensor("output_norm.weight", f32(weights.output_norm))
    if not cfg.tied_head:
        w.add_tensor("output.weight", f32(weights.output))
    if cfg.rope_freq_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(cfg.rope_freq_factors, np.float32))
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
        for key, a in tensors.items():
            w.add_tensor(p + key, f32(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    back = model_config(GGUFFile(out))
    expected = _as_written(cfg, arch, permute)
    if back != expected:
        diff = [f"{f.name}: {getattr(expected, f.name)!r} -> {getattr(back, f.name)!r}"
                for f in attrs.fields(ModelConfig) if getattr(back, f.name) != getattr(expected, f.name)]
        out.unlink(missing_ok=True)
        raise TracelmError(f"export: GGUF {arch} cannot express this model ({'; '.join(diff)})")
    return out


def _as_written(cfg: ModelConfig, arch: str, permute: bool) -> ModelConfig:
    """The config a GGUF reader gets back: float metadata is stored as f32."""
    f = lambda x: float(np.float32(x))  # noqa: E731
    factors = None if cfg.rope_freq_factors is None else tuple(f(x) for x in cfg.rope_freq_factors)
    return attrs.evolve(cfg, arch=arch, rope_mode="adjacent" if permute else cfg.rope_mode, rms_eps=f(cfg.rms_eps),
                        rope_base=f(cfg.rope_base), rope_base_swa=f(cfg.rope_base_swa), attn_scale=f(cfg.attn_scale),
                        rope_freq_factors=factors)
