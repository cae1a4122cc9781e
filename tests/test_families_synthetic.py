"""Families with no real model here (qwen3, mistral sliding window, phi3 fused + partial rotary, llama 3
RoPE scaling with a separate head): small random checkpoints made by transformers (`save_pretrained`),
read through the safetensors path and through a GGUF that tracelm writes from them, each compared layer
by layer with transformers on the same checkpoint."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.conftest import require_reference

pytestmark = pytest.mark.reference


@pytest.fixture(autouse=True)
def _reference() -> None:
    require_reference()


COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _families() -> dict:
    """Head ratios as in the real models: qwen3 2:1, mistral / llama 3 4:1, phi3 1:1 (multi-head)."""
    return {
        "qwen3": ("Qwen3Config", dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=True, num_key_value_heads=4)),
        "mistral": ("MistralConfig", dict(sliding_window=12, rope_theta=1e4)),
        "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, rope_theta=1e4, pad_token_id=0, num_key_value_heads=8)),
        "llama3": ("LlamaConfig", dict(rope_theta=5e5, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})),
        "qwen2": ("Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", dict(
            head_dim=16, sliding_window=6, query_pre_attn_scalar=24, tie_word_embeddings=True, num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    }


def make_checkpoint(family: str, path) -> None:
    import torch
    import transformers

    cls_name, extra = _families()[family]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # weights large enough that the logits are far from ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(path))


@pytest.fixture(scope="module", params=list(_families()))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return request.param, path


def test_safetensors_and_gguf_paths_match_transformers(checkpoint, tmp_path) -> None:
    from tracelm.io.export import export_gguf
    from tracelm.io.gguf_file import GGUFFile, model_config
    from tracelm.io.safetensors_file import HFFolder
    from tracelm.io.weights import load_weights
    from tracelm.tools.validate import TransformersReference, validate_prompt

    family, path = checkpoint
    hf = HFFolder(path)
    cfg = hf.cfg
    expect = {"qwen3": cfg.qk_norm and cfg.tied_head, "mistral": cfg.sliding_window == 12 and cfg.swa_pattern == 0,
              "phi3": cfg.rope_dim == cfg.head_dim // 2, "llama3": cfg.rope_freq_factors is not None
              and not cfg.tied_head, "qwen2": cfg.qkv_bias,
              "gemma3": cfg.post_norms and cfg.swa_pattern == 2 and cfg.rope_base_swa == 1e4 and cfg.attn_scale > 0}
    assert expect[family], cfg
    ours = types.SimpleNamespace(cfg=cfg, weights=hf.load_weights(progress=False))
    ref = TransformersReference(path)
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 320, 20)]
    rep = validate_prompt(ours, ref, family, ids, 32)
    assert rep.ok, (rep.first_divergent, [(r.name, r.cosine) for r in rep.rows])

    gguf_path = export_gguf(cfg, ours.weights, tmp_path / f"{family}.gguf")
    gf = GGUFFile(gguf_path)
    gcfg = model_config(gf)
    back = types.SimpleNamespace(cfg=gcfg, weights=load_weights(gf, gcfg, progress=False))
    rep2 = validate_prompt(back, ref, family, ids, 32)
    assert rep2.ok, (rep2.first_divergent, [(r.name, r.cosine) for r in rep2.rows])
    if family == "llama3":  # llama GGUF rotates adjacent pairs: q/k rows were permuted on export
        assert gcfg.rope_mode == "adjacent"
