"""The stages on the compiled kernels (`compute: kernels`): the same records in and out as their numpy statements
in norm.py, attention.py and ffn.py, each the one kernel call that computes it in the kernels' fixed order
(tracelm/kernels/kernels.h): the same bits on either CPU path, at any thread count, for a row alone or in a
pass. The numpy functions stay the readable statement of the math these are tested against."""

from __future__ import annotations

import numpy as np

import tracelm.kernels as kernels
from tracelm.stages.linear import linear
from tracelm.state.records import Heads, Hidden


def rms_norm(h: Hidden, weight: np.ndarray, eps: float) -> Hidden:
    """norm.rms_norm: x / sqrt(mean(x^2) + eps) * weight, per row."""
    return Hidden(kernels.rms_norm(h.x, weight, eps), h.start)


def post_norm(h: Hidden, weight: np.ndarray, eps: float, residual: Hidden) -> Hidden:
    """norm.post_norm: residual + RMSNorm(h)."""
    return Hidden(kernels.rms_norm_add(h.x, weight, eps, residual.x), residual.start)


def qk_norm(heads: Heads, q_weight: np.ndarray, k_weight: np.ndarray, eps: float) -> Heads:
    """attention.qk_norm: RMSNorm of every head of q and of k over its head_dim values."""
    return Heads(kernels.rms_norm(heads.q, q_weight, eps), kernels.rms_norm(heads.k, k_weight, eps), heads.v,
                 heads.start)


def rope(heads: Heads, cos: np.ndarray, sin: np.ndarray, mode: str) -> Heads:
    """attention.rope: q and k rotated by their positions' angles (bit for bit attention.rotate)."""
    return Heads(kernels.rope(heads.q, cos, sin, mode), kernels.rope(heads.k, cos, sin, mode), heads.v, heads.start)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, spans: np.ndarray, scale: float,
           start: int) -> Hidden:
    """attention.attend: softmax(q k^T * scale) v per head, grouped-query, query row t over the keys
    spans[t, 0]..spans[t, 1]-1 (Cache.window_spans: the keys its causal or window mask leaves visible)."""
    return Hidden(kernels.attend(q, keys, values, spans, scale), start)


ACTIVATIONS = {"silu": kernels.silu_mul, "gelu_tanh": kernels.gelu_tanh_mul}


def ffn(h: Hidden, w_gate_up: np.ndarray, w_down: np.ndarray, residual: Hidden | None,
        act: str = "silu") -> Hidden:
    """ffn.ffn: residual + w_down (act(w_gate h) * (w_up h)), the activation and product fused in one pass."""
    gate_up = linear(h.x, w_gate_up)
    out = linear(ACTIVATIONS[act](gate_up, w_down.shape[1]), w_down)
    if residual is None:
        return Hidden(out, h.start)
    out += residual.x
    return Hidden(out, residual.start)
