"""Load a model by registry name or path: config, resident f32 weights and tokenizer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs

from tracelm.io import registry
from tracelm.io.gguf_file import GGUFFile, load_weights, model_config
from tracelm.io.tokenizer import Tokenizer
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import ModelWeights


@attrs.frozen
class LoadedModel:
    path: Path
    cfg: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # GGUF metadata without the vocabulary arrays
    load_seconds: float

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


def load_model(name_or_path: str, progress: bool = True) -> LoadedModel:
    path = registry.resolve(name_or_path)
    t0 = time.perf_counter()
    gf = GGUFFile(path)
    cfg = model_config(gf)
    tokenizer = Tokenizer.from_gguf_metadata(gf.metadata, source=gf.name)
    weights = load_weights(gf, cfg, progress=progress)
    meta = {k: v for k, v in gf.metadata.items() if not isinstance(v, list) or len(v) < 256}
    return LoadedModel(Path(path), cfg, weights, tokenizer, meta, time.perf_counter() - t0)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    gf = GGUFFile(registry.resolve(name_or_path))
    return Tokenizer.from_gguf_metadata(gf.metadata, source=gf.name)
