"""Load a model by registry name or path: config and tokenizer first, then resident f32 weights."""

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


class ModelFile:
    """An opened model file whose config and tokenizer are read but whose weights are not yet loaded,
    so a prompt can be checked against the context before the expensive part."""

    def __init__(self, name_or_path: str):
        self.t0 = time.perf_counter()
        self.path = Path(registry.resolve(name_or_path))
        self.gguf = GGUFFile(self.path)
        self.cfg = model_config(self.gguf)
        self.tokenizer = Tokenizer.from_gguf_metadata(self.gguf.metadata, source=self.gguf.name)

    def load(self, progress: bool = True) -> LoadedModel:
        weights = load_weights(self.gguf, self.cfg, progress=progress)
        meta = {k: v for k, v in self.gguf.metadata.items() if not isinstance(v, list) or len(v) < 256}
        return LoadedModel(self.path, self.cfg, weights, self.tokenizer, meta, time.perf_counter() - self.t0)


def load_model(name_or_path: str, progress: bool = True) -> LoadedModel:
    return ModelFile(name_or_path).load(progress)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    gf = GGUFFile(registry.resolve(name_or_path))
    return Tokenizer.from_gguf_metadata(gf.metadata, source=gf.name)
