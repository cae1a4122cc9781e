"""Feed-forward block: SwiGLU (Shazeer 2020), down(silu(gate x) * up x), plus the residual."""

import numpy as np

from tracelm.state.records import Hidden


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x); exp(-x) overflowing to inf for very negative x correctly gives -0."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def ffn(h: Hidden, w_gate_up: np.ndarray, w_down: np.ndarray, residual: Hidden) -> Hidden:
    """residual + w_down (silu(w_gate h) * (w_up h)); w_gate_up is [gate; up] stacked by rows."""
    gate_up = h.x @ w_gate_up.T
    n_ff = w_down.shape[1]
    act = silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:]
    return Hidden(residual.x + act @ w_down.T, residual.start)
