"""Head: final hidden states -> logits over the vocabulary."""

import numpy as np

from tracelm.stages.linear import linear
from tracelm.state.records import Hidden, Logits


def head(h: Hidden, w_out: np.ndarray) -> Logits:
    """logits = x w_out^T; w_out is [vocab, d] (the embedding table when tied)."""
    return Logits(linear(h.x, w_out), h.start)
