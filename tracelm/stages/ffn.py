"""Feed-forward block: SwiGLU (Shazeer 2020), down(silu(gate x) * up x), plus the residual."""

import math

import numpy as np

from tracelm.stages.linear import linear
from tracelm.state.records import Hidden


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) = x / (1 + exp(-x)), in one new array. -x is capped at 88 so that exp stays finite
    (float32 overflows past 88.7): for x < -88 that gives x / 1.7e38, about -5e-37, where silu is -88 e^-88
    or less in size -- 0 in float32 terms -- without numpy's overflow warning (np.errstate costs more per call
    than the cap)."""
    e = np.negative(x)
    np.minimum(e, 88.0, out=e)
    np.exp(e, out=e)
    e += 1.0
    return np.divide(x, e, out=e)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in one new array."""
    inner = x * x
    inner *= np.float32(0.044715)
    inner += 1.0
    inner *= x
    inner *= np.float32(math.sqrt(2.0 / math.pi))
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= x
    inner *= np.float32(0.5)
    return inner


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def ffn(h: Hidden, w_gate_up: np.ndarray, w_down: np.ndarray, residual: Hidden | None,
        act: str = "silu") -> Hidden:
    """residual + w_down (act(w_gate h) * (w_up h)); w_gate_up is [gate; up] stacked by rows.
    act "silu" is SwiGLU, "gelu_tanh" GeGLU; residual None returns the block output alone (post-norm)."""
    gate_up = linear(h.x, w_gate_up)
    n_ff = w_down.shape[1]
    a = ACTIVATIONS[act](gate_up[:, :n_ff])
    a *= gate_up[:, n_ff:]
    out = linear(a, w_down)
    if residual is None:
        return Hidden(out, h.start)
    out += residual.x
    return Hidden(out, residual.start)
