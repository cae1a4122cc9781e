"""Embed: token ids -> rows of the embedding table."""

import numpy as np

from tracelm.state.records import Hidden


def embed(table: np.ndarray, ids: np.ndarray, start: int, scale: float = 1.0) -> Hidden:
    """x[t] = table[ids[t]] * scale for the T positions start..start+T-1 (scale: gemma's sqrt(d))."""
    x = table[ids]
    if scale != 1.0:
        x *= np.float32(scale)
    return Hidden(x, start)
