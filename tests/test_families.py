"""Model families on the real models: `tracelm validate` against transformers (per layer, logits, greedy
tokens) on three prompts each, and the options of the graph on the tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, require_reference


def tracelm(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _validate(path, *extra_prompts: str) -> dict:
    require_reference()
    from tracelm.tools.validate import DEFAULT_PROMPTS

    prompts = [a for p in (*DEFAULT_PROMPTS, *extra_prompts) for a in ("--prompt", p)]
    proc = tracelm("validate", "--model", str(path), "--reference", "transformers", "--json", *prompts)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["prompts"]) == 3 + len(extra_prompts)
    for p in report["prompts"]:
        assert p["first_divergent"] is None, (p["prompt"], p["first_divergent"])
        assert min(r["cosine"] for r in p["rows"]) >= 0.9999
        assert p["argmax_match"] and p["greedy_match"], p["prompt"]
        assert len(p["greedy_ours"]) == 32
    assert report["ok"] and proc.returncode == 0
    return report


@pytest.mark.model
@pytest.mark.reference
def test_validate_smollm2(smollm2_path) -> None:
    report = _validate(smollm2_path)
    assert len(report["prompts"][0]["rows"]) == 30 + 2  # embed, 29 layers, last layer + norm, logits


@pytest.mark.model
@pytest.mark.reference
def test_validate_gemma3(gemma3_path) -> None:
    long = ", ".join(str(i) for i in range(1, 160))  # past the 512-position window of the local layers
    report = _validate(gemma3_path, long)
    assert len(report["prompts"][0]["rows"]) == 18 + 2
    assert report["prompts"][3]["n_prompt"] > 512


@pytest.mark.model
@pytest.mark.reference
def test_validate_qwen2(qwen_coder_path) -> None:
    report = _validate(qwen_coder_path)
    assert len(report["prompts"][0]["rows"]) == 24 + 2


def test_gemma3_options_from_metadata(gemma3_path) -> None:
    from tracelm.io.gguf_file import GGUFFile, model_config

    cfg = model_config(GGUFFile(gemma3_path))
    assert cfg.qk_norm and cfg.post_norms and cfg.ffn_act == "gelu_tanh" and cfg.rope_mode == "neox"
    assert cfg.embd_scale == pytest.approx(np.sqrt(640), rel=1e-6)
    assert cfg.scale == pytest.approx(1 / 16)  # head_dim 256
    windows = [cfg.window(i) for i in range(cfg.n_layer)]
    assert windows == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert [cfg.layer_rope_base(i) for i in (0, 5)] == [10000.0, 1e6]


def test_qwen2_options_from_metadata(qwen_coder_path) -> None:
    from tracelm.io.gguf_file import GGUFFile, model_config

    cfg = model_config(GGUFFile(qwen_coder_path))
    assert cfg.qkv_bias and not cfg.qk_norm and cfg.rope_mode == "neox" and not cfg.tied_head
    assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (14, 2, 64)


GEMMA_CONFIG = str(REPO / "configs" / "gemma3.yaml")
QWEN_CONFIG = str(REPO / "configs" / "qwen2.5-coder.yaml")


@pytest.mark.model
def test_gemma3_run_continues_a_story(gemma3_path) -> None:
    proc = tracelm("run", GEMMA_CONFIG, "--temperature", "0", "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    words = re.findall(r"[A-Za-z']+", proc.stdout)
    assert len(words) >= 20, proc.stdout
    assert {"the", "and", "she", "he", "her", "his", "was"} & {w.lower() for w in words}, proc.stdout
    assert len(set(words)) >= 12, proc.stdout  # not one token repeated


@pytest.mark.model
def test_qwen_coder_chat_writes_a_working_function(qwen_coder_path) -> None:
    proc = tracelm("chat", QWEN_CONFIG, "--temperature", "0", "--max-tokens", "160", "--message",
                   "Write a Python function is_prime(n) that returns True when n is a prime number. "
                   "Reply with only the code.")
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"```(?:python)?\n(.*?)```", proc.stdout, re.S)
    code = m.group(1) if m else proc.stdout
    scope: dict = {}
    exec(compile(code, "qwen_answer", "exec"), scope)  # noqa: S102 - the model's answer, run in-process
    primes = [n for n in range(-3, 60) if scope["is_prime"](n)]
    assert primes == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
