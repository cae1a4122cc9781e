"""RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, over the last axis."""

import numpy as np

from tracelm.state.records import Hidden


def rms_normalize(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    mean_sq = np.vecdot(x, x)[..., None] / x.shape[-1]  # a dot product per row (einsum costs more per call)
    out = x * (1.0 / np.sqrt(mean_sq + eps))
    out *= weight
    return out


def rms_norm(h: Hidden, weight: np.ndarray, eps: float) -> Hidden:
    return Hidden(rms_normalize(h.x, weight, eps).astype(np.float32, copy=False), h.start)


def post_norm(h: Hidden, weight: np.ndarray, eps: float, residual: Hidden) -> Hidden:
    """residual + RMSNorm(h): the norm of a block's output before its residual add (gemma's post-norms)."""
    out = rms_normalize(h.x, weight, eps)
    out += residual.x
    return Hidden(out.astype(np.float32, copy=False), residual.start)
