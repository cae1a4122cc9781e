"""Load a model by registry name or path: config and tokenizer first, then the weights (for the kernels as
the file's blocks, or in f32 for the numpy reference; resident, or streamed from a GGUF file)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import tracelm.kernels as kernels
from tracelm.io import registry
from tracelm.io.chat_template import chat_template_from_metadata
from tracelm.io.gguf_file import GGUFFile, model_config
from tracelm.io.tokenizer import Tokenizer
from tracelm.io.tokenizer_formats import from_gguf_metadata, from_hf_json, from_llama2c, from_sentencepiece
from tracelm.io.weights import check_blocks, kernel_weights, load_weights
from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import ModelWeights, QMatrix
from tracelm.state.run_config import COMPUTE_MODES, WEIGHT_MODES


@attrs.frozen
class LoadedModel:
    path: Path
    cfg: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # GGUF metadata without the vocabulary arrays
    load_seconds: float
    tokenizer_path: Path | None = None  # where the tokenizer came from when not the model file itself
    rope_scale: float = 1.0  # the linear RoPE scaling applied to cfg (see `scaled_rope`)
    template_override: str | None = None  # a run config's chat_template, as Jinja text (session.as_configured)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template, decided here for chat, the server, batch and Session: the run config's
        `chat_template` when it has one, else the GGUF's `tokenizer.chat_template`, else its tokenizer's (a Hugging
        Face folder's `chat_template.jinja` or `tokenizer_config.json`); None: the built-in one for the vocabulary
        (`builtin_template_for`)."""
        return self.template_override or chat_template_from_metadata(self.metadata) or self.tokenizer.chat_template


class ModelFile:
    """An opened model file whose config and tokenizer are read but whose weights are not yet loaded,
    so a prompt can be checked against the context before the expensive part."""

    def __init__(self, name_or_path: str, tokenizer: str | None = None):
        """A GGUF file, a Hugging Face folder (config.json + safetensors) or a llama2.c `.bin`, by its kind;
        `tokenizer` (any file `load_tokenizer` reads) replaces the model's own (a llama2.c `.bin` has none)."""
        self.t0 = time.perf_counter()
        p = Path(name_or_path).expanduser()
        self.path = p if p.is_dir() else Path(registry.resolve(name_or_path))
        self.kind = model_kind(self.path)
        self.gguf = None
        if self.kind == "gguf":
            self.gguf = GGUFFile(self.path)
            self.cfg = model_config(self.gguf)
            self.metadata = self.gguf.metadata
            check_blocks(self.gguf, self.cfg, f"{self.cfg.arch}.block_count")
        elif self.kind == "llama2c":
            from tracelm.io.llama2c import Llama2cFile

            self.llama2c = Llama2cFile(self.path)
            self.cfg, self.metadata = self.llama2c.cfg, self.llama2c.metadata
        else:
            from tracelm.io.safetensors_file import HFFolder

            self.hf = HFFolder(self.path)
            self.cfg, self.metadata = self.hf.cfg, self.hf.metadata
            check_blocks(self.hf, self.cfg, "config.json: num_hidden_layers")
        self.tokenizer_path = Path(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:
            self.tokenizer = load_tokenizer(tokenizer)
        elif self.kind == "gguf":
            self.tokenizer = from_gguf_metadata(self.gguf.metadata, source=self.gguf.name)
        elif self.kind == "hf":
            self.tokenizer = load_tokenizer(str(self.path))
        else:
            raise TracelmError(f"{self.path.name}: a llama2.c checkpoint holds no vocabulary: name its "
                               "tokenizer.bin (config key `tokenizer`, or --tokenizer)")
        if self.tokenizer.n_vocab > self.cfg.n_vocab:
            raise TracelmError(f"{self.tokenizer.source or tokenizer}: tokenizer has {self.tokenizer.n_vocab} "
                               f"tokens, the model only {self.cfg.n_vocab}")

    def weights_bytes(self, weights: str = "resident", compute: str = "kernels", quantize: str | None = None) -> int:
        """About how much memory loading the weights takes: none streamed (the file stays mapped), the file's
        bytes for the kernels (its own blocks; quantized: the blocks they become), 4 bytes a value for the f32
        reference."""
        if weights == "streamed":
            return 0
        if quantize is not None and self.kind != "llama2c":
            from tracelm.io.quantize import FLOAT_TYPES, quant_type, row_bytes, tensor_type

            qt = quant_type(quantize)
            src = self.gguf if self.kind == "gguf" else self.hf
            return sum(t.n_bytes if t.qtype not in FLOAT_TYPES or len(t.shape) != 2 else
                       t.shape[0] * row_bytes(t.shape[1], tensor_type(n, t.shape, qt, self.cfg.tied_head))
                       for n, t in src.tensors.items())
        if compute == "kernels" or self.kind == "llama2c":
            files = self.path.iterdir() if self.path.is_dir() else [self.path]
            return sum(f.stat().st_size for f in files if f.is_file())
        tensors = self.gguf.tensors if self.kind == "gguf" else self.hf.tensors
        return 4 * sum(math.prod(t.shape) for t in tensors.values())

    def load(self, progress: bool = True, weights: str = "resident", compute: str = "kernels",
             rope_scale: float = 1.0, quantize: str | None = None) -> LoadedModel:
        """`compute="kernels"`: the matrices as the file's own blocks (QMatrix) for the compiled kernels -- a
        GGUF's quantized blocks, copied into one arena (resident) or read from the mapped file (streamed);
        f32 ones for the other formats. `compute="reference"`: every weight resident in f32, or streamed (a
        GGUF only) from the mapped file, dequantized a block at a time as the graph runs (tracelm.io.streamed).
        `quantize` (q8_0, q4_0, q4_k, ...: resident weights on the kernels): the float matrices quantized as they
        are read (tracelm.io.quantize)."""
        qtype = self._quantize_type(quantize, weights, compute)
        if weights not in WEIGHT_MODES:
            raise TracelmError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
        if compute not in COMPUTE_MODES:
            raise TracelmError(f"compute {compute!r}: expected one of {', '.join(COMPUTE_MODES)}")
        if weights == "streamed" and self.kind != "gguf":
            raise TracelmError(f"{self.path.name}: streamed weights need a GGUF file (this is a "
                               f"{'Hugging Face folder' if self.kind == 'hf' else 'llama2.c checkpoint'}); "
                               "use weights: resident, or `tracelm export` it to a GGUF")
        # the vocabulary-sized arrays (tokens, merges, scores) stay out of the loaded model and go from this file's
        # metadata before the weights come in, so the two are never resident together: the tokenizer keeps its own
        # compact tables (Gemma 3's 262K tokens were ~20 MB of Python strings, a 7B's 150K tokens and merges ~12 MB).
        # Export reads a ModelFile's metadata before any load.
        vocab = [k for k, v in self.metadata.items() if isinstance(v, list | np.ndarray) and len(v) >= 256]
        meta = {k: v for k, v in self.metadata.items() if k not in vocab}
        for k in vocab:
            del self.metadata[k]
        if self.kind != "llama2c" and compute == "kernels":
            source = self.gguf if self.kind == "gguf" else self.hf
            weights_ = kernel_weights(source, self.cfg, streamed=weights == "streamed", progress=progress,
                                      quantize=qtype)
        elif weights == "streamed":
            from tracelm.io.streamed import streamed_weights

            weights_ = streamed_weights(self.gguf, self.cfg)
        elif self.kind == "gguf":
            weights_ = load_weights(self.gguf, self.cfg, progress=progress)
        elif self.kind == "llama2c":
            from tracelm.io.llama2c import load_weights as load_llama2c

            weights_ = load_llama2c(self.llama2c)
        else:
            weights_ = self.hf.load_weights(progress=progress)
        if compute == "kernels" and self.kind == "llama2c":
            weights_ = f32_kernel_weights(weights_)
        return LoadedModel(self.path, scaled_rope(self.cfg, rope_scale), weights_, self.tokenizer, meta,
                           time.perf_counter() - self.t0, self.tokenizer_path, rope_scale)


    def _quantize_type(self, quantize: str | None, weights: str, compute: str) -> Any:
        """The GGML type `quantize` names, None for none; a TracelmError where it cannot apply."""
        if quantize is None:
            return None
        from tracelm.io.quantize import quant_type

        qtype = quant_type(quantize)
        if compute != "kernels" or weights != "resident" or self.kind == "llama2c":
            here = "a llama2.c checkpoint" if self.kind == "llama2c" else f"weights {weights}, compute {compute}"
            raise TracelmError(f"{self.path.name}: quantize {quantize} applies to a GGUF's or a folder's resident "
                               f"weights on the kernels (here: {here}); `tracelm quantize` writes a quantized GGUF")
        return qtype


def scaled_rope(cfg: ModelConfig, scale: float) -> ModelConfig:
    """The config with linear RoPE scaling (position interpolation): every frequency divided by `scale`, on top of
    the model's own per-pair factors (llama 3's)."""
    if scale == 1.0:
        return cfg
    factors = cfg.rope_freq_factors or (1.0,) * (cfg.rope_dim // 2)
    return attrs.evolve(cfg, rope_freq_factors=tuple(f * scale for f in factors))


def f32_kernel_weights(w: ModelWeights) -> ModelWeights:
    """f32 ModelWeights with every matrix as a one-part F32 QMatrix over the same memory (the kernels' F32
    product: the same bits at any batch and thread count)."""
    def wrap(a: np.ndarray) -> QMatrix:
        return QMatrix(a.shape, ((np.ascontiguousarray(a).view(np.uint8), kernels.F32),))

    layers = tuple(attrs.evolve(lw, **{f: wrap(getattr(lw, f)) for f in ("wqkv", "wo", "w_gate_up", "w_down")})
                   for lw in w.layers)
    embd = wrap(w.token_embd)
    output = embd if w.output is w.token_embd else wrap(w.output)
    return attrs.evolve(w, token_embd=embd, layers=layers, output=output)


def model_kind(path: Path) -> str:
    """"gguf", "hf" (a folder with config.json) or "llama2c" (anything else: checked by its header)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TracelmError(f"{path}: folder has no config.json (a Hugging Face model folder needs one)")
        return "hf"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TracelmError(f"{path}: cannot open model file: {e.strerror}") from None
    return "gguf" if magic == b"GGUF" or path.suffix == ".gguf" else "llama2c"


def load_model(name_or_path: str, progress: bool = True, tokenizer: str | None = None,
               weights: str = "resident", compute: str = "kernels") -> LoadedModel:
    """`weights`: "resident" or "streamed" (a GGUF's weights read from the mapped file as the graph runs);
    `compute`: "kernels" (the compiled kernels on the file's blocks) or "reference" (numpy on f32)."""
    return ModelFile(name_or_path, tokenizer).load(progress, weights, compute)


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
        if p.is_dir():  # a Hugging Face folder from the Hub or a cache
            return load_tokenizer(str(p))
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TracelmError(f"{p}: cannot read: {e.strerror}") from None
    if magic == b"GGUF" or p.suffix == ".gguf":
        gf = GGUFFile(p)
        return from_gguf_metadata(gf.metadata, source=gf.name)
    if p.suffix == ".json":
        return from_hf_json(p)
    if p.suffix == ".model":
        return from_sentencepiece(p)
    if p.suffix == ".bin":
        return from_llama2c(p)
    raise TracelmError(f"{p.name}: not a tokenizer tracelm knows (a GGUF, a SentencePiece .model, a "
                       "tokenizer.json or a llama2.c tokenizer.bin)")
