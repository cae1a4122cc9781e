"""The Cache: the one mutable object of a run (KV per layer, RoPE tables, causal masks)."""

from __future__ import annotations

import numpy as np

from tracelm.state.model_config import ModelConfig


class Cache:
    """Keys and values of every layer for up to n_ctx positions, preallocated, plus the tables that
    depend only on position. `tokens` are the ids whose keys/values are stored, in position order."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, rope_cos: np.ndarray, rope_sin: np.ndarray,
                 rope_extra: dict[float, tuple[np.ndarray, np.ndarray]] | None = None):
        shape = (cfg.n_layer, cfg.n_head_kv, n_ctx, cfg.head_dim)
        self.n_ctx = n_ctx
        self.k = np.zeros(shape, np.float32)  # [layer, kv head, position, head dim]
        self.v = np.zeros(shape, np.float32)
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # [n_ctx, rope_dim], laid out for the rope mode
        # tables of other RoPE bases (gemma3's windowed layers), keyed by base
        self.rope_extra = dict(rope_extra or {})
        for table in (self.rope_cos, self.rope_sin, *(t for pair in self.rope_extra.values() for t in pair)):
            table.flags.writeable = False
        self.tokens: list[int] = []
        self._masks: dict[tuple[int, int, int], np.ndarray] = {}  # (start, T, window) -> mask

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.rope_cos.nbytes + self.rope_sin.nbytes + sum(
            m.nbytes for m in self._masks.values()) + sum(t.nbytes for p in self.rope_extra.values() for t in p)

    def reset(self) -> None:
        """Forget every position (the arrays stay allocated; stale rows are never read)."""
        self.tokens.clear()
        self._masks.clear()

    def truncate(self, n: int) -> None:
        """Keep only the first n positions (a shared prompt prefix)."""
        del self.tokens[n:]

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v [T, n_head_kv, head_dim] at positions start..start+T-1 of one layer."""
        T = k.shape[0]
        self.k[layer, :, start : start + T] = k.transpose(1, 0, 2)
        self.v[layer, :, start : start + T] = v.transpose(1, 0, 2)

    def keys_values(self, layer: int, end: int, lo: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views of positions lo..end-1 of one layer: [n_head_kv, end - lo, head_dim] each."""
        k, v = self.k[layer, :, lo:end], self.v[layer, :, lo:end]
        k.flags.writeable = v.flags.writeable = False
        return k, v

    def rope_rows(self, start: int, T: int, base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows start..start+T-1 of the RoPE tables (of `base` when it has its own tables)."""
        cos, sin = self.rope_extra.get(base, (self.rope_cos, self.rope_sin))
        return cos[start : start + T], sin[start : start + T]

    def causal_mask(self, start: int, T: int) -> np.ndarray | None:
        """Additive mask [T, start+T]: query t (position start+t) sees keys 0..start+t; None for T = 1."""
        return self.window_mask(start, T, 0)[1]

    def window_mask(self, start: int, T: int, window: int) -> tuple[int, np.ndarray | None]:
        """For a layer that sees only the last `window` positions (query p sees keys k with p - k < window;
        window 0: every earlier position): the first key position lo it can see, and the additive mask
        [T, start+T-lo] of 0 / -inf over keys lo..start+T-1 (None when every one of them is visible)."""
        lo = max(0, start - window + 1) if window else 0
        if T == 1:
            return lo, None
        key = (start, T, window)
        mask = self._masks.get(key)
        if mask is None:
            q = np.arange(start, start + T)[:, None]
            k = np.arange(lo, start + T)[None, :]
            visible = (k <= q) & ((q - k < window) if window else True)
            mask = np.where(visible, np.float32(0), np.float32(-np.inf)).astype(np.float32)
            mask.flags.writeable = False
            if len(self._masks) > 8:
                self._masks.clear()
            self._masks[key] = mask
        return lo, mask

    def commit(self, ids) -> None:
        """Record that positions n_past.. now hold the keys/values of `ids`."""
        self.tokens.extend(int(i) for i in ids)
