"""Fill-in-the-middle (server/fim.py): the model's FIM tokens, the prompt's layout and how it is cut to the context;
then llama-server's POST /infill and OpenAI's `suffix` on /v1/completions on a served Qwen2.5-Coder, which fills in
the body of a function, and a 400 on a model without FIM tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm.io.loader import load_tokenizer
from tracelm.server.fim import FimTokens, fim_stops, fim_tokens, infill_ids

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def qwen_tok(qwen_coder_path: Path):
    return load_tokenizer(str(qwen_coder_path))


def test_the_tokens_by_name_or_by_metadata(qwen_tok, tiny_gguf: Path):
    fim = fim_tokens(qwen_tok, {})
    assert fim == FimTokens(qwen_tok.token_id("<|fim_prefix|>"), qwen_tok.token_id("<|fim_suffix|>"),
                            qwen_tok.token_id("<|fim_middle|>"), qwen_tok.token_id("<|fim_pad|>"),
                            qwen_tok.token_id("<|repo_name|>"), qwen_tok.token_id("<|file_sep|>"))
    assert fim_stops(qwen_tok, fim) == ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
    named = {f"tokenizer.ggml.fim_{k}_token_id": v for k, v in (("pre", 7), ("suf", 8), ("mid", 9), ("sep", 10))}
    assert fim_tokens(qwen_tok, named) == FimTokens(7, 8, 9, fim.pad, fim.rep, 10)  # the file's own say first
    assert fim_tokens(load_tokenizer(str(tiny_gguf)), {}) is None


def test_the_prompt_and_how_it_is_cut(qwen_tok):
    fim = fim_tokens(qwen_tok, {})
    enc = qwen_tok.encode
    ids = infill_ids(qwen_tok, fim, PREFIX, SUFFIX, 100, prompt="a")
    assert ids == [fim.pre, *enc(PREFIX), fim.suf, *enc(SUFFIX), fim.mid, *enc("a")]
    long_prefix, long_suffix = "x = 1\n" * 200, "y = 2\n" * 200
    ids = infill_ids(qwen_tok, fim, long_prefix, long_suffix, 64)
    assert len(ids) <= 64 and ids[0] == fim.pre and ids[-1] == fim.mid
    pre, suf = ids[1 : ids.index(fim.suf)], ids[ids.index(fim.suf) + 1 : -1]
    assert pre == enc(long_prefix)[-len(pre):] and suf == enc(long_suffix)[: len(suf)]  # the gap's own sides kept
    assert len(suf) <= (64 - 3) // 4 < len(pre)
    extra = [("util.py", "def sub(a, b):\n    return a - b\n")]
    ids = infill_ids(qwen_tok, fim, PREFIX, SUFFIX, 200, extra=extra)
    head = [fim.rep, *enc("myproject\n"), fim.sep, *enc("util.py\n"), *enc(extra[0][1]), fim.sep, *enc("filename\n")]
    assert ids == [*head, fim.pre, *enc(PREFIX), fim.suf, *enc(SUFFIX), fim.mid]
    assert fim.sep not in infill_ids(qwen_tok, fim, PREFIX, SUFFIX, 30, extra=extra)  # no room: the file stays out
    with pytest.raises(ValueError, match="the context leaves 3 tokens"):
        infill_ids(qwen_tok, fim, PREFIX, SUFFIX, 3)


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory, qwen_coder_path: Path):
    config = {"model": str(qwen_coder_path), "context": 512, "max_tokens": 16, "threads": 2}
    s = ServerProcess(tmp_path_factory.mktemp("fim-server"), config)
    yield s
    s.stop()


def test_infill_and_suffix_fill_in_a_function(qwen_server):
    r = qwen_server.request("POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0,
                                                "n_predict": 16})
    assert r.status == 200, r.text
    out = r.json()
    assert out["content"].startswith("a + b"), out["content"]
    assert out["prompt"].startswith("<|fim_prefix|>def add") and out["prompt"].endswith("<|fim_middle|>")
    same = qwen_server.request("POST", "/v1/completions", {"model": "m", "prompt": PREFIX, "suffix": SUFFIX,
                                                           "temperature": 0, "max_tokens": 16})
    assert same.status == 200, same.text
    assert same.json()["choices"][0]["text"] == out["content"]  # one prompt, one engine
    vscode = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [], "prompt": "", "n_predict": 8,
              "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4, "samplers": ["top_k", "top_p", "infill"],
              "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}  # llama.vscode's request
    r = qwen_server.request("POST", "/infill", vscode)
    assert r.status == 200 and r.json()["tokens_predicted"] > 0, r.text
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py", "text": "x"}],
            "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}  # llama.vim's warm-up
    r = qwen_server.request("POST", "/infill", warm)
    assert r.status == 200 and r.json() == {}, r.text
    bad = qwen_server.request("POST", "/infill", {"input_prefix": 3})
    assert_openai_error(bad, 400, param="input_prefix")
    bad = qwen_server.request("POST", "/infill", {"input_prefix": "x", "input_extra": [{"text": 5}]})
    assert_openai_error(bad, 400, param="input_extra")


def test_a_model_without_fim_tokens_says_so(tmp_path: Path, tiny_gguf: Path):
    s = ServerProcess(tmp_path, {"model": str(tiny_gguf), "context": 64, "max_tokens": 4, "threads": 1})
    try:
        r = s.request("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"})
        err = assert_openai_error(r, 400, param="input_prefix")
        assert "no fill-in-the-middle tokens" in err["message"]
        r = s.request("POST", "/v1/completions", {"model": "m", "prompt": "a", "suffix": "b"})
        assert "no fill-in-the-middle tokens" in assert_openai_error(r, 400, param="suffix")["message"]
    finally:
        s.stop()
