"""Hugging Face folders (config.json + safetensors, single or sharded; F32/BF16/F16): the same logits as
the GGUF they were made from, validation against transformers, and clear errors for broken folders."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import FIXTURES, transformers_model

TOK512 = FIXTURES / "llama2c" / "tok512.bin"
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, there was a"]


def tracelm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True, timeout=600)


def write_safetensors(path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None) -> None:
    """A safetensors file by hand: 8-byte header length, JSON header, raw little-endian data."""
    header, blobs, pos = {}, [], 0
    for name, a in tensors.items():
        dt = (dtypes or {}).get(name, "F32")
        raw = {"F32": a.astype("<f4"), "F16": a.astype("<f2"), "I8": a.astype(np.int8),
               "BF16": (a.astype("<f4").view("<u4") >> 16).astype("<u2")}[dt].tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


TINY_CFG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": True}


def tiny_folder(path, dtypes=None, drop_field=None, shards=False):
    rng = np.random.default_rng(0)
    d, ff, kv = 32, 48, 16
    t = {"model.embed_tokens.weight": rng.standard_normal((512, d)), "model.norm.weight": np.ones(d),
         "model.layers.0.input_layernorm.weight": np.ones(d),
         "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((d, d)),
         "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv, d)),
         "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv, d)),
         "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((d, d)),
         "model.layers.0.post_attention_layernorm.weight": np.ones(d),
         "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ff, d)),
         "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ff, d)),
         "model.layers.0.mlp.down_proj.weight": rng.standard_normal((d, ff))}
    path.mkdir(exist_ok=True)
    cfg = {k: v for k, v in TINY_CFG.items() if k != drop_field}
    (path / "config.json").write_text(json.dumps(cfg))
    if shards:
        names = list(t)
        parts = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
        for f, ns in parts.items():
            write_safetensors(path / f, {n: t[n] for n in ns}, dtypes)
        index = {"weight_map": {n: f for f, ns in parts.items() for n in ns}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        write_safetensors(path / "model.safetensors", t, dtypes)
    return path, t


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_tiny_folder_reads_each_dtype_sharded(tmp_path, dtype) -> None:
    from tracelm.io.safetensors_file import HFFolder

    path, t = tiny_folder(tmp_path / "m", dtypes=dict.fromkeys(
        ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"), dtype), shards=True)
    hf = HFFolder(path)
    assert hf.cfg.n_layer == 1 and hf.cfg.tied_head and hf.cfg.rope_mode == "neox"
    w = hf.load_weights(progress=False)
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2}[dtype]
    f32 = {k: v.astype(np.float32) for k, v in t.items()}
    np.testing.assert_allclose(w.token_embd, f32["model.embed_tokens.weight"], rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(w.layers[0].wqkv[:32], f32["model.layers.0.self_attn.q_proj.weight"], rtol=tol,
                               atol=tol * 4)
    np.testing.assert_array_equal(w.layers[0].w_down, f32["model.layers.0.mlp.down_proj.weight"])  # stored F32


@pytest.mark.skipif(not TOK512.is_file(), reason="fixture tok512.bin not present")
@pytest.mark.parametrize("case", ["field", "shard", "dtype"])
def test_broken_folder_is_a_one_line_error(tmp_path, case) -> None:
    if case == "field":
        path, _ = tiny_folder(tmp_path / "m", drop_field="hidden_size")
        want = ["config.json", "missing field hidden_size"]
    elif case == "shard":
        path, _ = tiny_folder(tmp_path / "m", shards=True)
        (path / "model-00002-of-00002.safetensors").unlink()
        want = ["model-00002-of-00002.safetensors", "missing shard"]
    else:
        path, _ = tiny_folder(tmp_path / "m", dtypes={"model.layers.0.mlp.up_proj.weight": "I8"})
        want = ["model.layers.0.mlp.up_proj.weight", "dtype I8"]
    proc = tracelm("export", "--model", str(path), "--tokenizer", str(TOK512), "--out", str(tmp_path / "x.gguf"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in want), lines


@pytest.fixture(scope="module")
def hf_from_gguf(smollm2_path, tmp_path_factory):
    """SmolLM2's GGUF dequantized by transformers and saved as F32 (one file) and BF16 (sharded)."""
    model = transformers_model(smollm2_path)  # first: skips (fails under CI) without transformers
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    out = {}
    for dtype, shard in (("f32", "2GB"), ("bf16", "100MB")):
        path = tmp_path_factory.mktemp(f"smollm2-{dtype}")
        model.to(torch.float32 if dtype == "f32" else torch.bfloat16).save_pretrained(str(path), max_shard_size=shard)
        tok.save_pretrained(str(path))
        out[dtype] = path
    return out


@pytest.mark.model
@pytest.mark.reference
def test_folder_from_gguf_gives_the_gguf_logits(smollm2_reference, hf_from_gguf) -> None:
    """The folder (f32 / bf16 weights, on the kernels' float products) against the GGUF on the numpy reference."""
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner

    smollm2 = smollm2_reference
    assert (hf_from_gguf["bf16"] / "model.safetensors.index.json").is_file()
    for dtype, tol in (("f32", 1e-3), ("bf16", 0.5)):
        model = load_model(str(hf_from_gguf[dtype]), progress=False)
        assert model.cfg.n_layer == 30 and model.cfg.rope_mode == "neox"
        for prompt in PROMPTS:
            ids = smollm2.tokenizer.encode(prompt)
            assert model.tokenizer.encode(prompt) == ids
            ref = Runner(smollm2, 64, kv_dtype="f32").logits(ids)  # the formats compared, not the KV rounding
            ours = Runner(model, 64, kv_dtype="f32").logits(ids)
            assert (ours.argmax(-1) == ref.argmax(-1)).all(), (dtype, prompt)
            assert np.abs(ours - ref).max() <= tol, (dtype, prompt, np.abs(ours - ref).max())


@pytest.mark.model
@pytest.mark.reference
def test_bf16_folder_and_its_gguf_export_agree(hf_from_gguf, tmp_path) -> None:
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner

    out = tmp_path / "from-bf16.gguf"
    proc = tracelm("export", "--model", str(hf_from_gguf["bf16"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    folder = str(hf_from_gguf["bf16"])
    a, b = load_model(folder, progress=False), load_model(str(out), progress=False, tokenizer=folder)
    assert b.cfg.rope_mode == "adjacent"  # HF halves permuted into GGUF llama's adjacent pairs
    ids = a.tokenizer.encode(PROMPTS[2])
    la, lb = Runner(a, 64).logits(ids), Runner(b, 64).logits(ids)
    assert (la.argmax(-1) == lb.argmax(-1)).all() and np.abs(la - lb).max() <= 0.05


@pytest.mark.model
@pytest.mark.reference
def test_validate_command_on_a_folder(hf_from_gguf) -> None:
    proc = tracelm("validate", "--model", str(hf_from_gguf["f32"]), "--prompt", PROMPTS[0], "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["ok"]
