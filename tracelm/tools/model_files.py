"""`tracelm models`, `tracelm export` and `tracelm quantize`: the models on disk, and a model written out as one
GGUF."""

from __future__ import annotations

from pathlib import Path

from tracelm.io import hub, registry, synth
from tracelm.io.export import export_gguf, vocab_metadata
from tracelm.io.loader import ModelFile
from tracelm.io.quantize import quant_type


def model_lines() -> list[str]:
    """One line per model tracelm can name: the registry's (downloaded or not), one per synthetic size at seed 0
    (written on first use; any seed with `@SEED`, fewer layers with `?layers=N`), then those of the local Hugging
    Face cache and of Ollama's, each with the name --model takes and where it lives."""
    lines = [f"{name:40s} {'cached' if cached else 'not cached':11s} {path}" for name, cached, path in
             [*registry.list_models(), *synth.list_synth(registry.synth_home())]]
    lines += [f"{name:40s} {'hf cache':11s} {path}" for name, path in hub.hf_cache_models()]
    lines += [f"{name:40s} {'ollama':11s} {path}" for name, path in hub.ollama_models()]
    return lines


def pull(name: str, progress: bool = True) -> Path:
    """Download a registry model (checked against its sha256), or `[hf:]ORG/REPO[:FILE or :QUANT]` from the Hugging
    Face Hub into its cache; its path."""
    if name in registry.MODELS:
        return registry.pull(name, progress=progress)
    return hub.pull(name if name.startswith("hf:") else f"hf:{name}", progress=progress)


def model_path(name: str) -> Path:
    """Where a model lives: a registry model's file (downloaded or not), or a model in the local caches."""
    if name in registry.MODELS:
        return registry.model_path(name)
    return registry.resolve(name, download=False)


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
