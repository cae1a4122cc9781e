"""Embed: token ids -> rows of the embedding table."""

import numpy as np

import tracelm.kernels as kernels
from tracelm.state.records import Hidden, QMatrix, RowSource


def embed(table: np.ndarray | RowSource | QMatrix, ids: np.ndarray, start: int, scale: float = 1.0) -> Hidden:
    """x[t] = table[ids[t]] * scale for the T positions start..start+T-1 (scale: gemma's sqrt(d)); a QMatrix's
    rows are dequantized (only those of the ids)."""
    if isinstance(table, QMatrix):
        (blocks, qtype), = table.parts
        if table.packed and kernels.packable(qtype, blocks.shape[0]):
            rows = kernels.unpack_rows(blocks, qtype, ids)
        else:
            rows = blocks[np.asarray(ids, np.int64)]
        x = kernels.dequantize(rows, qtype)
    else:
        x = table[ids]
    if scale != 1.0:
        x *= np.float32(scale)
    return Hidden(x, start)
