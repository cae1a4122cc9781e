"""The endpoints people script against, on a live `tracelm serve` over loopback, each driven by its real client
where one exists: GET /metrics (Prometheus text, read back with prometheus_client's parser), POST /tokenize and
/detokenize (llama-server's shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error

parser = pytest.importorskip("prometheus_client.parser")

KEY = "endpoints-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 128


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    work = tmp_path_factory.mktemp("endpoints-server")
    config = {"model": str(tiny_gguf), "context": CONTEXT, "max_tokens": 8, "threads": 1,
              "sampling": {"temperature": 0.0}, "server": {"queue_size": 2, "api_key_env": "TRACELM_TEST_KEY"}}
    server = ServerProcess(work, config, env={"TRACELM_TEST_KEY": KEY})
    server.model_id = tiny_gguf.stem
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_session(tiny_gguf: Path):
    from tracelm import Session

    with Session(str(tiny_gguf)) as s:
        yield s


def post(server: ServerProcess, path: str, body):
    return server.request("POST", path, body, AUTH)


def scrape(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus_client's own text parser."""
    r = server.request("GET", "/metrics", headers=AUTH)
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain; version=")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(r.text) for s in family.samples}


# --- /metrics -------------------------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_latency_and_cache(tiny_server):
    s = tiny_server
    assert_openai_error(s.request("GET", "/metrics"), 401, code="invalid_api_key")  # behind the key
    before = scrape(s)
    for _ in range(2):
        r = post(s, "/v1/completions", {"model": s.model_id, "prompt": "hello", "max_tokens": 4})
        assert r.status == 200, r.text
    assert s.request("GET", "/no/such/route", headers=AUTH).status == 404
    after, health = scrape(s), s.wait_idle()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tracelm_http_requests_total", route="/v1/completions", status="200") == 2
    assert delta("tracelm_http_requests_total", route="other", status="404") == 1
    assert before[("tracelm_http_requests_total", (("route", "/metrics"), ("status", "401")))] == 1
    assert delta("tracelm_http_request_duration_seconds_count", route="/v1/completions") == 2
    assert delta("tracelm_time_to_first_token_seconds_count") == 2
    assert delta("tracelm_engine_requests_total", outcome="served") == 2
    counters = health["counters"]
    assert after[("tracelm_generated_tokens_total", ())] == counters["generated_tokens"] > 0
    assert after[("tracelm_prompt_tokens_total", ())] == counters["prompt_tokens"] > 0
    assert after[("tracelm_queue_depth", ())] == 0 and after[("tracelm_requests_running", ())] == 0
    assert after[("tracelm_kv_cache_bytes", (("kind", "scratch"),))] > 0
    assert after[("tracelm_model_bytes", ())] == health["memory"]["model_bytes"]


def test_each_server_has_its_own_registry(tiny_session):
    """Two servers in one process keep their numbers apart, and prometheus_client's global registry is untouched."""
    import prometheus_client

    from tracelm.server.app import Server

    a, b = Server(tiny_session), Server(tiny_session)  # the same metric names twice: no "Duplicated timeseries"
    a.metrics.requests.labels("/x", "200").inc()
    assert a.metrics.registry.get_sample_value("tracelm_http_requests_total", {"route": "/x", "status": "200"}) == 1
    assert b.metrics.registry.get_sample_value("tracelm_http_requests_total", {"route": "/x", "status": "200"}) is None
    assert prometheus_client.REGISTRY.get_sample_value("tracelm_generated_tokens_total") is None


# --- /tokenize, /detokenize --------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_in_llama_servers_shapes(tiny_server, tiny_session):
    s, tok = tiny_server, tiny_session.tokenizer
    text = "hello é<|endoftext|>"
    ids = post(s, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == tok.encode(text, add_bos=False, parse_special=True)  # parse_special defaults to true
    assert ids[-1] == tok.eos_id and ids[:2] == [tok.token_id("hell"), tok.token_id("o")]
    plain = post(s, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
    assert tok.eos_id not in plain and len(plain) > len(ids)
    pieces = post(s, "/tokenize", {"content": "hello é", "with_pieces": True}).json()["tokens"]
    assert pieces[:2] == [{"id": tok.token_id("hell"), "piece": "hell"}, {"id": tok.token_id("o"), "piece": "o"}]
    assert pieces[-2:] == [{"id": pieces[-2]["id"], "piece": [0xC3]}, {"id": pieces[-1]["id"], "piece": [0xA9]}]
    assert post(s, "/detokenize", {"tokens": ids}).json() == {"content": text}
    assert post(s, "/detokenize", {"tokens": []}).json() == {"content": ""}

    assert s.request("POST", "/tokenize", {"content": "hi"}).status == 401  # behind the key
    assert_openai_error(post(s, "/tokenize", {}), 400, param="content")
    assert_openai_error(post(s, "/tokenize", {"content": 5}), 400, param="content")
    assert_openai_error(post(s, "/tokenize", {"content": "hi", "with_pieces": "yes"}), 400, param="with_pieces")
    assert_openai_error(post(s, "/tokenize", {"content": "hi", "bogus": 1}), 400, param="bogus")
    assert_openai_error(post(s, "/detokenize", {"tokens": [1, tok.n_vocab]}), 400, param="tokens[1]")
    assert_openai_error(post(s, "/detokenize", {"tokens": "hi"}), 400, param="tokens")
    assert_openai_error(post(s, "/detokenize", b"[1, 2"), 400)
    assert s.health()["status"] == "ok"


