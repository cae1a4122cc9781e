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
