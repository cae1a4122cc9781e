"""Issue 29's server fuzz: hypothesis draws request bodies (the OpenAI arguments with plausible and arbitrary JSON
values, arbitrary bytes, odd paths and query strings) and sends them to the app in-process (starlette's TestClient,
the tiny model behind it); every answer is below 500, and a /v1 error is in the OpenAI shape. Derandomized (the same
inputs each run); TRACELM_SERVER_FUZZ_EXAMPLES sets how many (CI: the default, ~20-40 s here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

EXAMPLES = int(os.environ.get("TRACELM_SERVER_FUZZ_EXAMPLES", "600"))


@pytest.fixture(scope="module")
def client(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    from tracelm.server.app import Server
    from tracelm.session import Session, run_config

    traces = tmp_path_factory.mktemp("fuzz-traces")
    cfg = run_config(model=str(tiny_gguf), settings=["context=96", "max_tokens=4", "threads=1", "server.max_sessions=4",
                                                     f"server.trace_dir={traces}", "server.max_batch=4"])
    session = Session(config=cfg)
    with TestClient(Server(session).app(), base_url="http://127.0.0.1:8080", raise_server_exceptions=False) as c:
        yield c
    session.close()


BIG = st.integers(-(10**400), 10**400)  # JSON numbers beyond every machine type
SCALAR = (st.none() | st.booleans() | st.integers() | st.integers(-3, 300) | BIG
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=12)


def maybe(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value of an argument, sometimes any JSON at all."""
    return st.one_of(plausible, plausible, JSON)


TEXT = st.text(max_size=40)
MESSAGE = st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "assistant", "tool"])),
                                 "content": maybe(TEXT)},
                                optional={"name": TEXT, "tool_call_id": TEXT,
                                          "tool_calls": maybe(st.lists(st.fixed_dictionaries({
                                              "id": TEXT, "type": st.just("function"),
                                              "function": st.fixed_dictionaries({"name": TEXT,
                                                                                 "arguments": maybe(TEXT)})}),
                                              max_size=2))})
SCHEMA = st.sampled_from([{}, {"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "foo"},
                          {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"enum": ["x", "y"]}, {"$ref": "#/nope"}])
TOOL = st.fixed_dictionaries({"type": maybe(st.just("function")), "function": st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["f", "get_weather", ""])), "parameters": maybe(SCHEMA)},
    optional={"description": TEXT, "strict": st.booleans()})})
COMMON = {
    "model": maybe(st.sampled_from(["m", "tiny-llama", ""])),
    "max_tokens": maybe(st.integers(-2, 6)),
    "temperature": maybe(st.floats(-1, 3)), "top_p": maybe(st.floats(-0.5, 1.5)), "top_k": maybe(st.integers(-2, 50)),
    "min_p": maybe(st.floats(-0.5, 1.5)), "seed": maybe(st.integers(-1, 2**64)),
    "repetition_penalty": maybe(st.floats(-1, 3)), "repeat_last_n": maybe(st.integers(-2, 100)),
    "frequency_penalty": maybe(st.floats(-3, 3)), "presence_penalty": maybe(st.floats(-3, 3)),
    "stop": maybe(st.one_of(TEXT, st.lists(TEXT, max_size=20))), "n": maybe(st.integers(0, 6)),
    "stream": maybe(st.booleans()), "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "session_id": maybe(st.from_regex(r"[a-z]{1,6}", fullmatch=True)),
    "logprobs": maybe(st.one_of(st.booleans(), st.integers(-1, 6))),
    "logit_bias": maybe(st.dictionaries(st.integers(-5, 400).map(str), st.floats(-200, 200), max_size=3)),
    "response_format": maybe(st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}),
                                       st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                                              st.fixed_dictionaries({"name": TEXT,
                                                                                     "schema": SCHEMA})}))),
    "guided_regex": maybe(st.sampled_from(["[ab]{1,3}", "(", "a*", "[", r"\d+"])),
    "guided_grammar": maybe(st.sampled_from(['start: "a" | "b"', "start: nowhere", "%%%", ""])),
    "user": maybe(TEXT), "unknown_argument": JSON,
}
COMPLETION_ARGS = {**COMMON, "prompt": maybe(st.one_of(TEXT, st.lists(st.integers(-2, 300), max_size=8))),
                   "echo": JSON, "best_of": maybe(st.integers(0, 3)), "suffix": JSON}
CHAT_ARGS = {**COMMON, "messages": maybe(st.lists(MESSAGE, max_size=3)),
             "max_completion_tokens": maybe(st.integers(-1, 6)), "top_logprobs": maybe(st.integers(-1, 21)),
             "tools": maybe(st.lists(TOOL, max_size=2)),
             "tool_choice": maybe(st.one_of(st.sampled_from(["auto", "none", "required", "x"]), st.fixed_dictionaries(
                 {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}))),
             "parallel_tool_calls": JSON, "functions": JSON}


def body(base: dict, args: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A request that would be served (`base`) with up to 3 of `args` drawn; or any subset of them alone."""
    some = st.lists(st.sampled_from(sorted(args)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: args[k] for k in keys}))
    return st.one_of(some.map(lambda drawn: {**base, **drawn}), some.map(lambda drawn: {**base, **drawn}),
                     st.fixed_dictionaries({}, optional=args))


COMPLETION = body({"model": "m", "prompt": "hello", "max_tokens": 3}, COMPLETION_ARGS)
CHAT = body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, CHAT_ARGS)


def body_bytes(drawn: object) -> bytes:
    return drawn if isinstance(drawn, bytes) else json.dumps(drawn).encode()


REQUESTS = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/completions"), st.one_of(COMPLETION, COMPLETION, JSON, st.binary(
        max_size=64))),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.one_of(CHAT, CHAT, JSON, st.binary(max_size=64))),
    st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
              st.one_of(st.sampled_from(["/v1/models", "/health", "/api/info", "/", "/trace", "/static/chat.js"]),
                        st.text(max_size=20).map(lambda s: "/v1/models/" + quote(s, safe="")),
                        st.text(max_size=20).map(lambda s: "/api/trace/request/" + quote(s, safe="")),
                        st.text(max_size=20).map(lambda s: "/static/" + quote(s, safe="")),
                        st.text(max_size=20).map(lambda s: "/v1/attestation?nonce=" + quote(s, safe=""))),
              st.one_of(st.just(b""), st.binary(max_size=32))),
    st.tuples(st.just("POST"), st.just("/api/trace/verify"), st.one_of(st.binary(max_size=200), JSON)),
)


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=REQUESTS, accept_ndjson=st.booleans())
def test_no_request_body_gets_a_5xx(client, request, accept_ndjson):
    method, path, body = request
    headers = {"Content-Type": "application/json"}
    if accept_ndjson:
        headers["Accept"] = "application/x-ndjson"
    r = client.request(method, path, content=body_bytes(body), headers=headers)
    assert r.status_code < 500, (method, path, body, r.status_code, r.text[:500])
    assert "Traceback" not in r.text and '"server_error"' not in r.text, r.text[-500:]  # a stream's error frame too
    if r.status_code >= 400 and path.startswith("/v1/"):
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def test_the_fuzzed_server_is_still_healthy(client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["counters"]["failed"] == 0, h
