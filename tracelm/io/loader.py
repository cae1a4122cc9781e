"""Load a model by registry name or path: config and tokenizer first, then resident f32 weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs

from tracelm import TracelmError
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
    """The tokenizer of a model name or a file, by its kind: a GGUF (a whole model or vocabulary only), a
    SentencePiece `.model`, a Hugging Face `tokenizer.json` (or a folder holding one), a llama2.c `.bin`."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return load_tokenizer(str(p / name))
        raise TracelmError(f"{p}: folder has no tokenizer.json or tokenizer.model")
    if not p.is_file():
        p = Path(registry.resolve(name_or_path))
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TracelmError(f"{p}: cannot read: {e.strerror}") from None
    if magic == b"GGUF" or p.suffix == ".gguf":
        gf = GGUFFile(p)
        return Tokenizer.from_gguf_metadata(gf.metadata, source=gf.name)
    if p.suffix == ".json":
        return Tokenizer.from_hf_json(p)
    if p.suffix == ".model":
        return Tokenizer.from_sentencepiece(p)
    if p.suffix == ".bin":
        return Tokenizer.from_llama2c(p)
    raise TracelmError(f"{p.name}: not a tokenizer tracelm knows (a GGUF, a SentencePiece .model, a "
                       "tokenizer.json or a llama2.c tokenizer.bin)")
