"""Streamed weights: a GGUF's tensors stay quantized in the memory-mapped file and are dequantized when a
stage needs them, for boxes with little RAM.

- Block i's LayerWeights are made when `weights.layers[i]` is read, by the same `layer_weights` the
  resident loader uses, into one scratch buffer of one block's f32 size: reading block i + 1 overwrites
  block i (the graph reads them in order and drops each before the next).
- The head is a RowSource: `linear_rows` dequantizes a block of its rows into the same scratch buffer,
  multiplies, and goes on to the next block (Qwen2.5's 151936 x 896 head would take 545 MB in f32).
- The embedding lookup dequantizes only the rows of the token ids.

Every number is the resident mode's: the same dequantization of the same rows, the same products
(`linear`, and `linear_rows` for the head). One forward pass at a time: two passes at once would
overwrite each other's scratch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from tracelm.io.gguf_file import GGUFFile
from tracelm.io.weights import LayerPlan, aligned_f32, layer_plan, layer_weights, plan_values
from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights, RowSource


class StreamedLayers(Sequence[LayerWeights]):
    """The blocks' LayerWeights, each made on access into one reused scratch buffer."""

    def __init__(self, gf: GGUFFile, plans: list[LayerPlan], scratch: np.ndarray):
        self.gf, self.plans, self.scratch = gf, plans, scratch

    def __len__(self) -> int:
        return len(self.plans)

    @overload
    def __getitem__(self, i: int) -> LayerWeights: ...
    @overload
    def __getitem__(self, i: slice) -> list[LayerWeights]: ...

    def __getitem__(self, i: int | slice) -> LayerWeights | list[LayerWeights]:
        if isinstance(i, slice):
            raise TypeError("streamed layers are made one at a time: index them one by one")
        return layer_weights(self.gf, self.plans[i], self.scratch)

    def __iter__(self) -> Iterator[LayerWeights]:
        for i in range(len(self.plans)):
            yield self[i]

    @property
    def nbytes(self) -> int:
        """Bytes of every block's weights in f32 (what resident mode holds)."""
        return 4 * sum(int(np.prod(shape)) for plan in self.plans for _names, shape in plan.values())

    @property
    def layer_nbytes(self) -> int:
        """Bytes of the largest block in f32: the scratch buffer, the one block held at a time."""
        return self.scratch.nbytes


def row_source(gf: GGUFFile, name: str, shape: tuple[int, int], scratch: np.ndarray) -> RowSource:
    """A matrix tensor as a RowSource whose blocks of rows are dequantized into `scratch`."""
    t = gf.info(name)
    if t.shape != shape:
        raise TracelmError(f"{gf.name}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
    gf.raw_rows(name)  # rows must be whole quantization blocks
    cols = shape[1]
    max_rows = scratch.size // cols

    def rows(lo: int, hi: int) -> np.ndarray:
        out = scratch[: (hi - lo) * cols].reshape(hi - lo, cols) if hi - lo <= max_rows else None
        return gf.rows_f32(name, lo, hi, out)

    return RowSource(shape, max_rows, rows, lambda ids: gf.take_f32(name, ids))


def streamed_weights(gf: GGUFFile, cfg: ModelConfig) -> ModelWeights:
    """The file's weights as streamed ModelWeights: every tensor's shape is checked now, no matrix is read.
    Holds one scratch buffer of the largest block's f32 size (and the small output norm)."""
    plans = [layer_plan(gf, cfg, i) for i in range(cfg.n_layer)]
    scratch = aligned_f32(max(plan_values(p) for p in plans) if plans else 16)
    shape = (cfg.n_vocab, cfg.n_embd)
    embd = row_source(gf, "token_embd.weight", shape, scratch)
    output = embd if cfg.tied_head else row_source(gf, "output.weight", shape, scratch)
    output_norm = gf.tensor_f32("output_norm.weight")
    if output_norm.shape != (cfg.n_embd,):
        raise TracelmError(f"{gf.name}: tensor output_norm.weight has shape {list(output_norm.shape)}, "
                           f"expected [{cfg.n_embd}]")
    return ModelWeights(token_embd=embd, layers=StreamedLayers(gf, plans, scratch), output_norm=output_norm,
                        output=output)
