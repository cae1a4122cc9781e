"""ModelConfig: the shape and options of a model, whatever file format it came from."""

from __future__ import annotations

import math

import attrs


@attrs.frozen(slots=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_dim: int  # rotated dimensions of each head (<= head_dim)
    rope_mode: str  # "adjacent" (pairs 2i, 2i+1: GGUF llama) or "neox" (halves: i, i + rope_dim/2)
    rms_eps: float
    n_ctx_train: int
    tied_head: bool
    qkv_bias: bool = False
    # Options of the one graph (each off by default; a stage never looks at `arch`):
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3, gemma3)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before their residual adds (gemma)
    ffn_act: str = "silu"  # gate activation of the gated FFN: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embd_scale: float = 1.0  # embedding rows multiplied by this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0  # scale of q.k; 0 means 1/sqrt(head_dim)
    sliding_window: int = 0  # a windowed layer's query at p sees keys k with p - k < window; 0 = none
    swa_pattern: int = 0  # with a window: layer i is global when (i + 1) % swa_pattern == 0; 0 = all windowed
    rope_base_swa: float = 0.0  # RoPE base of windowed layers; 0 = rope_base
    rope_freq_factors: tuple[float, ...] | None = None  # per-pair divisors of the RoPE frequencies (llama 3)

    def __attrs_post_init__(self) -> None:
        for field in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "n_ctx_train"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} {value!r} is not a positive integer")
        for field in ("sliding_window", "swa_pattern"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} {getattr(self, field)} is negative")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope dimension_count {self.rope_dim} does not fit head dim {self.head_dim}")
        if self.rope_mode not in ("adjacent", "neox"):
            raise ValueError(f"rope mode {self.rope_mode!r} is neither 'adjacent' nor 'neox'")
        if self.ffn_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ffn activation {self.ffn_act!r} is neither 'silu' nor 'gelu_tanh'")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ValueError(f"rope_freqs has {len(self.rope_freq_factors)} factors, "
                             f"rope dimension_count {self.rope_dim} needs {self.rope_dim // 2}")

    def window(self, layer: int) -> int:
        """The attention window of one layer (0: the layer sees every earlier position)."""
        if not self.sliding_window or (self.swa_pattern and (layer + 1) % self.swa_pattern == 0):
            return 0
        return self.sliding_window

    def layer_rope_base(self, layer: int) -> float:
        return self.rope_base_swa if self.rope_base_swa and self.window(layer) else self.rope_base

    @property
    def scale(self) -> float:
        """The factor of q.k in attention."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim
