"""Attention stages: QKV projection, rotary position embedding, causal attention, output projection."""

from __future__ import annotations

import numpy as np

from tracelm.state.records import Heads, Hidden


def qkv(h: Hidden, wqkv: np.ndarray, bqkv: np.ndarray | None, n_head: int, n_head_kv: int,
        head_dim: int) -> Heads:
    """One product with the fused [q; k; v] matrix, split into per-head q [T,H,hd], k and v [T,Hkv,hd]."""
    y = h.x @ wqkv.T
    if bqkv is not None:
        y += bqkv
    T, q_dim, kv_dim = y.shape[0], n_head * head_dim, n_head_kv * head_dim
    q = y[:, :q_dim].reshape(T, n_head, head_dim)
    k = y[:, q_dim : q_dim + kv_dim].reshape(T, n_head_kv, head_dim)
    v = y[:, q_dim + kv_dim :].reshape(T, n_head_kv, head_dim)
    return Heads(q, k, v, h.start)


def rope_tables(n_ctx: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of angle[p, i] = p * base^(-2i / rope_dim), shape [n_ctx, rope_dim / 2]."""
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    angle = np.arange(n_ctx, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """Rotate pairs (a, b) of the first 2*cos.shape[-1] dims of x [T, H, hd] by the position's angle:
    (a, b) -> (a cos - b sin, a sin + b cos).

    mode "adjacent": pairs are dims (2i, 2i+1) (GGUF llama weights, llama.cpp's default);
    mode "neox": pairs are dims (i, i + rope_dim/2) (rotate-half, as in HF / GPT-NeoX).
    Dims past rope_dim pass through unchanged (partial rotary).
    """
    T, H, hd = x.shape
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if mode == "adjacent":
        pairs = x[..., : 2 * half].reshape(T, H, half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = np.stack((a * c - b * s, a * s + b * c), axis=-1).reshape(T, H, 2 * half)
    elif mode == "neox":
        a, b = x[..., :half], x[..., half : 2 * half]
        rotated = np.concatenate((a * c - b * s, a * s + b * c), axis=-1)
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    if 2 * half == hd:
        return rotated
    return np.concatenate((rotated, x[..., 2 * half :]), axis=-1)


def rope(heads: Heads, cos: np.ndarray, sin: np.ndarray, mode: str) -> Heads:
    """Rotary position embedding of q and k; cos/sin are the table rows of the T positions."""
    return Heads(rotate(heads.q, cos, sin, mode), rotate(heads.k, cos, sin, mode), heads.v, heads.start)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None, scale: float,
           start: int) -> Hidden:
    """softmax(q k^T * scale + mask) v for every head, grouped-query style.

    q [T, H, hd]; keys, values [Hkv, L, hd] (all L cached positions, L = start + T); mask [T, L] of
    0 / -inf or None (decode: every cached position is visible). Query head h reads kv head h // (H/Hkv).
    Returns the heads concatenated: [T, H * hd].
    """
    T, H, hd = q.shape
    n_kv, L = keys.shape[0], keys.shape[1]
    g = H // n_kv
    qg = q.reshape(T, n_kv, g, hd).transpose(1, 2, 0, 3).reshape(n_kv, g * T, hd)
    scores = (qg @ keys.transpose(0, 2, 1)).reshape(n_kv, g, T, L)
    scores *= scale
    if mask is not None:
        scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores.reshape(n_kv, g * T, L) @ values  # [n_kv, g*T, hd]
    return Hidden(out.reshape(n_kv, g, T, hd).transpose(2, 0, 1, 3).reshape(T, H * hd), start)


def out_proj(attn: Hidden, wo: np.ndarray, residual: Hidden) -> Hidden:
    """residual + attn wo^T."""
    return Hidden(residual.x + attn.x @ wo.T, residual.start)
