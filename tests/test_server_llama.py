"""llama-server's own POST /completion (server/llama_server.py), its OpenAI routes without /v1 and /v1/health, on a
real `tracelm serve` of the tiny model: the answers' shape, the same text as /v1/completions for the same request,
streaming, stop words, log-probabilities, and a 400 naming each field the server cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    config = {"model": str(tiny_gguf), "context": 128, "max_tokens": 6, "threads": 1}
    s = ServerProcess(tmp_path_factory.mktemp("llama-server"), config)
    yield s
    s.stop()


def completion(s: ServerProcess, **body):
    return s.request("POST", "/completion", {"prompt": "hello there", "temperature": 0, **body})


def test_completion_answers_as_llama_server_does(server):
    r = completion(server, n_predict=8)
    assert r.status == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert out["tokens_predicted"] == 8 and out["tokens_evaluated"] > 0 and out["truncated"] is False
    assert out["generation_settings"]["n_predict"] == 8 and out["generation_settings"]["n_ctx"] == 128
    assert out["prompt"] == "hello there" and out["tokens"] == []
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(out["timings"])
    same = server.request("POST", "/v1/completions", {"model": "m", "prompt": "hello there", "temperature": 0,
                                                      "max_tokens": 8})
    assert same.json()["choices"][0]["text"] == out["content"]  # the same engine, the same tokens
    ids = completion(server, prompt=[104, 105], n_predict=2)  # a prompt of token ids
    assert ids.status == 200 and ids.json()["tokens_predicted"] == 2
    assert completion(server, n_predict=-1).json()["tokens_predicted"] == 6  # -1: the server's max_tokens
    for alias in ("/completions", "/chat/completions"):
        body = {"model": "m", "max_tokens": 2, **({"prompt": "hi"} if alias == "/completions" else
                                                   {"messages": [{"role": "user", "content": "hi"}]})}
        assert server.request("POST", alias, body).status == 200, alias
    assert server.request("GET", "/v1/health").status == 200


def test_streaming_ends_with_the_whole_object(server):
    whole = completion(server, n_predict=8).json()
    r = completion(server, n_predict=8, stream=True)
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert "[DONE]" not in r.text and events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == 8 and events[-1]["stop_type"] == "limit"


def test_a_stop_word_is_named(server):
    text = completion(server, n_predict=12).json()["content"]
    word = text[4:6]
    out = completion(server, n_predict=12, stop=[word, "never-there"]).json()
    assert out["stop_type"] == "word" and out["stopping_word"] == word, out
    assert out["content"] == text[: text.find(word)]


def test_log_probabilities_and_token_ids(server):
    out = completion(server, n_predict=5, n_probs=3, return_tokens=True).json()
    probs = out["completion_probabilities"]
    assert len(out["tokens"]) == len(probs) == 5 and [p["id"] for p in probs] == out["tokens"]
    for p in probs:
        assert 1 <= len(p["top_logprobs"]) <= 3 and p["logprob"] <= 0 and isinstance(p["bytes"], list)
        assert p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][-1]["logprob"]
    assert completion(server, n_predict=5, return_tokens=True).json()["tokens"] == out["tokens"]  # (greedy)


@pytest.mark.parametrize("body,param", [
    ({"grammar": "root ::= (\"a\""}, "grammar"),  # GBNF the converter cannot read
    ({"grammar": "answer ::= \"a\""}, "grammar"),  # no root rule
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, "grammar"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"speculative_mode": True}, "speculative_mode"),
    ({"n_predict": "many"}, "n_predict"),
    ({"n_predict": -5}, "n_predict"),  # (OpenAI's max_tokens said as the request said it)
    ({"n_predict": 100000}, "n_predict"),
    ({"response_fields": "content"}, "response_fields"),
    ({"n_probs": 9}, "n_probs"),
    ({"logit_bias": [["hello", 1.0]]}, "logit_bias"),
    ({"json_schema": "an object"}, "json_schema"),
    ({"stream": "yes"}, "stream"),
    ({"return_tokens": 1}, "return_tokens"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_what_it_cannot_honour_is_a_400_naming_it(server, body, param):
    assert_openai_error(completion(server, **body), 400, param=param)


def test_neutral_samplers_ignored_options_and_llama_cpp_values_are_accepted(server):
    r = completion(server, n_predict=3, mirostat=0, typical_p=1.0, tfs_z=1, cache_prompt=True, id_slot=-1, n_keep=0,
                   top_k=-1, seed=-1, repeat_last_n=-1, logit_bias=[[104, False], ["105", -1.5]], ignore_eos=True,
                   samplers=["top_k", "top_p", "infill"], n_indent=4, t_max_prompt_ms=500, t_max_predict_ms=1000)
    assert r.status == 200, r.text
    settings = r.json()["generation_settings"]
    assert settings["top_k"] == 0 and settings["repeat_last_n"] == 1 << 30 and 0 <= settings["seed"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = completion(server, n_predict=12, json_schema=schema, temperature=0.8, seed=5).json()
    assert out["content"].startswith("{"), out  # the schema's grammar: the same tokens as response_format's
    same = server.request("POST", "/v1/completions", {
        "model": "m", "prompt": "hello there", "max_tokens": 12, "temperature": 0.8, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}})
    assert same.json()["choices"][0]["text"] == out["content"]


def test_a_gbnf_grammar_constrains_as_on_the_openai_routes(server):
    """llama-server's `grammar` (GBNF) on /completion and on /v1/completions: converted to Lark, the same text."""
    gbnf = 'root ::= word ("-" word)*\nword ::= [a-h]+'
    out = completion(server, n_predict=6, temperature=0.9, seed=3, grammar=gbnf)
    assert out.status == 200, out.text
    text = out.json()["content"]
    import re

    assert text and re.fullmatch(r"[a-h]+(-[a-h]+)*-?", text), text  # cut by n_predict: a prefix of the language
    same = server.request("POST", "/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 6,
                                                      "temperature": 0.9, "seed": 3, "grammar": gbnf})
    assert same.status == 200 and same.json()["choices"][0]["text"] == text


def test_response_fields_and_a_warm_up_that_runs_nothing(server):
    out = completion(server, n_predict=4, response_fields=["content", "timings/predicted_n", "no/such"]).json()
    assert set(out) == {"content", "predicted_n"} and out["predicted_n"] == 4
    warm = completion(server, n_predict=0, response_fields=[""])  # llama.vim's cache warm-up
    assert warm.status == 200 and warm.json() == {}
    out = completion(server, n_predict=0).json()
    assert out["tokens_predicted"] == out["tokens_evaluated"] == 0 and out["content"] == "" and out["stop"]


def test_t_max_predict_ms_limits_the_generation(server):
    out = completion(server, n_predict=100, t_max_predict_ms=1).json()
    assert out["stop_type"] == "limit" and out["tokens_predicted"] < 100, out
    assert completion(server, n_predict=100, t_max_predict_ms=60_000).json()["tokens_predicted"] == 100


def test_t_max_predict_ms_counts_from_the_end_of_the_prefill(tmp_path: Path, smollm2_path: Path):
    """An editor's long prompt on a CPU: its prefill alone may take longer than the limit, and the fill still gets
    the limit's time for its tokens (llama.cpp counts from the first token too)."""
    s = ServerProcess(tmp_path, {"model": str(smollm2_path), "context": 2048, "max_tokens": 400, "threads": 1})
    try:
        prompt = "def f(x):\n    return x\n" * 150  # ~1,350 tokens: seconds of prefill on one thread
        t = s.request("POST", "/completion", {"prompt": prompt, "n_predict": 400, "t_max_predict_ms": 300,
                                              "temperature": 0}).json()
        assert t["stop_type"] == "limit" and 1 <= t["tokens_predicted"] < 400, t  # (counted from arrival: none)
    finally:
        s.stop()


def test_an_alias_is_the_models_id(tmp_path: Path, tiny_gguf: Path):
    """server.alias (llama-server's --alias): /v1/models lists it, the answers name it, and a request may name it."""
    s = ServerProcess(tmp_path, {"model": str(tiny_gguf), "context": 64, "max_tokens": 2, "threads": 1,
                                 "server": {"alias": "team/model-v2", "strict_model": True}})
    try:
        assert [m["id"] for m in s.request("GET", "/v1/models").json()["data"]] == ["team/model-v2"]
        r = s.request("POST", "/v1/completions", {"model": "team/model-v2", "prompt": "hi", "temperature": 0})
        assert r.status == 200 and r.json()["model"] == "team/model-v2", r.text
        assert s.request("POST", "/v1/completions", {"model": "other", "prompt": "hi"}).status == 404
    finally:
        s.stop()


def test_props_says_the_defaults_the_slots_and_the_template(server):
    """llama-server's GET /props, which its web UI and scripts read before a request: the server's defaults (as a
    /completion that gives none runs), the sequences decoded together, the model and the chat template applied."""
    r = server.request("GET", "/props")
    assert r.status == 200, r.text
    p = r.json()
    d = p["default_generation_settings"]
    assert d["n_ctx"] == 128 and d["params"]["n_predict"] == 6 and p["total_slots"] == 8
    assert p["model_alias"] == "tiny-llama" and p["model_path"].endswith("tiny-llama.gguf")
    assert "{%" in p["chat_template"] and p["build_info"].startswith("tracelm ")
    assert p["modalities"] == {"vision": False, "audio": False}
    out = completion(server, temperature=d["params"]["temperature"]).json()["generation_settings"]
    assert {k: out[k] for k in ("top_k", "top_p", "min_p", "repeat_penalty")} == {
        k: d["params"][k] for k in ("top_k", "top_p", "min_p", "repeat_penalty")}
