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

import json
import math
import mmap
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.io.families import BY_ARCH, BY_HF_MODEL_TYPE, HF_WRAPPER_TYPES, gguf_name
from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig

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
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise TracelmError(f"{path.name}: not a safetensors file (only {len(raw)} bytes)")
            n = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if n > size - 8:
                raise TracelmError(f"{path.name}: truncated or corrupt safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise TracelmError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TracelmError(f"{path.name}: corrupt safetensors header (not JSON)") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            t = STensor(name, path, info["dtype"], tuple(int(d) for d in info["shape"]), 8 + n + begin, end - begin)
        except (KeyError, TypeError, ValueError):
            raise TracelmError(f"{path.name}: corrupt safetensors header entry for {name}") from None
        if t.offset + t.n_bytes > size:
            raise TracelmError(f"{path.name}: truncated safetensors file: tensor {name} ends at byte "
                               f"{t.offset + t.n_bytes}, file has {size}")
        out[name] = t
    return out


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
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise TracelmError(f"{p}: cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise TracelmError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(cfg, dict):
            raise TracelmError(f"{p}: not a JSON object")
        return cfg.get("text_config", cfg) if cfg.get("model_type") in HF_WRAPPER_TYPES else cfg

    def _weight_files(self) -> list[Path]:
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                raise TracelmError(f"{index}: not a safetensors index (JSON with a weight_map)") from None
            files = sorted({self.path / f for f in weight_map.values()})
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
        if t.dtype == "BF16":
            a = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            a = raw.astype(np.float32)
        a = a.reshape(t.shape)
        if self.norm_offset and name.endswith("norm.weight"):
            a = a + np.float32(self.norm_offset)
        return a

    def load_weights(self, progress: bool = True):
        from tracelm.io.weights import load_weights

        return load_weights(self, self.cfg, progress=progress)  # type: ignore[arg-type]


def _llama3_factors(rp: dict[str, Any], base_dim: int, base: float) -> tuple[float, ...]:
    """Per-pair divisors of the RoPE frequencies for rope_type llama3 (as transformers computes them)."""
    factor, low, high = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    old = float(rp["original_max_position_embeddings"])
    inv = base ** (-np.arange(0, base_dim, 2, dtype=np.float64) / base_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return tuple(float(x) for x in inv / scaled)


def config_from_hf(c: dict[str, Any], tensors: dict[str, STensor], where: Path) -> ModelConfig:
    def need(key: str) -> Any:
        if key not in c or c[key] is None:
            raise TracelmError(f"{where}: missing field {key}")
        return c[key]

    model_type = need("model_type")
    if model_type not in BY_HF_MODEL_TYPE:
        raise TracelmError(f"{where}: model_type {model_type!r} is not one tracelm builds "
                           f"(supported: {', '.join(BY_HF_MODEL_TYPE)})")
    d, n_head = int(need("hidden_size")), int(need("num_attention_heads"))
    arch, opts = BY_HF_MODEL_TYPE[model_type].arch, BY_HF_MODEL_TYPE[model_type].hf_options(d)
    head_dim = int(c.get("head_dim") or d // n_head)
    rope_dim = int(head_dim * float(c.get("partial_rotary_factor", 1.0)))
    rp = c.get("rope_parameters") or {}
    if "full_attention" in rp:  # per layer type (gemma3)
        local, rp = rp.get("sliding_attention", {}), rp["full_attention"]
        opts["rope_base_swa"] = float(local.get("rope_theta", 10000.0))
    base = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = c.get("rope_scaling") or rp
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        opts["rope_freq_factors"] = _llama3_factors(scaling, rope_dim, base)
    elif scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise TracelmError(f"{where}: rope_type {scaling.get('rope_type')!r} is not supported (default, llama3)")
    if c.get("attention_bias"):
        opts["qkv_bias"] = True
    window = c.get("sliding_window")
    layer_types = c.get("layer_types")
    if window and (model_type != "qwen2" or c.get("use_sliding_window")):
        opts["sliding_window"] = int(window)
        if layer_types:
            globals_ = [i for i, t in enumerate(layer_types) if t == "full_attention"]
            pattern = globals_[0] + 1 if globals_ else 0
            if [i for i in range(len(layer_types)) if pattern and (i + 1) % pattern == 0] != globals_:
                raise TracelmError(f"{where}: layer_types is not a repeating window pattern")
            opts["swa_pattern"] = pattern
    if arch == "gemma3":
        opts["attn_scale"] = float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5
        if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
            raise TracelmError(f"{where}: logit soft-capping is not supported")
    act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise TracelmError(f"{where}: hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")
    opts["ffn_act"] = "silu" if act == "silu" else "gelu_tanh"
    emb = tensors.get("model.embed_tokens.weight") or tensors.get("model.language_model.embed_tokens.weight")
    if emb is None:
        raise TracelmError(f"{where.parent.name}: missing tensor model.embed_tokens.weight")
    try:
        return ModelConfig(
            arch=arch, n_vocab=int(emb.shape[0]), n_embd=d, n_layer=int(need("num_hidden_layers")), n_head=n_head,
            n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=head_dim,
            n_ff=int(need("intermediate_size")), rope_base=base, rope_dim=rope_dim, rope_mode="neox",
            rms_eps=float(c.get("rms_norm_eps", 1e-6)), n_ctx_train=int(c.get("max_position_embeddings", 2048)),
            tied_head="lm_head.weight" not in tensors, **opts)
    except ValueError as e:
        raise TracelmError(f"{where}: {e}") from None
