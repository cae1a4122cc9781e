"""Hugging Face model folders: config.json -> ModelConfig, safetensors (one file or sharded with
model.safetensors.index.json) memory-mapped, tensors renamed onto the canonical GGUF names.

An `HFFolder` offers what `weights.load_weights` reads from a GGUF (`name`, `tensors` with shapes and
sizes, `tensor_f32`), so both formats share one weight builder. The safetensors header (8-byte length,
then JSON: name -> dtype, shape, byte offsets) is read here because numpy has no bfloat16 for the
`safetensors` package to hand back; BF16 is widened to f32 by a 16-bit shift, F16 by numpy.

Conventions undone on the way: Gemma stores RMSNorm weights as w with the scale 1 + w (GGUF stores
1 + w: the family's norm offset); Hugging Face rotates halves (NEOX RoPE) for every family, so rope_mode is
"neox". The family facts (model_types, options, tensor names) come from tracelm.io.families.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.io import checks
from tracelm.io.families import BY_ARCH, BY_HF_MODEL_TYPE, HF_WRAPPER_TYPES, gguf_name
from tracelm.io.files import MiB, read_regular_text
from tracelm.state.errors import ModelFormatError, TracelmError
from tracelm.state.model_config import ModelConfig

MAX_JSON_BYTES = 64 * MiB  # config.json, the shards' index: larger is no model folder's
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

@attrs.frozen
class STensor:
    name: str  # the Hugging Face name
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def qtype(self) -> int | None:
        """The GGML type number of the same values (F32, F16, BF16), for the kernels; None for another dtype."""
        return GGML_TYPES.get(self.dtype)


GGML_TYPES = {"F32": 0, "F16": 1, "BF16": 30}


def read_header(path: Path) -> dict[str, STensor]:
    """The tensors a safetensors file's header lists, each entry checked: a JSON object of entries with a dtype,
    a shape of positive integers and data_offsets [begin, end] ordered, inside the data, of the size the dtype and
    shape make."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelFormatError(f"{path.name}: not a safetensors file (only {len(raw)} bytes)")
            n = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if n > size - 8:
                raise ModelFormatError(f"{path.name}: truncated or corrupt safetensors file (header of {n} bytes)")
            text = f.read(n)
    except OSError as e:
        raise TracelmError(f"{path}: cannot read: {e.strerror}") from None
    header = checks.json_object(text, f"{path.name}: safetensors header")
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end, dtype, dims = _entry(info, f"{path.name}: tensor {name}", data_size)
        out[name] = STensor(name, path, dtype, dims, 8 + n + begin, end - begin)
    return out


def _entry(info: Any, where: str, data_size: int) -> tuple[int, int, str, tuple[int, ...]]:
    """One header entry checked: (begin, end, dtype, shape)."""
    info = checks.mapping(info, where)
    dtype = checks.string(info.get("dtype"), f"{where}: dtype")
    dims = checks.shape(info.get("shape"), where)
    offsets = info.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise ModelFormatError(f"{where}: data_offsets: expected [begin, end], got {checks.kind(offsets)}")
    begin = checks.integer(offsets[0], f"{where}: data_offsets begin", lo=0)
    end = checks.integer(offsets[1], f"{where}: data_offsets end", lo=begin)
    if end > data_size:
        raise ModelFormatError(f"{where}: truncated safetensors file: data_offsets end {end} is past the "
                               f"{data_size} bytes of data")
    dt = DTYPES.get(dtype)
    if dt is not None and math.prod(dims) * dt.itemsize != end - begin:
        raise ModelFormatError(f"{where}: {end - begin} bytes for {dtype} {list(dims)}")
    return begin, end, dtype, dims


class HFFolder:
    """A Hugging Face model folder: config, tensors by canonical name, tokenizer.json alongside."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        self.config = self._read_config()
        files = self._weight_files()
        by_hf: dict[str, STensor] = {}
        for f in files:
            by_hf |= read_header(f)
        self.cfg = config_from_hf(self.config, by_hf, self.path / "config.json")
        self.norm_offset = BY_ARCH[self.cfg.arch].hf_norm_offset
        self.tensors = self._rename(by_hf)
        self.metadata = {"general.architecture": self.cfg.arch, "general.name": self.name}
        self._maps: dict[Path, mmap.mmap] = {}

    def _read_config(self) -> dict[str, Any]:
        p = self.path / "config.json"
        cfg = checks.json_object(read_regular_text(p, "config", MAX_JSON_BYTES, ModelFormatError), str(p))
        if cfg.get("model_type") in HF_WRAPPER_TYPES and "text_config" in cfg:
            return checks.mapping(cfg["text_config"], f"{p}: text_config")
        return cfg

    def _weight_files(self) -> list[Path]:
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if index.is_file():
            text = read_regular_text(index, "index", MAX_JSON_BYTES, ModelFormatError)
            weight_map = checks.json_object(text, str(index)).get("weight_map")
            weight_map = checks.mapping(weight_map, f"{index}: weight_map")
            files = sorted({checks.inside(self.path, f, f"{index}: weight_map[{name!r}]")
                            for name, f in weight_map.items()})
            for f in files:
                if not f.is_file():
                    raise TracelmError(f"{f}: missing shard named by {index.name}")
            return files
        if single.is_file():
            return [single]
        raise TracelmError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def _rename(self, by_hf: dict[str, STensor]) -> dict[str, STensor]:
        family, out = BY_ARCH[self.cfg.arch], {}
        for name, t in by_hf.items():
            if (canonical := gguf_name(name, family)) is not None:
                out[canonical] = t
        return out

    def _values(self, name: str) -> tuple[STensor, np.ndarray]:
        """A tensor's header entry and its values as stored (F32, F16, or BF16 as uint16), memory-mapped."""
        t = self.tensors.get(name)
        if t is None:
            raise TracelmError(f"{self.name}: missing tensor {name}")
        dt = DTYPES.get(t.dtype)
        if dt is None:
            raise TracelmError(f"{t.file.name}: tensor {t.name} has dtype {t.dtype}, which tracelm cannot read "
                               f"({', '.join(DTYPES)})")
        n = math.prod(t.shape)
        if n * dt.itemsize != t.n_bytes:
            raise TracelmError(f"{t.file.name}: tensor {t.name}: {t.n_bytes} bytes for {t.dtype} {list(t.shape)}")
        m = self._maps.get(t.file)
        if m is None:
            with open(t.file, "rb") as f:
                m = self._maps[t.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return t, np.frombuffer(m, dt, n, t.offset)

    def raw_rows(self, name: str) -> np.ndarray:
        """A matrix's bytes as stored, [rows, bytes per row], memory-mapped (the kernels' F32/F16/BF16 rows)."""
        t, raw = self._values(name)
        return raw.view(np.uint8).reshape(t.shape[0], -1)

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        from tracelm.io.gguf_file import bytes_into

        t, _ = self._values(name)
        return bytes_into(t.file, t.offset, t.n_bytes, out, f"{t.file.name}: tensor {t.name}")

    def tensor_f32(self, name: str) -> np.ndarray:
        t, raw = self._values(name)
        return self._f32(name, raw, t.dtype).reshape(t.shape)

    def rows_f32(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 of a tensor in f32 ([hi - lo, cols]), read by file reads rather than through the map (the
        page cache then holds the file, not this process: quantizing on load reads every matrix once)."""
        from tracelm.io.gguf_file import bytes_into

        t, _ = self._values(name)
        cols, dt = t.shape[-1], DTYPES[t.dtype]
        raw = np.empty((hi - lo) * cols, dt)
        bytes_into(t.file, t.offset + lo * cols * dt.itemsize, raw.nbytes, raw.view(np.uint8),
                   f"{t.file.name}: tensor {t.name}")
        return self._f32(name, raw, t.dtype).reshape(hi - lo, cols)

    def _f32(self, name: str, raw: np.ndarray, dtype: str) -> np.ndarray:
        """Stored values (F32, F16, or BF16 as uint16) in f32, the family's norm offset added to a norm's weight."""
        a = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
        if self.norm_offset and name.endswith("norm.weight"):
            a = a + np.float32(self.norm_offset)
        return a

    def load_weights(self, progress: bool = True):
        from tracelm.io.weights import load_weights

        return load_weights(self, self.cfg, progress=progress)  # type: ignore[arg-type]


def _llama3_factors(rp: dict[str, Any], base_dim: int, base: float, where: str) -> tuple[float, ...]:
    """Per-pair divisors of the RoPE frequencies for rope_type llama3 (as transformers computes them)."""
    at = lambda key: f"{where}: rope_scaling.{key}"  # noqa: E731
    factor = checks.number(rp.get("factor"), at("factor"), lo=0.0, lo_open=True)
    low = checks.number(rp.get("low_freq_factor"), at("low_freq_factor"), lo=0.0, lo_open=True)
    high = checks.number(rp.get("high_freq_factor"), at("high_freq_factor"), lo=low, lo_open=True)
    old = float(checks.integer(rp.get("original_max_position_embeddings"), at("original_max_position_embeddings"),
                               lo=1))
    inv = base ** (-np.arange(0, base_dim, 2, dtype=np.float64) / base_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return tuple(float(x) for x in inv / scaled)


def _rope(c: dict[str, Any], rope_dim: int, opts: dict[str, Any], where: str) -> float:
    """The RoPE base, and into `opts` the options rope_parameters / rope_scaling set (each checked)."""
    rp = checks.mapping(c.get("rope_parameters") or {}, f"{where}: rope_parameters")
    if "full_attention" in rp:  # per layer type (gemma3)
        local = checks.mapping(rp.get("sliding_attention") or {}, f"{where}: rope_parameters.sliding_attention")
        rp = checks.mapping(rp["full_attention"], f"{where}: rope_parameters.full_attention")
        opts["rope_base_swa"] = checks.number(local.get("rope_theta", 10000.0), f"{where}: sliding rope_theta",
                                              lo=0.0, lo_open=True)
    base = checks.number(rp.get("rope_theta", c.get("rope_theta", 10000.0)), f"{where}: rope_theta", lo=0.0,
                         lo_open=True)
    scaling = checks.mapping(c.get("rope_scaling") or rp, f"{where}: rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        opts["rope_freq_factors"] = _llama3_factors(scaling, rope_dim, base, where)
    elif kind not in ("default", None):
        raise ModelFormatError(f"{where}: rope_type {kind!r} is not supported (default, llama3)")
    return base


def config_from_hf(c: dict[str, Any], tensors: dict[str, STensor], where: Path) -> ModelConfig:
    """The ModelConfig a config.json describes, every field it reads checked by type and range first."""
    def need(key: str) -> Any:
        if key not in c or c[key] is None:
            raise ModelFormatError(f"{where}: missing field {key}")
        return c[key]

    def positive(key: str, default: int | None = None) -> int:
        value = need(key) if default is None else (c.get(key) or default)
        return checks.integer(value, f"{where}: {key}", lo=1)

    model_type = need("model_type")
    if not isinstance(model_type, str) or model_type not in BY_HF_MODEL_TYPE:
        raise ModelFormatError(f"{where}: model_type {model_type!r} is not one tracelm builds "
                               f"(supported: {', '.join(BY_HF_MODEL_TYPE)})")
    d, n_head = positive("hidden_size"), positive("num_attention_heads")
    arch, opts = BY_HF_MODEL_TYPE[model_type].arch, BY_HF_MODEL_TYPE[model_type].hf_options(d)
    if not c.get("head_dim") and d % n_head:
        raise ModelFormatError(f"{where}: hidden_size {d} is not a multiple of num_attention_heads {n_head}")
    head_dim = checks.integer(positive("head_dim", d // n_head), f"{where}: head_dim", hi=checks.MAX_HEAD_DIM)
    n_head_kv = positive("num_key_value_heads", n_head)
    if n_head % n_head_kv:
        raise ModelFormatError(f"{where}: num_attention_heads {n_head} is not a multiple of num_key_value_heads "
                               f"{n_head_kv}")
    partial = checks.number(c.get("partial_rotary_factor", 1.0), f"{where}: partial_rotary_factor", lo=0.0,
                            hi=1.0, lo_open=True)
    rope_dim = int(head_dim * partial)
    base = _rope(c, rope_dim, opts, str(where))
    if c.get("attention_bias") is not None and checks.boolean(c["attention_bias"], f"{where}: attention_bias"):
        opts["qkv_bias"] = True
    window = c.get("sliding_window")
    window = 0 if window is None else checks.integer(window, f"{where}: sliding_window", lo=0)
    if window and (model_type != "qwen2" or c.get("use_sliding_window")):
        opts["sliding_window"] = window
        if layer_types := c.get("layer_types"):
            opts["swa_pattern"] = _swa_pattern(checks.strings(layer_types, f"{where}: layer_types"), where)
    if arch == "gemma3":
        scalar = checks.number(c.get("query_pre_attn_scalar", head_dim), f"{where}: query_pre_attn_scalar", lo=0.0,
                               lo_open=True)
        opts["attn_scale"] = scalar**-0.5
        if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
            raise ModelFormatError(f"{where}: logit soft-capping is not supported")
    act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelFormatError(f"{where}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    opts["ffn_act"] = "silu" if act == "silu" else "gelu_tanh"
    emb = tensors.get("model.embed_tokens.weight") or tensors.get("model.language_model.embed_tokens.weight")
    if emb is None:
        raise ModelFormatError(f"{where.parent.name}: missing tensor model.embed_tokens.weight")
    if len(emb.shape) != 2 or emb.shape[1] != d:
        raise ModelFormatError(f"{where.parent.name}: tensor {emb.name} has shape {list(emb.shape)}, expected "
                               f"[vocabulary, {d}]")
    try:
        return ModelConfig(
            arch=arch, n_vocab=emb.shape[0], n_embd=d, n_layer=positive("num_hidden_layers"), n_head=n_head,
            n_head_kv=n_head_kv, head_dim=head_dim, n_ff=positive("intermediate_size"), rope_base=base,
            rope_dim=rope_dim, rope_mode="neox",
            rms_eps=checks.number(c.get("rms_norm_eps", 1e-6), f"{where}: rms_norm_eps", lo=0.0, lo_open=True),
            n_ctx_train=positive("max_position_embeddings", 2048),
            tied_head="lm_head.weight" not in tensors, **opts)
    except ValueError as e:
        raise ModelFormatError(f"{where}: {e}") from None


def _swa_pattern(layer_types: list[str], where: Path) -> int:
    """gemma's layer_types as a window pattern: every n-th layer global (0: every layer windowed)."""
    globals_ = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    pattern = globals_[0] + 1 if globals_ else 0
    if [i for i in range(len(layer_types)) if pattern and (i + 1) % pattern == 0] != globals_:
        raise ModelFormatError(f"{where}: layer_types is not a repeating window pattern")
    return pattern
