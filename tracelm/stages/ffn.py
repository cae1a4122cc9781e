"""Feed-forward block: SwiGLU (Shazeer 2020), down(silu(gate x) * up x), plus the residual."""

import numpy as np

from tracelm.state.records import Hidden


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) = x / (1 + exp(-x)), in one new array; exp(-x) overflowing to inf for very
    negative x correctly gives -0."""
    e = np.negative(x)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += 1.0
    return np.divide(x, e, out=e)


def ffn(h: Hidden, w_gate_up: np.ndarray, w_down: np.ndarray, residual: Hidden) -> Hidden:
    """residual + w_down (silu(w_gate h) * (w_up h)); w_gate_up is [gate; up] stacked by rows."""
    gate_up = h.x @ w_gate_up.T
    n_ff = w_down.shape[1]
    act = silu(gate_up[:, :n_ff])
    act *= gate_up[:, n_ff:]
    out = act @ w_down.T
    out += residual.x
    return Hidden(out, residual.start)
