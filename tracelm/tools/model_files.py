"""`tracelm models`, `tracelm export` and `tracelm quantize`: the models on disk, and a model written out as one
GGUF."""

from __future__ import annotations

from pathlib import Path

from tracelm.io import registry
from tracelm.io.export import export_gguf, vocab_metadata
from tracelm.io.loader import ModelFile
from tracelm.io.quantize import quant_type


def model_lines() -> list[str]:
    """One line per registry model: its name, whether it is downloaded, and where it lives."""
    return [f"{name:32s} {'cached' if cached else 'not cached':11s} {path}" for name, cached, path in
            registry.list_models()]


def pull(name: str) -> Path:
    """Download a registry model (checked against its sha256); its path."""
    return registry.pull(name)


def model_path(name: str) -> Path:
    """Where a registry model lives (downloaded or not)."""
    return registry.model_path(name)


def export(model: str, out: str, tokenizer: str | None = None, qtype: str | None = None,
           progress: bool = True) -> str:
    """Write `model` (any format tracelm reads) as one GGUF file at `out`, f32 or quantized to `qtype` (q8_0, q4_0,
    q4_k, ...), with its vocabulary and chat template; a line saying what was written. A GGUF's or a folder's
    tensors are read, quantized and written one at a time; a llama2.c checkpoint is loaded whole first."""
    qt = None if qtype is None else quant_type(qtype)
    src = ModelFile(model, tokenizer)
    meta = vocab_metadata(src.path, src.kind, src.metadata, tokenizer, src.cfg.n_vocab)
    if src.kind == "gguf":
        weights = src.gguf
    elif src.kind == "hf":
        weights = src.hf
    else:
        weights = src.load(progress=False, compute="reference").weights
    path = export_gguf(src.cfg, weights, out, meta, name=src.path.stem, qtype=qt, progress=progress)
    size = Path(path).stat().st_size
    vocab = f"{len(meta['tokenizer.ggml.tokens'])} tokens" if "tokenizer.ggml.tokens" in meta else "no vocabulary"
    return f"{path}: GGUF {src.cfg.n_layer} layers, {qtype or 'f32'}, {vocab}, {size / 2**20:.1f} MiB"
