"""The fuzz targets of `tracelm fuzz` (tracelm/tools/fuzz.py): for each reader of untrusted input, small valid
inputs built in memory (the seeds the mutations start from) and the call that reads one.

An input is a `Sample`: file name -> bytes (one file, or a model folder's files). `read` runs the reader on the
files written under a folder; it returns normally when the input is accepted and raises TracelmError (tracelm's
one error for bad input) when it is refused -- anything else is a crash.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs
import gguf
import numpy as np

Sample = dict[str, bytes]

TEXT = "hello world <|endoftext|> ok"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]


@attrs.frozen
class Target:
    name: str
    seeds: Callable[[], list[Sample]]
    read: Callable[[Path], None]


# ---------------------------------------------------------------- GGUF models and vocabularies

VOCAB = [*"abcdehlorw", "Ġ", "he", "ll", "hell", "lo", "Ġw", "or", "<|endoftext|>"]
MERGES = ["h e", "l l", "he ll", "l o", "Ġ w", "o r"]
Q8 = gguf.GGMLQuantizationType.Q8_0


def _gguf_bytes(fill: Callable[[gguf.GGUFWriter], None], arch: str = "llama") -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "seed.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def _byte_level_vocab(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(VOCAB)
    w.add_token_types([1] * (len(VOCAB) - 1) + [3])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(len(VOCAB) - 1)
    w.add_eos_token_id(len(VOCAB) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _scored_vocab(w: gguf.GGUFWriter) -> None:
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(0x61, 0x69)], "▁", "▁h", "▁he", "ll", "o",
              "▁hell", "▁hello"]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0, 0.0, 0.0, *[-100.0] * 8, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0])
    w.add_token_types([2, 3, 3, *[6] * 8, *[1] * 7])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(True)


def _tiny_model(w: gguf.GGUFWriter, quantized: bool, tied: bool) -> None:
    """A one-layer llama, d = 32 (one Q8_0 block per row), 2 heads of 16, one KV head."""
    rng = np.random.default_rng(0)
    d, ff, n_vocab = 32, 32, len(VOCAB) if tied else 18
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, d),
                       (w.add_feed_forward_length, ff), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_rope_dimension_count, 16)):
        add(value)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    shapes = {"token_embd.weight": (n_vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (16, d), "blk.0.attn_v.weight": (16, d),
              "blk.0.attn_output.weight": (d, d), "blk.0.ffn_norm.weight": (d,), "blk.0.ffn_gate.weight": (ff, d),
              "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    if not tied:
        shapes["output.weight"] = (n_vocab, d)
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) / 4).astype(np.float32)
        if quantized and len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(a, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, a if len(shape) == 2 else 1 + a)


def gguf_seeds() -> list[Sample]:
    def byte_level(w: gguf.GGUFWriter) -> None:
        _tiny_model(w, quantized=True, tied=True)
        _byte_level_vocab(w)

    def scored(w: gguf.GGUFWriter) -> None:
        _tiny_model(w, quantized=False, tied=False)
        w.add_sliding_window(8)
        _scored_vocab(w)
    return [{"model.gguf": _gguf_bytes(byte_level)}, {"model.gguf": _gguf_bytes(scored)}]


def read_gguf(folder: Path) -> None:
    from tracelm.io.loader import ModelFile

    ModelFile(str(folder / "model.gguf")).load(progress=False)


# ---------------------------------------------------------------- tokenizers


def llama2c_tokenizer_bytes() -> bytes:
    """llama2.c's tokenizer.bin: max token length, then per token its score, length and bytes."""
    tokens = [b"<unk>", b"\n<s>\n", b"\n</s>\n", *[f"<0x{b:02X}>".encode() for b in range(0x61, 0x69)], b" h",
              b"he", b" he", b"ll", b" hell", b"o"]
    body = b"".join(struct.pack("<fi", -float(i), len(t)) + t for i, t in enumerate(tokens))
    return struct.pack("<i", max(map(len, tokens))) + body


def tokenizer_seeds() -> list[Sample]:
    return [{"vocab.gguf": _gguf_bytes(_byte_level_vocab)}, {"vocab.gguf": _gguf_bytes(_scored_vocab)},
            {"tokenizer.bin": llama2c_tokenizer_bytes()}]


def read_tokenizer(folder: Path) -> None:
    from tracelm.io.loader import load_tokenizer

    name = "vocab.gguf" if (folder / "vocab.gguf").exists() else "tokenizer.bin"
    tok = load_tokenizer(str(folder / name))
    ids = tok.encode(TEXT, parse_special=True)
    tok.decode(ids)


# ---------------------------------------------------------------- safetensors folders and llama2.c checkpoints

HF_CONFIG = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 20, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 64, "rope_theta": 10000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}}


def safetensors_bytes(tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """A safetensors file: 8-byte header length, the JSON header, the raw little-endian data."""
    header, blobs, pos = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, a) in tensors.items():
        raw = {"F32": a.astype("<f4"), "F16": a.astype("<f2"),
               "BF16": (a.astype("<f4").view("<u4") >> 16).astype("<u2")}[dtype].tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def safetensors_seeds() -> list[Sample]:
    rng = np.random.default_rng(0)
    d, ff, kv, p = 16, 24, 8, "model.layers.0."
    shapes = {"model.embed_tokens.weight": (20, d), "model.norm.weight": (d,), p + "input_layernorm.weight": (d,),
              p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
              p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
              p + "post_attention_layernorm.weight": (d,), p + "mlp.gate_proj.weight": (ff, d),
              p + "mlp.up_proj.weight": (ff, d), p + "mlp.down_proj.weight": (d, ff)}
    dtypes = ("F32", "F16", "BF16")
    tensors = {n: (dtypes[i % 3], rng.standard_normal(s).astype(np.float32)) for i, (n, s) in enumerate(shapes.items())}
    config = json.dumps(HF_CONFIG).encode()
    return [{"config.json": config, "model.safetensors": safetensors_bytes(tensors)}]


def read_safetensors(folder: Path) -> None:
    from tracelm.io.safetensors_file import HFFolder

    HFFolder(folder).load_weights(progress=False)


def llama2c_seeds() -> list[Sample]:
    """Two checkpoints: a shared classifier (positive vocab_size) and a separate one (negative)."""
    rng = np.random.default_rng(0)
    out = []
    for vocab in (16, -16):
        dim, hidden, layers, heads, kv_heads, seq = 8, 12, 1, 2, 1, 8
        kv, hs, v = kv_heads * dim // heads, dim // heads, abs(vocab)
        n = (v * dim + layers * (2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hidden * dim) + dim
             + seq * hs + (v * dim if vocab < 0 else 0))
        header = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab, seq)
        out.append({"model.bin": header + rng.standard_normal(n).astype("<f4").tobytes()})
    return out


def read_llama2c(folder: Path) -> None:
    from tracelm.io.llama2c import Llama2cFile, load_weights

    load_weights(Llama2cFile(folder / "model.bin"))


# ---------------------------------------------------------------- traces and chat templates

SIGNING_SEED = hashlib.sha256(b"tracelm fuzz signing key").digest()  # a fixed key: the same seeds every run


def trace_bytes(signed: bool) -> bytes:
    """A small trace written by the Tracer itself (header, generate, stage and token events, footer)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tracelm.pipeline.runner import GenerationStats
    from tracelm.pipeline.trace import FORMAT, TRACE_VERSION, Tracer, signature_fields, write_footer

    out = io.StringIO()
    signer = Ed25519PrivateKey.from_private_bytes(SIGNING_SEED) if signed else None
    tracer = Tracer(out, "digest", signer=signer)
    tracer.event("header", format=FORMAT, trace_version=TRACE_VERSION, level="digest", mac_algorithm=None,
                 **signature_fields(signer), config={"sampling": {"temperature": 0.5}}, prompt_ids=[1, 2],
                 prompt_text="hi", blas=[], seed=3)
    tracer.event("generate", prompt_ids=[1, 2], reused=0, max_tokens=2, stop=[])
    for tok in range(2):
        for layer, stage in ((None, "embed"), (0, "attn_norm"), (0, "ffn"), (None, "head")):
            tracer.call(stage, layer, lambda tok=tok: np.linspace(-1, tok, 8, dtype=np.float32).reshape(2, 4))
        tracer.event("token", draw=tok, id=5 + tok, piece="ab", text="ab", prob=0.25)
    write_footer(tracer, GenerationStats(2, 0, 2, "length", 0.1, 0.2, [5, 6], 2), "abab")
    return out.getvalue().encode("utf-8")


def trace_seeds() -> list[Sample]:
    return [{"trace.jsonl": trace_bytes(signed=False)}, {"trace.jsonl": trace_bytes(signed=True)}]


def read_trace_file(folder: Path) -> None:
    from tracelm.audit.verify import read_trace, summary, verify

    trace = read_trace(folder / "trace.jsonl")
    verify(trace)
    summary(trace)


def template_seeds() -> list[Sample]:
    from tracelm.io import chat_template

    texts = [chat_template.CHATML_TEMPLATE, chat_template.GEMMA_TEMPLATE,
             "{% for m in messages %}{% if loop.first and m.role == 'system' %}{{ m.content | trim }}\n"
             "{% elif m.role == 'user' %}[INST] {{ m['content'] ~ '!' }} [/INST]{% else %}{{ m.content | tojson }}"
             "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ bos_token }}{% endif %}"]
    return [{"template.jinja": t.encode("utf-8")} for t in texts]


def read_template(folder: Path) -> None:
    from tracelm.io.chat_template import render_chat

    text = (folder / "template.jinja").read_bytes().decode("utf-8", "replace")
    render_chat(text, MESSAGES, bos_token="<s>", eos_token="</s>")


TARGETS = {t.name: t for t in (
    Target("gguf", gguf_seeds, read_gguf),
    Target("safetensors", safetensors_seeds, read_safetensors),
    Target("llama2c", llama2c_seeds, read_llama2c),
    Target("tokenizer", tokenizer_seeds, read_tokenizer),
    Target("trace", trace_seeds, read_trace_file),
    Target("template", template_seeds, read_template),
)}
