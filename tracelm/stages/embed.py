"""Embed: token ids -> rows of the embedding table."""

import numpy as np

from tracelm.state.records import Hidden


def embed(table: np.ndarray, ids: np.ndarray, start: int) -> Hidden:
    """x[t] = table[ids[t]] for the T positions start..start+T-1."""
    return Hidden(table[ids], start)
