"""`tracelm trace plot TRACE --out F.png`: a trace drawn for a report, with matplotlib (`pip install
'tracelm[plot]'`): one pass's layer x stage grid of a recorded statistic (the web viewer's heat map, log scale, each
cell's value and digest) and a tokens-per-second timeline of the run (from the stage events' durations)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.audit.verify import read_trace, verify
from tracelm.pipeline.trace import decode_rate
from tracelm.state.errors import TracelmError

STAT_NAMES = {"rms": "rms", "maxabs": "max |x|", "dur_us": "time (us)"}


@attrs.define
class StageGrid:
    """One pass's stage events laid out as rows (layers; None: the model-level stages) x columns (stages)."""

    layers: list[int | None]
    stages: list[str]
    values: np.ndarray  # [rows, columns], nan where no event
    digests: list[list[str | None]]


@attrs.define
class Pass:
    """One forward pass: its token index, the stage time it took, the positions it computed, the tokens after it."""

    tok: int
    seconds: float = 0.0
    positions: int = 0
    tokens: int = 0


def _number(v: Any) -> float:
    return float(v) if isinstance(v, int | float) else math.nan  # "nan", "inf" strings and gaps: not drawn


def stage_grid(events: list[dict[str, Any] | None], tok: int, stat: str) -> StageGrid:
    """The grid of pass `tok`: every layer and stage of the trace, the first event of each (layer, stage)."""
    stages: list[str] = []
    layers: set[int | None] = set()
    cells: dict[tuple[int | None, str], dict[str, Any]] = {}
    for e in events:
        if e is None or e.get("event") != "stage":
            continue
        if e["stage"] not in stages:
            stages.append(e["stage"])
        layers.add(e.get("layer"))
        if e.get("tok") == tok:
            cells.setdefault((e.get("layer"), e["stage"]), e)
    rows = sorted(layers, key=lambda x: -1 if x is None else x)
    values = np.full((len(rows), len(stages)), np.nan)
    digests: list[list[str | None]] = [[None] * len(stages) for _ in rows]
    for i, layer in enumerate(rows):
        for j, stage in enumerate(stages):
            e = cells.get((layer, stage))
            if e is not None:
                values[i, j] = _number(e.get(stat))
                digests[i][j] = e.get("digest")
    return StageGrid(rows, stages, values, digests)


def passes(events: list[dict[str, Any] | None]) -> list[Pass]:
    """Every forward pass in order, with its stage time, its positions (the embed stage's) and the tokens sampled
    from it."""
    out: list[Pass] = []
    for e in events:
        kind = (e or {}).get("event")
        if kind == "stage":
            if not out or out[-1].tok != e["tok"] or out[-1].tokens:
                out.append(Pass(e["tok"]))
            if isinstance(e.get("dur_us"), int | float):
                out[-1].seconds += e["dur_us"] / 1e6
            if e["stage"] == "embed":
                out[-1].positions = int(e.get("n") or 0)
        elif kind == "token" and out:
            out[-1].tokens += 1
    return out


def plot_trace(path: Path, out: Path, token: int | None = None, stat: str = "rms") -> str:
    """Draw the trace at `path` into `out`; return a line saying what was drawn."""
    trace = read_trace(path)
    runs = passes(trace.events)
    if not runs:
        raise TracelmError(f"{path}: no stage events to plot (a trace at level summary or digest has them)")
    tok = token if token is not None else next((p.tok for p in runs if p.positions == 1), runs[0].tok)
    if tok not in {p.tok for p in runs}:
        raise TracelmError(f"--token {tok}: the trace has passes {runs[0].tok}..{runs[-1].tok}")
    rate = footer_decode_rate(trace.events)
    figure = _figure(stage_grid(trace.events, tok, stat), runs, tok, stat, f"{path.name}: {verify(trace).message}",
                     rate)
    try:
        figure.savefig(out, dpi=110)
    except (OSError, ValueError) as e:
        raise TracelmError(f"{out}: cannot write the plot: {getattr(e, 'strerror', None) or e}") from None
    said = f"; decode {rate:.1f} tok/s (as trace show)" if rate is not None else ""
    return f"{out}: pass {tok}'s grid of {STAT_NAMES[stat]} and the tokens/s of {len(runs)} passes{said}"


def footer_decode_rate(events: list[dict[str, Any] | None]) -> float | None:
    """The run's decode tokens/s from its footer (`decode_rate`, as `trace show` says it); None without a footer."""
    footer = next((e for e in events if (e or {}).get("event") == "footer"), None)
    n, seconds = (footer or {}).get("n_generated"), (footer or {}).get("decode_seconds")
    if not isinstance(n, int | float) or not isinstance(seconds, int | float) or seconds <= 0:
        return None
    return decode_rate(n, seconds)


def _figure(grid: StageGrid, runs: list[Pass], tok: int, stat: str, title: str, rate: float | None) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TracelmError("tracelm trace plot needs matplotlib: pip install 'tracelm[plot]'") from None
    rows, cols = grid.values.shape
    figure = Figure(figsize=(max(8.0, 1.05 * cols + 2), 0.42 * rows + 5.2), layout="constrained")
    top, bottom = figure.subplots(2, 1, height_ratios=[max(rows, 3), 5])
    _draw_grid(figure, top, grid, f"pass {tok}{' (prefill)' if tok == 0 else ''}: {STAT_NAMES[stat]} per stage")
    _draw_rates(bottom, runs, rate)
    figure.suptitle(title, fontsize=9)
    return figure


def _draw_grid(figure: Any, ax: Any, grid: StageGrid, title: str) -> None:
    from matplotlib.colors import LogNorm

    values = np.where(grid.values > 0, grid.values, np.nan)
    finite = values[np.isfinite(values)]
    norm = LogNorm(finite.min(), finite.max()) if finite.size and finite.min() < finite.max() else None
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", norm=norm, aspect="auto")
    ax.set_xticks(range(len(grid.stages)), grid.stages, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(grid.layers)), ["model" if x is None else f"layer {x}" for x in grid.layers], fontsize=8)
    ax.set_title(title, fontsize=10)
    figure.colorbar(image, ax=ax, shrink=0.9)
    if grid.values.size > 400:
        return
    for (i, j), v in np.ndenumerate(grid.values):
        if math.isnan(v):
            continue
        digest = grid.digests[i][j]
        ax.text(j, i, f"{v:.3g}\n{digest[:8]}" if digest else f"{v:.3g}", ha="center", va="center", fontsize=6,
                color="white" if norm is None or norm(v) < 0.6 else "black")


def _draw_rates(ax: Any, runs: list[Pass], rate: float | None) -> None:
    """Each pass's rate over its stage time alone (the stages' own compute, no sampling or tracing), and the run's
    decode tokens/s over wall time (the footer's: the figure `trace show` and `tracelm run` print)."""
    ends = np.cumsum([p.seconds for p in runs])
    decode = [(t, p.tokens / p.seconds) for t, p in zip(ends, runs, strict=True) if p.positions <= 1 and p.seconds]
    prefill = [(t, p.positions / p.seconds) for t, p in zip(ends, runs, strict=True) if p.positions > 1 and p.seconds]
    if decode:
        ax.plot(*zip(*decode, strict=True), marker=".", markersize=3, linewidth=1,
                label="decode pass: tokens / its stage time")
    if rate is not None:
        ax.axhline(rate, color="grey", linestyle="--", linewidth=1,
                   label=f"decode {rate:.1f} tokens/s (wall time, with tracing; as trace show)")
    if prefill:
        ax.scatter(*zip(*prefill, strict=True), color="tab:orange", s=18, zorder=3, label="prefill: positions/s")
    ax.set_xlabel("stage time so far (s)")
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log" if prefill and decode else "linear")
    ax.set_title("tokens per second over the run (per pass: its stage events' durations)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
