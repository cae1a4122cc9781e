"""Issue 29: hostile files and numbers -- every count a model file gives checked against what the file holds before
anything loops or allocates by it (each case under a time limit: it hung before), big numbers and deep nesting failing
one request or one batch line, the template worker under `ulimit -v`, and files that are not regular files."""

from __future__ import annotations

import contextlib
import json
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
