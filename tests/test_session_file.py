"""Session files (tracelm/io/session_file.py): a conversation saved, the process gone, resumed in a new process
gives the reply an uninterrupted session gives, token for token, and next logits equal, bit for bit, to those of
recomputing the whole conversation (plain and window-ring caches, the tiny model and SmolLM2); a file from another
model or ModelConfig, another tracelm version or compute mode, a truncated one and a tampered one are each refused
with their named error, the session left as it was; `tracelm chat --session` resumes by name and its traces
continue the chain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_tiny_gguf
from tracelm import Session
from tracelm.audit.replay import REPRODUCED, replay
from tracelm.io import session_file
from tracelm.pipeline.runner import Runner
from tracelm.state.cache import CacheSnapshot
from tracelm.state.errors import (
    SessionFileError,
    SessionFileTampered,
    SessionFileTruncated,
    SessionIncompatible,
    SessionModelMismatch,
)
from tracelm.tools.child import run_child

SETTINGS = ["context=1024", "max_tokens=24", "sampling.temperature=0", "threads=1"]
TURNS = ("hello there, how are you today?", "tell me about the weather", "and what else?")
WINDOW = 16


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer attends over a window of 16: its KV is a ring (see tests/test_window_cache.py)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("sf-window") / "tiny-window.gguf", window=WINDOW, seed=3)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's shape with other weights: another sha256, the same ModelConfig."""
    return write_tiny_gguf(tmp_path_factory.mktemp("sf-other") / "tiny-other.gguf", seed=7)


def _chatted(model: str, settings: list[str] = SETTINGS, turns: tuple[str, ...] = TURNS[:2]) -> Session:
    s = Session(model, settings=settings)
    for turn in turns:
        s.chat(turn)
    return s


def resume_and_reply(model: str, settings: list[str], path: str, message: str) -> dict:
    """In a child process: a new Session resumes `path` and replies to `message` (greedy)."""
    s = Session(model, settings=settings)
    s.load(path)
    messages = [dict(m) for m in s.messages]
    reply = s.chat(message)
    return {"reply": reply, "tokens": list(s.stats.tokens), "reused": s.stats.n_reused, "messages": messages}


def _next_logits(runner: Runner, ids: list[int]) -> np.ndarray:
    return np.asarray(runner.prefill(ids).values[-1])


@pytest.mark.parametrize("kind", ["plain", "window"])
def test_a_resumed_session_replies_as_the_uninterrupted_one(kind: str, tiny_gguf: Path, windowed: Path,
                                                            tmp_path: Path) -> None:
    model = str(tiny_gguf if kind == "plain" else windowed)
    live = _chatted(model)
    path = tmp_path / "conv.tlsession"
    live.save(path)
    held = len(live.runner.cache.tokens)
    if kind == "window":
        assert live.runner.cache.ring and held > live.runner.cache.ring  # the ring has wrapped: a partial snapshot
    got = run_child(resume_and_reply, model, SETTINGS, str(path), TURNS[2], timeout=300)
    want = live.chat(TURNS[2])
    assert got["messages"] == live.messages[:-2]
    assert got["tokens"] == live.stats.tokens and got["reply"] == want
    assert got["reused"] == live.stats.n_reused > 0  # the restored Cache was built on, not recomputed


@pytest.mark.parametrize("kind", ["plain", "window", "smaller-ring"])
def test_resumed_logits_equal_recomputing_the_conversation(kind: str, tiny_gguf: Path, windowed: Path,
                                                           tmp_path: Path) -> None:
    """Next logits after a restore equal, bitwise, those of one pass over the whole conversation; one value of
    the snapshot changed gives other logits (the comparison can fail)."""
    model = str(tiny_gguf if kind == "plain" else windowed)
    live = _chatted(model)
    path = tmp_path / "conv.tlsession"
    live.save(path)
    ids = [*live.runner.cache.tokens, *live.encode(" more")]
    want = Runner(live.model, len(ids)).logits(ids)[-1]
    slack = 8 if kind == "smaller-ring" else 64  # a ring of 23 slots keeps the newest 23 of the 79 saved
    runner = Runner(live.model, 1024, draft_tokens=0) if slack == 64 else _runner_with_slack(live, slack)
    saved = session_file.read_session(path)
    runner.cache.restore(saved.snapshot)
    np.testing.assert_array_equal(_next_logits(runner, ids), want)
    assert runner.stats.n_reused == len(saved.snapshot.tokens)  # the restored positions were built on
    keys = [np.array(k) for k in saved.snapshot.keys]
    keys[-1][0, -1, 0] += 0.5
    runner.cache.restore(CacheSnapshot(saved.snapshot.tokens, saved.snapshot.first, keys, saved.snapshot.values))
    assert not np.array_equal(_next_logits(runner, ids), want)


def _runner_with_slack(live: Session, slack: int) -> Runner:
    from tracelm.pipeline.graph import new_cache

    runner = Runner(live.model, 1024)
    runner.cache = new_cache(live.model.cfg, 1024, slack)
    assert runner.cache.ring == WINDOW - 1 + slack
    return runner


def test_refusals_name_the_file(tiny_gguf: Path, other_model: Path, windowed: Path, tmp_path: Path) -> None:
    """Another model (sha256), another ModelConfig, another version or compute mode, a truncated file (cut in
    its header, in its arrays, before its hash), a tampered one (a byte of a key, of the header) and one that
    is no session file: each refused with its named error naming the file; the session is left as it was."""
    live = _chatted(str(tiny_gguf))
    good = tmp_path / "good.tlsession"
    live.save(good)
    data = good.read_bytes()
    target = Session(str(tiny_gguf), settings=SETTINGS)
    target.chat("untouched")
    before = (list(target.messages), list(target.runner.cache.tokens))

    def refused(path: Path, error: type, match: str, session: Session = target) -> None:
        with pytest.raises(error, match=match) as e:
            session.load(path)
        assert str(path) in str(e.value)
        assert (session.messages, session.runner.cache.tokens) == before or session is not target

    def variant(name: str, content: bytes) -> Path:
        (tmp_path / name).write_bytes(content)
        return tmp_path / name

    refused(good, SessionModelMismatch, "another model", Session(str(other_model), settings=SETTINGS))
    refused(good, SessionModelMismatch, "another model", Session(str(windowed), settings=SETTINGS))
    refused(good, SessionIncompatible, "compute kernels", Session(str(tiny_gguf), settings=[*SETTINGS,
                                                                                           "compute=reference"]))
    head_end = len(session_file.MAGIC) + 8 + int.from_bytes(data[16:24], "little")
    for cut in (10, 20, head_end - 5, head_end + 200, len(data) - 1):
        refused(variant(f"cut{cut}.tlsession", data[:cut]), SessionFileTruncated, "truncated")
    flipped = bytearray(data)
    flipped[head_end + 100] ^= 1
    refused(variant("flip-kv.tlsession", bytes(flipped)), SessionFileTampered, "sha256")
    text = data[24:head_end].replace(b'"kind":"chat"', b'"kind":"chaT"')
    refused(variant("flip-head.tlsession", data[:24] + text + data[head_end:]), SessionFileTampered, "sha256")
    refused(variant("longer.tlsession", data + b"\0"), SessionFileTampered, "past the end")
    refused(variant("nonsense.tlsession", b"GGUF" + data[4:]), SessionFileError, "not a tracelm session file")
    refused(tmp_path / "missing.tlsession", SessionFileError, "cannot read")
    old = session_file.read_session(good)
    import attrs

    session_file.write_session(tmp_path / "old.tlsession", attrs.evolve(old, tracelm_version="0.0.1"))
    refused(tmp_path / "old.tlsession", SessionIncompatible, "tracelm 0.0.1")
    other_format = data.replace(b'"format_version":1', b'"format_version":9', 1)
    refused(variant("v9.tlsession", other_format), SessionIncompatible, "format version 9")
    target.load(good)  # the same bytes, whole: resumed
    assert target.messages == live.messages and target.runner.cache.tokens == live.runner.cache.tokens


def test_a_save_is_atomic_and_leaves_no_temporary(tiny_gguf: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A save replaces the file whole; one that fails before its rename (here: fsync) leaves the old file as it
    was and no temporary beside it."""
    live = _chatted(str(tiny_gguf), turns=TURNS[:1])
    path = tmp_path / "s" / "conv.tlsession"
    size = live.save(path)
    assert path.stat().st_size == size and sorted(p.name for p in path.parent.iterdir()) == ["conv.tlsession"]
    old = path.read_bytes()
    live.chat(TURNS[1])

    def no_fsync(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session_file.os, "fsync", no_fsync)
    with pytest.raises(SessionFileError, match="cannot write session file: No space left"):
        live.save(path)
    assert path.read_bytes() == old and sorted(p.name for p in path.parent.iterdir()) == ["conv.tlsession"]
    monkeypatch.undo()
    live.save(path)  # replaced whole
    assert session_file.read_session(path).snapshot.tokens == tuple(live.runner.cache.tokens)


def _chat_cli(model: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACELM_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "tracelm.cli", "chat", "--model", str(model), "--max-tokens", "12",
                           "--temperature", "0", "--set", "threads=1", *args], capture_output=True, text=True,
                          timeout=300, env=env, stdin=subprocess.DEVNULL)


def test_chat_session_resumes_by_name_and_its_trace_continues_the_chain(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    once = _chat_cli(tiny_gguf, home, "--message", TURNS[0], "--message", TURNS[1])
    first = _chat_cli(tiny_gguf, home, "--session", "talk", "--message", TURNS[0], "--trace", str(tmp_path / "1.jsonl"))
    second = _chat_cli(tiny_gguf, home, "--session", "talk", "--message", TURNS[1],
                       "--trace", str(tmp_path / "2.jsonl"))
    assert once.returncode == first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert "resumed session talk: 2 messages" in second.stderr and "resumed" not in first.stderr
    assert first.stdout + second.stdout == once.stdout  # the second process went on as one process would
    assert (home / "sessions" / "talk.tlsession").is_file()
    t1 = [json.loads(x) for x in (tmp_path / "1.jsonl").read_text().splitlines()]
    t2 = [json.loads(x) for x in (tmp_path / "2.jsonl").read_text().splitlines()]
    assert "continues" not in t1[0] and t2[0]["continues"] == t1[-1]["hash"]
    assert t2[1]["event"] == "generate" and t2[1]["reused"] > 0  # built on the resumed Cache
    assert replay(tmp_path / "2.jsonl").status == REPRODUCED  # which replay recomputes, untraced
    (home / "sessions" / "talk.tlsession").write_bytes(b"tracelm-session\n\x05")
    bad = _chat_cli(tiny_gguf, home, "--session", "talk", "--message", "hi")
    assert bad.returncode == 2 and "talk.tlsession: session file truncated" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = _chat_cli(tiny_gguf, home, "--session", "../x", "--message", "hi")
    assert bad.returncode == 2 and "a session name is letters" in bad.stderr


@pytest.mark.model
def test_smollm2_resumed_in_a_new_process_replies_as_uninterrupted(smollm2_path: Path, tmp_path: Path) -> None:
    settings = ["context=1024", "max_tokens=32", "sampling.temperature=0", "threads=1"]
    live = _chatted(str(smollm2_path), settings, ("What is the capital of France?", "And of Italy?"))
    path = tmp_path / "smol.tlsession"
    live.save(path)
    got = run_child(resume_and_reply, str(smollm2_path), settings, str(path), "And of Spain?", timeout=600)
    want = live.chat("And of Spain?")
    assert got["tokens"] == live.stats.tokens and got["reply"] == want and got["reused"] > 0 and want
    snap = session_file.read_session(path).snapshot
    ids = [*snap.tokens, *live.encode(" Thanks")]
    runner = Runner(live.model, 1024)
    runner.cache.restore(snap)
    np.testing.assert_array_equal(_next_logits(runner, ids), Runner(live.model, len(ids)).logits(ids)[-1])
    assert runner.stats.n_reused == len(snap.tokens)
