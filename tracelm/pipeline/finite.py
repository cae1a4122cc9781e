"""Non-finite values caught where they first appear, at the cost of one check per logits row: when a pass's logits
hold NaN or infinity, the sequence is run again on a fresh Cache with every stage's output checked (through the
graph's stage-call hook), and the first layer, stage and token that produced one are named."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import tracelm.kernels as kernels
from tracelm.pipeline.graph import forward, new_cache
from tracelm.pipeline.trace import output_arrays
from tracelm.state.errors import NonFiniteError, TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import ModelWeights


class _Found(Exception):
    def __init__(self, stage: str, layer: int | None, position: int, what: str):
        super().__init__(stage)
        self.stage, self.layer, self.position, self.what = stage, layer, position, what


def first_bad_row(a: np.ndarray) -> int | None:
    """The first row (leading index) of `a` holding a NaN or an infinity, or None."""
    bad = ~np.isfinite(a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(-1, 1)).all(axis=1)
    rows = np.flatnonzero(bad)
    return int(rows[0]) if rows.size else None


def what_is(a: np.ndarray) -> str:
    return "NaN" if np.isnan(a).any() else "infinity"


def checked_call(stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """A stage-call hook that stops at the first stage output holding a non-finite value."""
    out = fn(*args)
    for a in output_arrays(out):
        if a.dtype.kind == "f" and a.size and (row := first_bad_row(a)) is not None:
            start = getattr(out, "start", 0)
            raise _Found(stage, layer, max(start, 0) + row, what_is(a[row]))
    return out


def all_finite(a: np.ndarray) -> bool:
    """np.isfinite(a).all(); float32/float64 logits rows (unit last stride): one pass over the pool, no temporary."""
    if a.dtype in (np.float32, np.float64) and a.ndim in (1, 2) and (a.shape[-1] <= 1 or a.strides[-1] == a.itemsize):
        return kernels.all_finite(a)
    return bool(np.isfinite(a).all())


def check_logits(values: np.ndarray, cfg: ModelConfig, weights: ModelWeights, tokens: Sequence[int],
                 first: int) -> None:
    """Raise a NonFiniteError naming where a non-finite value first appeared unless every logit is finite.
    `values`: the logits rows of a pass whose last row is position len(tokens) - 1; `tokens`: every id the
    sequence holds (its Cache's tokens after the pass); `first`: the position of values' first row."""
    if all_finite(np.asarray(values)):
        return
    row = first_bad_row(np.asarray(values))
    raise locate(cfg, weights, tokens, first + (row or 0), what_is(values))


def locate(cfg: ModelConfig, weights: ModelWeights, tokens: Sequence[int], position: int, what: str
           ) -> NonFiniteError:
    """Run `tokens` again, every stage checked, and name the first stage output holding a non-finite value."""
    try:
        with np.errstate(all="ignore"):
            forward(cfg, weights, new_cache(cfg, max(len(tokens), 1)), list(tokens), False, checked_call)
    except _Found as f:
        layer = f"layer {f.layer}" if f.layer is not None else "outside the layers"
        return NonFiniteError(f"non-finite value ({f.what}) first produced at {layer}, stage {f.stage}, token "
                              f"{f.position} (the logits of token {position} hold {what})")
    except TracelmError:
        pass
    return NonFiniteError(f"the logits of token {position} hold {what} (a re-run with every stage checked found "
                          "no non-finite stage output)")
