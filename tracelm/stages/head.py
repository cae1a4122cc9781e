"""Head: final hidden states -> logits over the vocabulary."""

import numpy as np

from tracelm.stages.linear import linear, linear_rows
from tracelm.state.records import Hidden, Logits, RowSource


def head(h: Hidden, w_out: np.ndarray | RowSource) -> Logits:
    """logits = x w_out^T; w_out is [vocab, d] (the embedding table when tied), or streamed a block of rows
    at a time."""
    if isinstance(w_out, RowSource):
        return Logits(linear_rows(h.x, w_out), h.start)
    return Logits(linear(h.x, w_out), h.start)
