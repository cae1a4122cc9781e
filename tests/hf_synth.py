"""A synthetic Hugging Face model folder, written tensor by tensor (never the whole model in memory): config.json,
model.safetensors (F32, F16 or BF16), a byte-level BPE tokenizer.json made with `tokenizers`, and
tokenizer_config.json with a chat template of its own."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer.json (GPT-2's pre-tokenizer: GGUF pre `gpt-2`) and tokenizer_config.json; the
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.conftest import byte_level_vocab

    pieces = [*byte_level_vocab(), "he", "ll", "hell", "Ġt", "Ġth"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "t"), ("Ġt", "h")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
              "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def hf_model_folder(folder: Path, *, hidden: int = 256, ff: int = 512, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, n_vocab: int = 0, dtype: str = "F16", seed: int = 0) -> Path:
    """A llama-architecture folder with random weights (norms near 1, matrices ~ N(0, 1/cols))."""
    folder.mkdir(parents=True, exist_ok=True)
    n_vocab = max(n_vocab, write_tokenizer(folder))
    hd = hidden // heads
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": n_vocab, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (n_vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (heads * hd, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * hd),
                   p + "post_attention_layernorm.weight": (hidden,), p + "mlp.gate_proj.weight": (ff, hidden),
                   p + "mlp.up_proj.weight": (ff, hidden), p + "mlp.down_proj.weight": (hidden, ff)}
    write_safetensors_streamed(folder / "model.safetensors", shapes, dtype, np.random.default_rng(seed))
    return folder


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:
        return (1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[1] ** -0.5)


def write_safetensors_streamed(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str,
                               rng: np.random.Generator) -> None:
    """A safetensors file of random tensors, each made and written in turn (vectors always F32)."""
    size = {"F32": 4, "F16": 2, "BF16": 2}
    header, pos = {}, 0
    for name, shape in shapes.items():
        dt = dtype if len(shape) == 2 else "F32"
        n = int(np.prod(shape)) * size[dt]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, shape in shapes.items():
            a = _values(rng, shape)
            dt = header[name]["dtype"]
            if dt == "F16":
                a = a.astype("<f2")
            elif dt == "BF16":
                a = (a.view("<u4") >> 16).astype("<u2")
            f.write(a.tobytes())
            del a
