"""Pool: the final hidden states of a text's positions -> one embedding vector (llama-server's `--pooling`).

`mean` averages every position's row; `last` takes the last position's row (what a causal model has read the whole
text by). The vector is scaled to unit length (Euclidean), as OpenAI's and llama-server's embeddings are.
"""

from __future__ import annotations

import numpy as np

POOLINGS = ("mean", "last")


def pool(x: np.ndarray, pooling: str) -> np.ndarray:
    """x f32 [T, d] (T >= 1) -> the unit-length f32 [d] embedding of its rows under `pooling` (mean or last)."""
    if pooling == "mean":
        v = x.astype(np.float64).mean(axis=0)
    elif pooling == "last":
        v = x[-1].astype(np.float64)
    else:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    norm = np.sqrt(np.dot(v, v))
    return (v / norm if norm > 0 else v).astype(np.float32)
