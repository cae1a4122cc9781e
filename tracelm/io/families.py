"""Model families: one row per architecture the graph builds, with what each file format says about it.

A row holds the family's GGUF architecture name (also `ModelConfig.arch`), its Hugging Face `model_type`s,
the ModelConfig options the architecture implies, how its GGUF files lay it out (RoPE pairs, fused
projections, the defaults llama.cpp assumes when the metadata is silent), its norm offset and its
embedding scale. The GGUF reader, the safetensors reader and export all read this table; a format's own
conventions (metadata keys, config.json fields) stay with its reader.

Tensor names: every format is mapped onto the GGUF names (`token_embd.weight`, `blk.N.attn_q.weight`, ...);
`HF_LAYER`, `HF_NORMS` (or `HF_POST_NORMS`) and `HF_TOP` give the Hugging Face name of each.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np


@attrs.frozen
class Family:
    arch: str  # GGUF general.architecture, and ModelConfig.arch
    hf_model_types: tuple[str, ...]  # config.json model_type of its Hugging Face checkpoints
    options: Mapping[str, Any]  # ModelConfig options of the architecture, whatever the file format
    gguf_rope_mode: str  # how its GGUF files order q/k rows: "adjacent" pairs or "neox" halves (HF: always neox)
    gguf_defaults: Mapping[str, Any] = attrs.field(factory=dict)  # llama.cpp's when the metadata is silent
    gguf_fused: bool = False  # llama.cpp reads its q/k/v and gate/up fused (attn_qkv, ffn_up of 2 n_ff rows)
    hf_norm_offset: float = 0.0  # HF stores RMSNorm weights as w with the scale offset + w (GGUF stores the scale)
    scaled_embedding: bool = False  # embedding rows multiplied by sqrt(n_embd)

    def gguf_options(self, n_embd: int) -> dict[str, Any]:
        """The ModelConfig options a GGUF file of this family implies (its metadata may override some)."""
        return {"rope_mode": self.gguf_rope_mode, **self.options, **self.gguf_defaults, **self._scale(n_embd)}

    def hf_options(self, n_embd: int) -> dict[str, Any]:
        """The ModelConfig options a Hugging Face checkpoint of this family implies (config.json adds more)."""
        return {**self.options, **self._scale(n_embd)}

    def _scale(self, n_embd: int) -> dict[str, float]:
        return {"embd_scale": float(np.float32(np.sqrt(np.float32(n_embd))))} if self.scaled_embedding else {}

    @property
    def hf_layer_names(self) -> dict[str, str]:
        """Hugging Face block tensor name (after `model.layers.N.`) -> GGUF name (after `blk.N.`)."""
        return HF_LAYER | (HF_POST_NORMS if self.options.get("post_norms") else HF_NORMS)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral"), {}, gguf_rope_mode="adjacent"),
    Family("qwen2", ("qwen2",), {"qkv_bias": True}, gguf_rope_mode="neox"),
    Family("qwen3", ("qwen3",), {"qk_norm": True}, gguf_rope_mode="neox"),
    Family("phi3", ("phi3",), {}, gguf_rope_mode="neox", gguf_fused=True),
    # llama.cpp's gemma3: every 6th layer global, windowed layers on RoPE base 10000
    Family("gemma3", ("gemma3_text",), {"qk_norm": True, "post_norms": True, "ffn_act": "gelu_tanh"},
           gguf_rope_mode="neox", gguf_defaults={"swa_pattern": 6, "rope_base_swa": 10000.0},
           hf_norm_offset=1.0, scaled_embedding=True),
)

BY_ARCH: dict[str, Family] = {f.arch: f for f in FAMILIES}
BY_HF_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.hf_model_types}
HF_WRAPPER_TYPES = ("gemma3",)  # config.json model_types whose text_config holds the language model

HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip
HF_NORMS = {"post_attention_layernorm.weight": "ffn_norm.weight"}  # two norms per block: the second is the FFN's
HF_POST_NORMS = {  # post_norms families (gemma): four norms per block
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
HF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str, family: Family) -> str | None:
    """The GGUF name of a Hugging Face tensor of this family (a multimodal checkpoint's language model too),
    or None for a tensor tracelm does not read."""
    name = hf_name.removeprefix("language_model.").replace("model.language_model.", "model.")
    m = _HF_BLOCK.fullmatch(name)
    if m and m.group(2) in (layer := family.hf_layer_names):
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    return HF_TOP.get(name)
