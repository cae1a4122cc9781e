"""Model families on the real models: the kernels' logits and greedy tokens against transformers, `tracelm
validate` against transformers (per layer, logits, greedy tokens) on three prompts each, the options of the graph
read from the files, and runs of the packaged configs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, _pull, require_reference, transformers_model
from tracelm.pipeline.runner import Runner
from tracelm.state.records import SamplingParams
from tracelm.tools.validate import DEFAULT_PROMPTS


def tracelm(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# Max |kernels' logit - transformers' logit| allowed on `tracelm validate`'s three prompts and 24 greedy tokens after
# each, every position, with the defaults (compute: kernels, activations: int16, kv_cache: f16). Each bound is the
# distance measured here (the test prints it) with a margin: SmolLM2-135M Q4_1 0.027, Gemma 3 270M Q4_K_M 0.027,
# Qwen2.5-Coder-0.5B Q4_K_M 0.060 (most of it the f16 Cache's rounding: on an f32 one 0.007, 0.009, 0.003). The
# kernels give the same bits on every path and thread count, so only transformers' float order moves these.
# llama.cpp's own distance to transformers on the same prompts, as recorded for issue 32 (llama-cpp-python on the
# same files; it is not in CI, so not measured here), is 0.8 - 1.6: each bound is well inside it. The kernels at
# llama.cpp's precision (int8 activations, measured once by hand on the prompts alone) sit 0.85 - 1.18, 1.37 - 2.01
# and 0.49 - 0.66 away: a kernel that lost the int16 activations' second block fails these bounds.
LOGIT_BOUNDS = {"smollm2-135m-instruct": 0.05, "gemma3-270m": 0.05, "qwen2.5-coder-0.5b-instruct": 0.1}
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)


@pytest.fixture(scope="module", params=list(LOGIT_BOUNDS))
def against_transformers(request):
    """A registry model on the kernels and transformers' own f32 model of the same GGUF (conftest's
    transformers_model: the blocks dequantized by transformers, which `tracelm validate` compares with too)."""
    from tracelm.io.loader import load_model

    path = _pull(request.param)
    return request.param, load_model(str(path), progress=False), transformers_model(path)


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("prompt", DEFAULT_PROMPTS)
def test_kernels_logits_and_greedy_tokens_agree_with_transformers(against_transformers, prompt: str) -> None:
    """The kernels as they run by default against transformers: the prompt and the kernels' 24 greedy tokens in
    one pass of each, the same argmax at every position (so transformers' greedy continuation is the kernels'
    tokens: teacher forcing, one pass of transformers instead of 24 steps of generate) and max |logit
    difference| within the model's LOGIT_BOUNDS: the distance measured here (printed) with a margin, and well inside
    llama.cpp's own distance to transformers on these prompts, 0.8 - 1.6 (where each number comes from: above)."""
    import torch

    name, model, hf = against_transformers
    ids = model.tokenizer.encode(prompt)
    runner = Runner(model, 128)
    list(runner.generate(ids, 24, GREEDY))
    tokens = runner.stats.tokens  # an end-of-generation token that stops it is not among them
    seq = ids + tokens[:24 - 1]
    ours = Runner(model, 128).logits(seq)
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    distance = float(np.abs(ours - ref).max())
    print(f"{name} {prompt!r}: {len(ids)} + {len(tokens)} tokens, max |kernels - transformers| = {distance:.4f} "
          f"(bound {LOGIT_BOUNDS[name]})")
    assert len(tokens) >= 8 and ours[len(ids) - 1:].argmax(-1)[:len(tokens)].tolist() == tokens
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert distance <= LOGIT_BOUNDS[name]


def _validate(path, *extra_prompts: str) -> dict:
    require_reference()
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
