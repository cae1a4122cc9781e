"""ModelConfig: the shape and options of a model, whatever file format it came from."""

from __future__ import annotations

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

    def __attrs_post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope dimension_count {self.rope_dim} does not fit head dim {self.head_dim}")
        if self.rope_mode not in ("adjacent", "neox"):
            raise ValueError(f"rope mode {self.rope_mode!r} is neither 'adjacent' nor 'neox'")

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_params(self) -> int:
        """Parameters of the matrices and norms (the head counted once when tied)."""
        d, ff = self.n_embd, self.n_ff
        block = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * ff + 2 * d
        head = 0 if self.tied_head else self.n_vocab * d
        return self.n_vocab * d + self.n_layer * block + d + head
