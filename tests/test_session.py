"""The front door: `tracelm.Session` opens a model as a config says and runs prompts, chats and streams, traced
when asked, with the runner's own numbers; `tracelm run` / `chat` need no config file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

from tracelm import Session, TracelmError, kernels
from tracelm.audit.replay import REPRODUCED, replay
from tracelm.pipeline.runner import Runner
from tracelm.state.records import SamplingParams


@pytest.fixture(scope="module")
def session(tiny_gguf: Path) -> Session:
    return Session(str(tiny_gguf), settings=["context=512", "max_tokens=8"])


def test_generate_is_the_runners_text(session: Session) -> None:
    ids = session.encode("hello world")
    want = "".join(Runner(session.model, 512).generate(ids, 8, SamplingParams(temperature=0.0)))
    assert session.generate("hello world", temperature=0.0) == want
    assert "".join(session.stream("hello world", temperature=0.0)) == want
    assert session.stats.n_prompt == len(ids) and session.stats.n_reused == len(ids) - 1  # the Cache kept it


def test_call_arguments_override_the_config(session: Session) -> None:
    a = session.generate("hello", temperature=1.0, top_k=0, seed=3, max_tokens=5)
    assert a == session.generate("hello", temperature=1.0, top_k=0, seed=3, max_tokens=5)
    assert session.stats.n_generated <= 5
    with pytest.raises(TracelmError, match="sampling"):
        session.generate("hello", temprature=0.5)
    with pytest.raises(TracelmError, match="exceeds the context"):
        session.generate("hello", max_tokens=1000)


def test_chat_keeps_the_conversation(session: Session) -> None:
    session.reset()
    first = session.chat("hello", temperature=0.0)
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    session.chat("and again", temperature=0.0)
    assert len(session.messages) == 4 and session.messages[1]["content"] == first.strip()
    assert session.stats.n_reused > 0  # the second turn prefilled only what the first did not hold


def test_a_traced_call_replays(session: Session, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    text = session.generate("hello there", temperature=0.9, seed=5, trace=path)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events[0]["event"] == "header" and events[-1]["event"] == "footer" and events[-1]["output_text"] == text
    assert events[0]["config"]["compute"] == "kernels" and events[0]["kernels"]["path"] in kernels.paths()
    assert replay(path).status == REPRODUCED


def test_thread_limits_last_as_long_as_the_session(tiny_gguf: Path) -> None:
    before = kernels.threads()
    with Session(str(tiny_gguf), settings=["threads=1"]):
        assert kernels.threads() == 1
    assert kernels.threads() == before


def test_run_and_chat_need_no_config(tiny_gguf: Path, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "tracelm.cli", "run", "--model", str(tiny_gguf), "--prompt", "hello",
                          "--max-tokens", "4", "--temperature", "0"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0 and "4 generated" in run.stderr, run.stderr
    chat = subprocess.run([sys.executable, "-m", "tracelm.cli", "chat", "--model", str(tiny_gguf), "--message", "hi",
                           "--max-tokens", "3"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert chat.returncode == 0 and "generated]" in chat.stderr, chat.stderr


@pytest.mark.model
def test_the_readme_lines_run_outside_the_source_tree(smollm2_path: Path, tmp_path: Path) -> None:
    code = ('from tracelm import Session; s = Session("smollm2-135m-instruct"); '
            'print(s.chat("What is the capital of France?", temperature=0, max_tokens=12))')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "Paris" in out.stdout, out.stderr


def test_packaged_configs_are_found_by_name(tiny_gguf: Path, tmp_path: Path) -> None:
    """`tracelm run smollm2` reads the packaged configs/smollm2.yaml from any directory; an unknown name says
    which configs are packaged."""
    from tracelm.session import run_config

    cfg = run_config(None, "smollm2", ["max_tokens=3"])
    assert cfg.model == "smollm2-135m-instruct" and cfg.max_tokens == 3
    with pytest.raises(TracelmError, match=r"no-such-config: no such config file.*packaged: gemma3, qwen2.5-coder"):
        run_config(None, "no-such-config")
    run = subprocess.run([sys.executable, "-m", "tracelm.cli", "run", "smollm2", "--model", str(tiny_gguf),
                          "--prompt", "hello", "--max-tokens", "2"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0 and "2 generated" in run.stderr, run.stderr


def test_a_loaded_model_is_shared_and_logits_take_a_fresh_cache(session: Session) -> None:
    other = Session(session.model, attrs.evolve(session.cfg, max_tokens=2))
    assert other.model is session.model and other.limits is None  # the caller's thread settings stand
    ids = session.encode("hello world")
    want = Runner(session.model, len(ids)).logits(ids)
    np.testing.assert_array_equal(other.logits("hello world"), want)
    assert other.generate(ids, temperature=0.0) == session.generate(ids, temperature=0.0, max_tokens=2)


def test_context_shift_keeps_the_head_and_the_latest_tokens() -> None:
    from tracelm.session import context_shift

    ids = list(range(100))
    assert context_shift(ids, 10, 90) == ids  # it fits: nothing cut
    cut = context_shift(ids, 10, 40)
    assert cut[:10] == ids[:10] and cut[10:] == ids[100 - (len(cut) - 10):] and 20 < len(cut) - 10 <= 40
    # the next turn, a few tokens longer, is cut at the same place, so its prompt extends this one (prefix reuse)
    assert context_shift(list(range(105)), 10, 40)[: len(cut)] == cut
    assert context_shift(list(range(125)), 10, 40)[: len(cut)] != cut  # ... until it outgrows it


def test_shift_policy_continues_a_chat_past_the_context(tiny_gguf: Path) -> None:
    """context_policy stop refuses the turn that no longer fits; shift keeps the system prompt and the latest
    shift_keep tokens, recomputes, and goes on: each shifted prompt is the head + the conversation's end, its reply
    the one a fresh cache gives that prompt, and the turns after a shift reuse its cache."""
    from tracelm.session import chat_head, chat_prompt

    settings = ["context=400", "max_tokens=8", "sampling.temperature=0", "system=Be brief."]
    turns = [f"turn {i}: and then?" for i in range(12)]
    stop = Session(str(tiny_gguf), settings=settings)
    with pytest.raises(TracelmError, match="no longer fits the context of 400"):
        for t in turns:
            stop.chat(t)
    shift = Session(str(tiny_gguf), settings=[*settings, "context_policy=shift"])  # shift_keep 0: half the context
    head = chat_head(shift.model, shift.messages)
    assert "Be brief." in shift.tokenizer.decode(chat_prompt(shift.model, shift.messages + [
        {"role": "user", "content": "x"}])[:head])
    reused = []
    for t in turns:
        reply = shift.chat(t)
        n = shift.stats.n_prompt
        prompt = shift.runner.cache.tokens[:n]
        full = chat_prompt(shift.model, shift.messages[:-1])
        assert n + shift.stats.n_generated <= 400 and len(full) - n == shift.shifted
        assert prompt[:head] == full[:head] and prompt[head:] == full[len(full) - (n - head):]
        if shift.shifted:
            assert n - head <= 200
            fresh = Runner(shift.model, 400).generate(prompt, 8, SamplingParams(temperature=0.0))
            assert "".join(fresh).strip() == reply.strip()
            reused.append(shift.stats.n_reused)
    assert len(reused) >= 3 and max(reused) > head  # shifted at least thrice; a later turn built on a shifted one


def test_a_loaded_gguf_lets_its_vocabulary_arrays_go(tiny_gguf: Path) -> None:
    """The file's vocabulary-sized metadata (tokens, token types) stays out of the loaded model and goes from the
    ModelFile once loaded; the tokenizer works on from its own tables, and a fresh ModelFile (export's) has them all."""
    from tracelm.io.loader import ModelFile

    src = ModelFile(str(tiny_gguf))
    tokens = list(src.metadata["tokenizer.ggml.tokens"])
    assert len(tokens) >= 256 and len(src.metadata["tokenizer.ggml.token_type"]) >= 256
    ids = src.tokenizer.encode("hello world")
    model = src.load(progress=False)
    for meta in (src.metadata, model.metadata):
        assert "tokenizer.ggml.tokens" not in meta and "tokenizer.ggml.token_type" not in meta
    assert "tokenizer.ggml.merges" in model.metadata   # short arrays stay
    assert model.tokenizer.encode("hello world") == ids
    assert list(ModelFile(str(tiny_gguf)).metadata["tokenizer.ggml.tokens"]) == tokens
