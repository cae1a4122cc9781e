"""`tracelm models` and `tracelm export`: the registry's models on disk, and a model written out as one GGUF."""

from __future__ import annotations

from pathlib import Path

from tracelm.io import registry, synth
from tracelm.io.export import export_gguf
from tracelm.io.loader import load_model


def model_lines() -> list[str]:
    """One line per registry model (its name, whether it is downloaded, where it lives), then one per synthetic
    size at seed 0 (written on first use; any seed with `@SEED`, fewer layers with `?layers=N`)."""
    return [f"{name:32s} {'cached' if cached else 'not cached':11s} {path}" for name, cached, path in
            [*registry.list_models(), *synth.list_synth(registry.synth_home())]]


def pull(name: str) -> Path:
    """Download a registry model (checked against its sha256); its path."""
    return registry.pull(name)


def model_path(name: str) -> Path:
    """Where a registry model lives (downloaded or not)."""
    return registry.model_path(name)


def export(model: str, out: str, tokenizer: str | None = None) -> str:
    """Write `model` (any format tracelm reads) as one f32 GGUF file at `out`; a line saying what was written."""
    loaded = load_model(model, tokenizer=tokenizer, compute="reference")  # f32 weights to write
    path = export_gguf(loaded.cfg, loaded.weights, out, loaded.metadata, name=loaded.path.stem)
    return f"{path}: GGUF {loaded.cfg.n_layer} layers, f32"
