"""Issue 29: hostile files and numbers -- every count a model file gives checked against what the file holds before
anything loops or allocates by it (each case under a time limit: it hung before), big numbers and deep nesting failing
one request or one batch line, the template worker under `ulimit -v`, and files that are not regular files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from tests.conftest import child_env
from tests.test_hardening import assert_one_line, folder_with, rewrite_gguf, run
from tracelm.state.errors import ModelFormatError

VT = gguf.GGUFValueType


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """A TimeoutError in the test's own thread if the block runs longer (the loops that hung were Python's)."""
    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.conftest import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("hostile") / "tiny.gguf")


# ---------------------------------------------------------------- item 1: counts against what the file holds

COUNT_CASES = [
    ({"llama.block_count": (1 << 40, VT.UINT64)}, "llama.block_count is 1099511627776, but the file holds the "
                                                  "tensors of 2 blocks"),
    ({"llama.block_count": (10**9, VT.UINT32)}, "llama.block_count is 1000000000, but the file holds"),
    ({"llama.block_count": (3, VT.UINT32)}, "llama.block_count is 3, but the file holds the tensors of 2 blocks"),
    ({"llama.attention.head_count": (1 << 40, VT.UINT64), "llama.attention.head_count_kv": (1 << 40, VT.UINT64),
      "llama.attention.key_length": (16, VT.UINT32)}, "n_head 1099511627776, n_head_kv 1099511627776, head_dim 16"),
    ({"llama.feed_forward_length": (10**12, VT.UINT64)}, "expected 2000000000000 from n_ff 1000000000000"),
]


@pytest.mark.parametrize("changes,message", COUNT_CASES, ids=[m[:40] for _, m in COUNT_CASES])
def test_a_gguf_count_beyond_its_tensors_is_named_at_once(tiny, tmp_path, capsys, changes, message) -> None:
    bad = rewrite_gguf(tiny, tmp_path / "counts.gguf", changes)
    with within(20):
        assert_one_line(*run(capsys, bad, "--prompt", "hi"), "counts.gguf", message)


def test_a_config_json_block_count_beyond_its_tensors_is_named_at_once(tiny, tmp_path) -> None:
    from tracelm.session import Session

    path = folder_with(tmp_path, {"num_hidden_layers": 10**9})
    with within(20), pytest.raises(ModelFormatError, match="config.json: num_hidden_layers is 1000000000, but the "
                                                           "file holds the tensors of 1 block$"):
        Session(str(path), settings=[f"tokenizer={tiny}", "context=32"])


def test_a_tokenizer_json_id_far_past_its_tokens_is_refused(tmp_path) -> None:
    from tracelm.io.loader import load_tokenizer

    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": level, "post_processor": None,
           "decoder": level, "model": {"type": "BPE", "vocab": {"a": 0, "b": 3_000_000}, "merges": []}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with within(20), pytest.raises(ModelFormatError, match="tokenizer.json: token 'b' has id 3000000, far past the "
                                                           "2 tokens"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


# ---------------------------------------------------------------- item 3: big numbers and deep nesting

BIG = "9" * 401  # a JSON integer past float's range
BIG_CASES = [("temperature", BIG), ("top_p", BIG), ("temperature", "-" + BIG), ("frequency_penalty", BIG),
             ("repetition_penalty", BIG), ("seed", BIG), ("max_tokens", BIG),
             ("logit_bias", '{"' + "1" * 5000 + '": 1}'), ("logit_bias", '{"1": ' + BIG + "}")]


@pytest.mark.parametrize("field,value", BIG_CASES, ids=[f"{f}={v[:8]}" for f, v in BIG_CASES])
def test_a_huge_number_in_a_request_is_a_400_naming_its_field(field, value) -> None:
    from tracelm.server.errors import ApiError
    from tracelm.server.params import parse_json, parse_request

    raw = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "' + field + '": ' + value + "}"
    with pytest.raises(ApiError) as caught:
        parse_request(parse_json(raw.encode()), "chat")
    error = caught.value.body()["error"]
    assert caught.value.status == 400 and error["param"] == field and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 200 and "characters)" in error["message"], error["message"]  # named, cut short


def test_a_batch_line_nested_deep_or_with_a_huge_number_fails_alone(tiny, tmp_path, capsys) -> None:
    from tracelm.cli import main

    good = [json.dumps({"id": i, "prompt": "hello", "max_tokens": 2}) for i in (1, 5)]
    lines = [good[0], '{"id": 2, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
             '{"id": 3, "prompt": "x", "temperature": ' + BIG + "}", '{"id": ' + "9" * 4000 + ', "prompt": "x"}',
             good[1]]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    with within(60):
        code = main(["batch", str(tiny), "--input", str(inp), "--output", str(out), "--set", "context=64"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "2 items written, 0 already done, 0 failed, 3 bad lines skipped" in err
    for expected in (f"{inp}:2: not valid JSON (nested too deeply)",
                     f"{inp}:3: field 'temperature': 999999999999999999999999... (401 characters) is too large",
                     f"{inp}:4: field 'id': expected a non-empty string or a 64-bit integer"):
        assert expected in err, expected
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [1, 5]


# ---------------------------------------------------------------- item 4: the template worker under `ulimit -v`

RENDER = ("from tracelm.io.chat_template import render_chat; "
          "print(render_chat(None, [{'role': 'user', 'content': 'hi'}]), end='')")


def test_a_chat_renders_under_a_hard_address_space_limit() -> None:
    limit = 1 << 30  # `ulimit -v 1048576`: soft and hard, inherited by the render worker

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run([sys.executable, "-c", RENDER], capture_output=True, text=True, timeout=120,
                          env=child_env(OPENBLAS_NUM_THREADS="1"), preexec_fn=cap)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- item 6: files that are not regular, names, counts


@pytest.fixture(scope="module")
def signed(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """A signed trace of the tiny model and its public key."""
    from tracelm.io.trace_keys import keygen
    from tracelm.session import Session

    work = tmp_path_factory.mktemp("signed")
    key = work / "signer.key"
    keygen(key)
    trace = work / "run.jsonl"
    with Session(str(tiny), settings=["context=64", f"trace.sign_key={key}"]) as s:
        s.generate("hello", max_tokens=2, temperature=0, trace=str(trace))
    return trace, work / "signer.key.pub"


@pytest.fixture()
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_not_waited_on(tiny, signed, fifo, tmp_path, capsys) -> None:
    from tracelm.cli import main
    from tracelm.session import Session
    from tracelm.state.errors import SessionFileError

    trace, _ = signed
    runs = [(["trace", "verify", str(fifo)], "trace is a FIFO (named pipe), not a regular file"),
            (["trace", "verify", str(trace), "--public-key", str(fifo)], "the public key is a FIFO"),
            (["batch", str(tiny), "--input", str(fifo), "--output", str(tmp_path / "o.jsonl")],
             "batch input is a FIFO"),
            (["replay", str(fifo)], "trace is a FIFO")]
    for argv, message in runs:
        with within(20):
            code = main(argv)
        assert_one_line(code, capsys.readouterr().err, str(fifo), message)
    with Session(str(tiny), settings=["context=64"]) as s, within(20):
        with pytest.raises(SessionFileError, match="session file is a FIFO"):
            s.load(fifo)


DEV_ZERO = ("import sys; from tracelm.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("args,message", [(["trace", "verify", "/dev/zero"], "trace is a character device"),
                                          (["trace", "verify", "TRACE", "--public-key", "/dev/zero"],
                                           "the public key is a character device"),
                                          (["batch", "MODEL", "--input", "/dev/zero", "--output", "OUT"],
                                           "batch input is a character device")])
def test_dev_zero_is_refused_before_it_is_read(tiny, signed, tmp_path, args, message) -> None:
    """In a child under a 2 GiB address space: reading /dev/zero to its end fails there, not on this machine."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    names = {"TRACE": str(signed[0]), "MODEL": str(tiny), "OUT": str(tmp_path / "out.jsonl")}
    done = subprocess.run([sys.executable, "-c", DEV_ZERO, *(names.get(a, a) for a in args)], capture_output=True,
                          text=True, timeout=120, env=child_env(OPENBLAS_NUM_THREADS="1"), preexec_fn=cap)
    assert_one_line(done.returncode, done.stderr, "/dev/zero", message)


def test_a_session_name_too_long_is_named(tiny, capsys, monkeypatch, tmp_path) -> None:
    from tracelm.cli import main

    monkeypatch.setenv("TRACELM_HOME", str(tmp_path))
    code = main(["chat", "--model", str(tiny), "--session", "a" * 300, "--set", "context=64"])
    assert_one_line(code, capsys.readouterr().err, "a session name is letters", "(1 to 128 of them)",
                    "(300 characters)")


def saved_session(tiny: Path, path: Path) -> Path:
    from tracelm.session import Session

    with Session(str(tiny), settings=["context=64", "max_tokens=2"]) as s:
        s.chat("hello")
        s.save(path)
    return path


@pytest.mark.parametrize("messages,message", [(5, "messages: expected an array of messages, got an integer"),
                                              ([1], "messages[0]: expected an object with a string role"),
                                              ([{"role": "user", "content": ["x"]}], "messages[0]: expected an")])
def test_a_session_file_with_wrong_typed_messages_is_named(tiny, tmp_path, messages, message) -> None:
    import attrs

    from tracelm.io.session_file import read_session, write_session
    from tracelm.session import Session
    from tracelm.state.errors import SessionFileTampered

    good = read_session(saved_session(tiny, tmp_path / "good.tlsession"))
    bad = tmp_path / "bad.tlsession"
    write_session(bad, attrs.evolve(good, messages=messages))  # re-hashed: its sha256 matches
    with Session(str(tiny), settings=["context=64"]) as s:
        with pytest.raises(SessionFileTampered, match=re.escape(message)):
            s.load(bad)
        assert s.messages == []  # left as it was


def test_a_session_file_with_a_deeply_nested_header_is_named(tmp_path) -> None:
    import hashlib
    import struct

    from tracelm.io.session_file import MAGIC, read_session
    from tracelm.state.errors import SessionFileTampered

    header = b'{"format": "tracelm-session", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    body = MAGIC + struct.pack("<Q", len(header)) + header
    path = tmp_path / "deep.tlsession"
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(SessionFileTampered, match="its header: JSON nested too deeply"):
        read_session(path)


def test_too_many_threads_are_named_from_the_command_line_and_a_trace_header(tiny, tmp_path, capsys) -> None:
    from tests.test_hardening import edit_trace
    from tracelm.cli import main
    from tracelm.session import Session

    assert_one_line(*run(capsys, tiny, "--set", "threads=300"), "config key threads", "must be <= 256: 300")
    with Session(str(tiny), settings=["context=64"]) as s:
        s.generate("hello", max_tokens=2, temperature=0, trace=str(tmp_path / "run.jsonl"))

    def many(events: list) -> None:
        events[0]["config"]["threads"] = 100_000

    edited = edit_trace(tmp_path / "run.jsonl", tmp_path / "threads.jsonl", many)
    code = main(["replay", str(edited)])
    assert_one_line(code, capsys.readouterr().err, "threads.jsonl: header config: config key threads",
                    "must be <= 256: 100000")


def test_a_file_past_its_bound_is_refused_before_it_is_read(signed, tmp_path, capsys) -> None:
    from tracelm.cli import main

    big = tmp_path / "big.pub"
    with open(big, "wb") as f:
        f.truncate((1 << 20) + 1)  # sparse: 1 MiB and a byte, the bound of a key file past it
    code = main(["trace", "verify", str(signed[0]), "--public-key", str(big)])
    assert_one_line(code, capsys.readouterr().err, "big.pub: the public key of 1048577 bytes is larger than the "
                                                   "1048576 bytes tracelm reads")
