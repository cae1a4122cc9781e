"""`tracelm serve` on the tiny synthetic model: bad input of every kind gets the right 4xx in the OpenAI
error shape and the server keeps serving; API key; body limit; sessions (reuse, isolation, LRU);
per-request traces. Plus the pieces in-process: request checks, the session store, the runner's hooks."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm import TracelmError
from tracelm.server.errors import ApiError
from tracelm.server.params import parse_json, parse_request
from tracelm.server.sessions import SessionStore

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 128


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    work = tmp_path_factory.mktemp("tiny-server")
    config = {
        "model": str(tiny_gguf), "context": CONTEXT, "max_tokens": 16, "threads": 1,
        "sampling": {"temperature": 0.0},
        "server": {"queue_size": 2, "max_body_bytes": 65536, "max_sessions": 2, "api_key_env": "TRACELM_TEST_KEY",
                   "trace_dir": str(work / "traces")},
    }
    server = ServerProcess(work, config, env={"TRACELM_TEST_KEY": KEY})
    server.traces = work / "traces"
    server.model_id = tiny_gguf.stem
    yield server
    server.stop()


def post(server: ServerProcess, path: str, body, headers=None):
    return server.request("POST", path, body, {**AUTH, **(headers or {})})


def completion(server: ServerProcess, **kw):
    r = post(server, "/v1/completions", {"model": server.model_id, **kw})
    assert r.status == 200, r.text
    return r.json()


# --- the HTTP surface -------------------------------------------------------------------------------------


def test_health_models_and_key(tiny_server):
    s = tiny_server
    assert s.request("GET", "/health").status == 200  # health needs no key (for probes)
    assert_openai_error(s.request("GET", "/v1/models"), 401, code="invalid_api_key")
    for bad in ("Bearer wrong", "Basic " + KEY, KEY, "Bearer " + KEY[:-1], "Bearer"):
        assert_openai_error(s.request("GET", "/v1/models", headers={"Authorization": bad}), 401,
                            code="invalid_api_key")
        r = s.request("POST", "/v1/completions", {"model": s.model_id, "prompt": "hi"}, {"Authorization": bad})
        assert_openai_error(r, 401, code="invalid_api_key")
    models = s.request("GET", "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [s.model_id]
    assert s.request("GET", f"/v1/models/{s.model_id}", headers=AUTH).json()["id"] == s.model_id
    assert_openai_error(s.request("GET", "/v1/models/nope", headers=AUTH), 404, code="model_not_found")


def M(**kw):  # a completions body with the tiny model filled in at request time
    return ("completion", kw)


def C(**kw):
    return ("chat", kw)


BAD_REQUESTS = [
    (M(prompt="hi", max_tokens="4"), 400, "max_tokens", None),
    (M(prompt="hi", max_tokens=True), 400, "max_tokens", None),
    (M(prompt="hi", max_tokens=0), 400, "max_tokens", None),
    (M(prompt="hi", max_tokens=2.5), 400, "max_tokens", None),
    (M(prompt="hi", temperature="hot"), 400, "temperature", None),
    (M(prompt="hi", temperature=3), 400, "temperature", None),
    (M(prompt="hi", top_p=0), 400, "top_p", None),
    (M(prompt="hi", top_k=-1), 400, "top_k", None),
    (M(prompt="hi", min_p=1.5), 400, "min_p", None),
    (M(prompt="hi", frequency_penalty=2.5), 400, "frequency_penalty", None),
    (M(prompt="hi", presence_penalty=[1]), 400, "presence_penalty", None),
    (M(prompt="hi", repetition_penalty=0), 400, "repetition_penalty", None),
    (M(prompt="hi", seed=-1), 400, "seed", None),
    (M(prompt="hi", stop=5), 400, "stop", None),
    (M(prompt="hi", stop=[""]), 400, "stop", None),
    (M(prompt="hi", stop=["a"] * 17), 400, "stop", None),
    (M(prompt="hi", stop=["a" * 1025]), 400, "stop", None),
    (M(prompt="hi", n=9), 400, "n", None),  # more than server.max_batch
    (M(prompt="hi", best_of=3), 400, "best_of", "unsupported"),
    (M(prompt="hi", echo=True, stream=True), 400, "echo", None),
    (M(prompt="hi", echo="yes"), 400, "echo", None),
    (M(prompt="hi", max_tokens=0), 400, "max_tokens", None),  # 0 only with echo
    (M(prompt="hi", logit_bias={"x": 10}), 400, "logit_bias", None),
    (M(prompt="hi", logit_bias={"5": 101}), 400, "logit_bias", None),
    (M(prompt="hi", logit_bias=[5, 10]), 400, "logit_bias", None),
    (M(prompt="hi", logit_bias={"99999": 1}), 400, "logit_bias", None),
    (M(prompt="hi", guided_regex="[a-"), 400, "guided_regex", None),
    (M(prompt="hi", guided_grammar="start: nowhere"), 400, "guided_grammar", None),
    (M(prompt="hi", guided_regex="a", guided_grammar="start: \"a\""), 400, "guided_grammar", None),
    (M(prompt="hi", response_format={"type": "yaml"}), 400, "response_format", None),
    (M(prompt="hi", response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
     "response_format.json_schema.name", None),
    (M(prompt="hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     400, "response_format", None),
    (M(prompt="hi", logprobs=9), 400, "logprobs", None),
    (M(prompt="hi", stream="yes"), 400, "stream", None),
    (M(prompt="hi", stream_options={"include_usage": True}), 400, "stream_options", None),
    (M(prompt="hi", session_id="no spaces allowed"), 400, "session_id", None),
    (M(prompt="hi", session_id=7), 400, "session_id", None),
    (M(prompt="hi", frobnicate=1), 400, "frobnicate", "unrecognized_argument"),
    (M(), 400, "prompt", None),
    (M(prompt={"text": "hi"}), 400, "prompt", None),
    (M(prompt=["one", "two"], stream=True), 400, "stream", None),  # several prompts: not streamed
    (M(prompt=["one"] * 65), 400, "prompt", None),
    (M(prompt=["one", [1, 99999]]), 400, "prompt", None),  # each prompt checked as a request's own
    (M(prompt=[1, 2, 99999]), 400, "prompt", None),
    (M(prompt=""), 400, "prompt", None),
    (M(prompt="hi", max_tokens=CONTEXT), 400, "max_tokens", "context_length_exceeded"),
    (M(prompt="x " * 200), 400, "prompt", "context_length_exceeded"),
    (C(), 400, "messages", None),
    (C(messages="hi"), 400, "messages", None),
    (C(messages=[]), 400, "messages", None),
    (C(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].tool_call_id", None),
    (C(messages=[{"role": "function", "content": "x"}]), 400, "messages[0].role", None),
    (C(messages=[{"role": [], "content": ""}]), 400, "messages[0].role", None),  # unhashable: found by the fuzz
    (C(messages=[{"role": {"a": 1}, "content": "x"}]), 400, "messages[0].role", None),
    (C(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    (C(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", None),
    (C(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), 400, "messages[0]", None),
    (C(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]), 400, "tools[0]", None),
    (C(messages=[{"role": "user", "content": "hi"}], functions=[{"name": "f"}]), 400, "functions", "unsupported"),
    (C(messages=[{"role": "user", "content": "hi"}], top_logprobs=3), 400, "top_logprobs", None),
    (C(messages=[{"role": "user", "content": "hi"}], prompt="hi"), 400, "prompt", "unrecognized_argument"),
]


@pytest.mark.parametrize("case", range(len(BAD_REQUESTS)))
def test_bad_requests_get_400_in_openai_shape(tiny_server, case):
    (kind, body), status, param, code = BAD_REQUESTS[case]
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    assert_openai_error(post(tiny_server, path, {"model": tiny_server.model_id, **body}), status, param, code)


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b'"text"', b"\xff\xfe{}",
                                 b'{"model": "m", "max_tokens": NaN}', b"[" * 60000])
def test_malformed_bodies_get_400(tiny_server, raw):
    assert_openai_error(post(tiny_server, "/v1/completions", raw), 400)


def test_unknown_model_route_and_method(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 1})
    assert r.status == 200 and r.json()["model"] == tiny_server.model_id  # any name: the loaded model serves it
    assert_openai_error(post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                        400, "model")
    assert_openai_error(tiny_server.request("GET", "/v1/nothing", headers=AUTH), 404)
    assert_openai_error(tiny_server.request("GET", "/v1/completions", headers=AUTH), 405)


def test_huge_bodies_get_413_and_the_server_keeps_serving(tiny_server):
    filler = "x" * (2 << 20)
    body = json.dumps({"model": tiny_server.model_id, "prompt": filler}).encode()
    assert_openai_error(post(tiny_server, "/v1/completions", body), 413, code="request_too_large")
    # a client that claims a huge body and sends little: the declared length alone is refused
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n{")
        head = sock.recv(65536).decode()
        assert head.startswith("HTTP/1.1 413"), head
    assert completion(tiny_server, prompt="hello", max_tokens=4)["usage"]["completion_tokens"] >= 1


def test_server_survives_the_faults_without_tracebacks(tiny_server):
    """Runs after the fault tests in this module: the server still answers and never logged a traceback."""
    out = completion(tiny_server, prompt="hello", max_tokens=8)
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert "Traceback" not in tiny_server.log()
    assert tiny_server.health()["counters"]["failed"] == 0


# --- generation, sessions, traces ---------------------------------------------------------------------------


def test_completion_shape_usage_and_trace(tiny_server):
    ids = [104, 101, 108, 108, 111]  # "hello" byte by byte
    r = post(tiny_server, "/v1/completions", {"model": tiny_server.model_id, "prompt": ids, "max_tokens": 6,
                                              "logprobs": 2})
    assert r.status == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["id"] == r.headers["x-request-id"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == 5 and usage["total_tokens"] == 5 + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # no session: nothing kept from before
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) <= usage["completion_tokens"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) <= 2 and chosen <= 0.0 and max(top.values()) == pytest.approx(chosen)  # greedy: the top one

    lines = [json.loads(x) for x in (tiny_server.traces / f"{out['id']}.jsonl").read_text().splitlines()]
    kinds = [x.get("event") for x in lines]
    assert kinds[0] == "header" and kinds[-1] == "footer" and "request" in kinds and "stage" in kinds
    assert lines[0]["prompt_ids"] == ids
    assert lines[0]["config"]["max_tokens"] == 6 and lines[0]["config"]["sampling"]["temperature"] == 0.0
    assert lines[-1]["n_generated"] == usage["completion_tokens"]
    assert next(x for x in lines if x.get("event") == "request")["request_id"] == out["id"]


def test_streaming_equals_plain_and_ndjson(tiny_server):
    body = {"model": tiny_server.model_id, "prompt": "hello", "max_tokens": 10}
    plain = completion(tiny_server, **body)["choices"][0]["text"]
    r = post(tiny_server, "/v1/completions", {**body, "stream": True})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    r = post(tiny_server, "/v1/completions", {**body, "stream": True}, {"Accept": "application/x-ndjson"})
    assert r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(x) for x in r.text.splitlines()]
    assert "".join(c["choices"][0]["text"] for c in rows) == plain


def test_sessions_reuse_their_own_cache_only(tiny_server):
    s = tiny_server
    a1, b1 = [104, 101, 108, 108, 111, 32], [119, 111, 114, 108, 100, 33, 33]
    a2, b2 = a1 + [97, 98, 99], b1 + [120, 121]

    def run(ids, session=None):
        body = {"prompt": ids, "max_tokens": 8, **({"session_id": session} if session else {})}
        out = completion(s, **body)
        return out["choices"][0]["text"], out["usage"]

    fresh = {tuple(p): run(p)[0] for p in (a1, b1, a2, b2)}
    text, usage = run(a1, "A")
    assert text == fresh[tuple(a1)] and usage["prompt_tokens"] == 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert run(b1, "B")[0] == fresh[tuple(b1)]
    out = completion(s, prompt=a2, max_tokens=8, session_id="A")  # A still holds a1 (+ output): only new tokens
    text, usage = out["choices"][0]["text"], out["usage"]
    assert text == fresh[tuple(a2)]
    assert len(a1) <= usage["prompt_tokens_details"]["cached_tokens"] < len(a2)
    trace = [json.loads(x) for x in (s.traces / f"{out['id']}.jsonl").read_text().splitlines()]
    assert trace[-1]["n_reused"] == usage["prompt_tokens_details"]["cached_tokens"]  # the trace says so too
    request = next(x for x in trace if x.get("event") == "request")
    assert request["session_id"] == "A"
    prefilled = [x for x in trace if x.get("event") == "stage" and x.get("stage") == "embed"][0]
    assert prefilled["start"] == trace[-1]["n_reused"]  # the first stage call starts past the reused prefix
    text, usage = run(b2, "B")
    assert text == fresh[tuple(b2)] and len(b1) <= usage["prompt_tokens_details"]["cached_tokens"] < len(b2)
    # a third session evicts the least recently used (A); A starts over from nothing
    run(b1, "C")
    assert s.health()["sessions"] == 2
    text, usage = run(a2, "A")
    assert text == fresh[tuple(a2)] and usage["prompt_tokens_details"]["cached_tokens"] == 0
    # and requests without a session never reuse anything
    assert run(a2)[1]["prompt_tokens_details"]["cached_tokens"] == 0


# --- in-process pieces ---------------------------------------------------------------------------------------


def test_parse_request_defaults_and_aliases():
    r = parse_request({"model": "m", "prompt": [[1, 2]], "repeat_penalty": 1.2, "top_k": 5, "stop": "x",
                       "stream": True, "stream_options": {"include_usage": True}, "user": "u"}, "completion")
    assert (r.prompt, r.stop, r.stream, r.include_usage) == ([1, 2], ("x",), True, True)
    assert r.sampling == {"repeat_penalty": 1.2, "top_k": 5} and r.max_tokens is None and r.seed is None
    r = parse_request({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}],
                       "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 1, "logit_bias": None},
                      "chat")
    assert r.messages == [{"role": "system", "content": "ab"}] and r.max_tokens == 3 and r.logprobs == 2
    with pytest.raises(ApiError) as e:
        parse_json(b'{"a": Infinity}')
    assert e.value.status == 400


def test_session_store_lru_and_bounds():
    made = []

    def new():
        made.append(object())
        return made[-1]

    store = SessionStore(new, max_sessions=10, max_bytes=3 * 100, bytes_per_session=100)  # memory allows 3
    assert store.capacity == 3
    a, b = store.get("a"), store.get("b")
    store.get("c")
    assert store.get("a") is a  # a is now the most recent
    store.get("d")  # evicts b, the least recently used
    assert "b" not in store and store.ids() == ["c", "a", "d"] and store.evicted == 1 and store.nbytes == 300
    assert store.get("b") is not b
    with pytest.raises(TracelmError, match="sessions are off"):
        SessionStore(new, max_sessions=4, max_bytes=50, bytes_per_session=100).get("x")


def test_runner_cancel_and_on_token(tiny_gguf):
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner
    from tracelm.state.records import SamplingParams

    model = load_model(str(tiny_gguf), progress=False)
    runner = Runner(model, CONTEXT)
    seen, asked = [], []

    def cancel():
        asked.append(1)
        return len(asked) > 5

    "".join(runner.generate([104, 101], 50, SamplingParams(temperature=0.0), cancel=cancel,
                            on_token=lambda c, logits: seen.append((c.token, int(np.argmax(logits))))))
    assert runner.stats.finish_reason == "cancelled" and runner.stats.n_generated == 5 == len(seen)
    assert [t for t, _ in seen] == runner.stats.tokens == [g for _, g in seen]  # greedy: the argmax of its logits


def test_serve_cli_user_errors(tmp_path, tiny_gguf):
    import subprocess
    import sys

    from tests.test_server_helpers import REPO

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny_gguf}\ncontext: 128\n", encoding="utf-8")

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "tracelm.cli", "serve", str(cfg), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = serve("--port", str(taken.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" in r.stderr and "Traceback" not in r.stderr
    r = serve("--set", "server.queue_size=-1")
    assert r.returncode == 2 and "server.queue_size" in r.stderr and "Traceback" not in r.stderr
    r = serve("--port", "70000")
    assert r.returncode == 2 and "--port 70000" in r.stderr


# --- sessions on disk (server.sessions_dir) -------------------------------------------------------------------


def _session_files(tiny_gguf, tmp_path):
    from tracelm.io.loader import load_model
    from tracelm.pipeline.runner import Runner
    from tracelm.server.sessions import SessionFiles

    model = load_model(str(tiny_gguf), progress=False)

    def runner(ids=()):
        r = Runner(model, CONTEXT)
        if ids:
            r.prefill(list(ids))
        return r

    return SessionFiles, runner


def test_session_files_keep_within_their_bound_least_recently_used_out(tiny_gguf, tmp_path):
    SessionFiles, runner = _session_files(tiny_gguf, tmp_path)
    probe = SessionFiles(tmp_path / "probe", 1 << 30, "sha", "kernels")
    probe.save("x", runner(range(100, 140)))
    size = probe.path("x").stat().st_size
    files = SessionFiles(tmp_path / "s", int(2.5 * size), "sha", "kernels")
    for name, first in (("a", 100), ("b", 110)):
        files.save(name, runner(range(first, first + 40)))
    restored = runner()
    assert files.load("a", restored) and restored.cache.tokens == list(range(100, 140))  # a: now the most recent
    files.save("c", runner(range(120, 160)))  # over the bound: b, the least recently used, goes
    on_disk = sorted(p.name for p in files.folder.iterdir())
    assert on_disk == sorted(files.path(n).name for n in ("a", "c")) and files.evicted == 1
    assert sum(p.stat().st_size for p in files.folder.iterdir()) <= files.max_bytes
    assert not files.load("b", runner())  # gone: starts empty
    small = SessionFiles(tmp_path / "small", size // 2, "sha", "kernels")
    small.save("x", runner(range(100, 140)))  # a file larger than the whole bound is not kept
    assert list(small.folder.iterdir()) == [] and small.evicted == 1


def test_a_damaged_session_file_is_dropped_with_a_warning(tiny_gguf, tmp_path, caplog):
    SessionFiles, runner = _session_files(tiny_gguf, tmp_path)
    files = SessionFiles(tmp_path / "s", 1 << 30, "sha", "kernels")
    files.save("a", runner(range(100, 140)))
    data = files.path("a").read_bytes()
    files.path("a").write_bytes(data[:-1000])
    r = runner([100, 101, 102])
    with caplog.at_level("WARNING", logger="tracelm.server"):
        assert not files.load("a", r)
    assert r.cache.n_past == 0 and not files.path("a").exists() and files.dropped == 1
    assert "session 'a': its saved file is dropped" in caplog.text and "truncated" in caplog.text
    other = SessionFiles(tmp_path / "s", 1 << 30, "another-sha", "kernels")  # the folder of another model's server
    files.save("b", runner(range(100, 140)))
    assert not other.load("b", runner()) and "another model" in caplog.text
    assert files.load("a", runner()) is False  # dropped for good


@pytest.fixture(scope="module")
def disk_config(tmp_path_factory, tiny_gguf):
    work = tmp_path_factory.mktemp("disk-server")
    return work, {
        "model": str(tiny_gguf), "context": CONTEXT, "max_tokens": 8, "threads": 1, "context_policy": "shift",
        "sampling": {"temperature": 0.0}, "server": {"max_sessions": 2, "sessions_dir": str(work / "sessions")},
    }


def test_sessions_survive_a_restart_and_a_long_chat_shifts(disk_config, tiny_server):
    work, config = disk_config
    a1, a2 = [104, 101, 108, 108, 111, 32], [104, 101, 108, 108, 111, 32, 97, 98, 99]
    want = completion(tiny_server, prompt=a2, max_tokens=8)["choices"][0]["text"]  # no session: from nothing
    on_s = {"model": tiny_server.model_id, "max_tokens": 8, "session_id": "S"}
    first = ServerProcess(work / "1", config)
    try:
        r = first.request("POST", "/v1/completions", {**on_s, "prompt": a1})
        assert r.status == 200, r.text
    finally:
        first.stop()
    saved = list((work / "sessions").iterdir())
    assert len(saved) == 1
    second = ServerProcess(work / "2", config)
    try:
        r = second.request("POST", "/v1/completions", {**on_s, "prompt": a2})
        assert r.status == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == want
        assert len(a1) <= out["usage"]["prompt_tokens_details"]["cached_tokens"] < len(a2)  # resumed from disk
        long = [{"role": "user", "content": "tell me more " * 8}, {"role": "assistant", "content": "ok " * 10},
                {"role": "user", "content": "and then? " * 4}]
        r = second.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": long, "max_tokens": 8})
        assert r.status == 200, r.text  # context_policy shift: the head and the latest tokens
        assert r.json()["usage"]["prompt_tokens"] + 8 <= CONTEXT
    finally:
        second.stop()
    body = {"model": tiny_server.model_id, "messages": long, "max_tokens": 8}
    assert_openai_error(post(tiny_server, "/v1/chat/completions", body), 400, code="context_length_exceeded")


def test_echo_scores_the_prompt_and_prefixes_the_completion(tiny_server, tiny_gguf):
    """OpenAI's echo on /v1/completions (what evaluation harnesses send to score text: max_tokens 0 or 1, logprobs,
    echo): the prompt's tokens' logprobs -- the first null, each the model's log-softmax at the position before, the
    same numbers as the full logits give -- then the completion's, offsets running through the prompt's text."""
    from tracelm.session import Session
    from tracelm.stages.sample import top_logprobs

    ids = [5, 17, 42, 8, 99]
    r = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 0, "echo": True,
                                                        "logprobs": 2}, AUTH)
    assert r.status == 200, r.text
    out = r.json()
    choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
    with Session(str(tiny_gguf)) as s:
        tok, logits = s.tokenizer, s.runner.logits(ids)
        text = tok.decode(ids)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert lp["tokens"] == [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, 5):
        want, top, lps = top_logprobs(logits[i - 1], ids[i], 2)
        assert abs(lp["token_logprobs"][i] - want) < 1e-6
        expected = {tok.token_bytes(int(t)).decode("utf-8", "replace"): v for t, v in zip(top, lps, strict=True)}
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-6)  # (OpenAI's: keyed by the token's text)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    # max_tokens 1 (lm-eval's loglikelihood request): the prompt's entries, then the generated token's
    one = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1,
                                                          "echo": True, "logprobs": 1, "temperature": 0}, AUTH).json()
    c = one["choices"][0]
    assert c["text"].startswith(text) and len(c["logprobs"]["tokens"]) == 6
    assert c["logprobs"]["token_logprobs"][:5] == pytest.approx([None] + lp["token_logprobs"][1:], abs=1e-6)
    assert c["logprobs"]["text_offset"][5] == len(text)
    plain = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0}, AUTH).json()["choices"][0]["text"]
    assert c["text"] == text + plain
    # echo without logprobs: the text alone
    bare = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 0,
                                                           "echo": True}, AUTH).json()["choices"][0]
    assert bare["text"] == "hello" and bare["logprobs"] is None


def test_several_prompts_answer_in_prompt_order(tiny_server):
    """OpenAI's array of prompts on /v1/completions (harnesses batch their requests so): each prompt answered as if
    alone, prompt i's choice j at index i * n + j, the usage summed."""
    prompts = ["hello", [5, 17, 42], "the end"]
    alone = [tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": p, "max_tokens": 4, "n": 2,
                                                             "temperature": 0}, AUTH).json() for p in prompts]
    r = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": prompts, "max_tokens": 4, "n": 2,
                                                        "temperature": 0}, AUTH)
    assert r.status == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(a["usage"][key] for a in alone)
    assert r.headers["x-request-id"] == out["id"]
    # more prompts than the queue holds (server.queue_size 2 here): run a few at a time, not refused with a 429
    many = tiny_server.request("POST", "/v1/completions", {"model": "m", "prompt": ["a", "b", "c", "d", "e", "f"],
                                                           "max_tokens": 2, "temperature": 0}, AUTH)
    assert many.status == 200 and len(many.json()["choices"]) == 6, many.text
