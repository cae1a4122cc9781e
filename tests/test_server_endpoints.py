"""The endpoints people script against, on a live `tracelm serve` over loopback, each driven by its real client
where one exists: GET /metrics (Prometheus text, read back with prometheus_client's parser), POST /tokenize and
/detokenize (llama-server's shapes), POST /v1/embeddings (the `openai` client; checked against transformers on
SmolLM2), and Ollama's /api/chat, /api/generate, /api/tags, /api/show (the `ollama` client, unchanged)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import transformers_model
from tests.test_server_helpers import ServerProcess, assert_openai_error

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
ollama = pytest.importorskip("ollama", reason="the ollama client is in the test extra")
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


# --- /v1/embeddings -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    c = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def test_embeddings_with_the_openai_client(tiny_server, tiny_client, tiny_session):
    texts = ["hello there", "hi", "a longer text about nothing in particular"]
    out = tiny_client.embeddings.create(model=tiny_server.model_id, input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in out.data], np.float32)
    want = np.array([tiny_session.embed(t) for t in texts])
    assert [d.index for d in out.data] == [0, 1, 2] and got.shape == (3, 64)
    assert np.allclose(got, want, atol=1e-6) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    ids = [tiny_session.encode(t) for t in texts]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    assert out.model == tiny_server.model_id

    floats = tiny_client.embeddings.create(model="any", input=texts[1], encoding_format="float")
    assert np.array_equal(np.array(floats.data[0].embedding, np.float32), got[1])
    raw = post(tiny_server, "/v1/embeddings", {"model": "any", "input": ids, "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][2]["embedding"]), "<f4"), got[2])
    one = post(tiny_server, "/v1/embeddings", {"model": "any", "input": ids[0]}).json()  # one input as token ids
    assert np.array_equal(np.array(one["data"][0]["embedding"], np.float32), got[0])

    for body, param in (({"input": ""}, "input[0]"), ({"input": []}, "input"), ({"input": [["x"]]}, "input[0][0]"),
                        ({"input": "x" * 400}, "input[0]"), ({"input": "hi", "dimensions": 8}, "dimensions"),
                        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"), ({}, "input"),
                        ({"input": "hi", "pooling": "last"}, "pooling")):
        assert_openai_error(post(tiny_server, "/v1/embeddings", {"model": "any", **body}), 400, param=param)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="any", input="hi")
    assert tiny_server.health()["status"] == "ok"


# --- Ollama ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ollama(tiny_server):
    return ollama.Client(host=tiny_server.base_url, headers=AUTH, timeout=60)


def test_ollama_client_tags_show_generate_and_chat(tiny_server, tiny_ollama, tiny_client, tiny_gguf):
    s, c = tiny_server, tiny_ollama
    models = c.list().models
    assert [m.model for m in models] == [f"{s.model_id}:latest"] and models[0].details.family == "llama"
    assert models[0].size == tiny_gguf.stat().st_size and models[0].digest
    shown = c.show(s.model_id)
    assert shown.details.format == "gguf" and shown.modelinfo["general.architecture"] == "llama"

    opts = {"temperature": 0, "num_predict": 6}
    whole = c.generate(model=s.model_id, prompt="hello", options=opts)  # the model's template around the prompt
    chat_ref = tiny_client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hello"}],
                                                   max_tokens=6, temperature=0)
    assert whole.done and whole.response == chat_ref.choices[0].message.content
    assert whole.eval_count == chat_ref.usage.completion_tokens and whole.done_reason == "length"
    assert whole.prompt_eval_count == chat_ref.usage.prompt_tokens and whole.total_duration > 0
    parts = list(c.generate(model=s.model_id, prompt="hello", options=opts, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done and not parts[0].done
    assert parts[-1].eval_count == whole.eval_count

    raw = c.generate(model=s.model_id, prompt="hello", raw=True, options=opts)  # the prompt as it is
    ref = tiny_client.completions.create(model="x", prompt="hello", max_tokens=6, temperature=0)
    assert raw.response == ref.choices[0].text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    reply = c.chat(model=s.model_id, messages=messages, options=opts)
    ref = tiny_client.chat.completions.create(model="x", messages=messages, max_tokens=6, temperature=0)
    assert reply.message.role == "assistant" and reply.message.content == ref.choices[0].message.content
    chunks = list(c.chat(model=s.model_id, messages=messages, options=opts, stream=True))
    assert "".join(ch.message.content for ch in chunks) == reply.message.content and chunks[-1].done

    assert c.generate(model=s.model_id, prompt="").done_reason == "load"  # Ollama's "load the model"


def test_ollama_client_embed(tiny_server, tiny_ollama, tiny_client):
    s, c = tiny_server, tiny_ollama
    texts = ["hello there", "hi"]
    want = [d.embedding for d in tiny_client.embeddings.create(model="x", input=texts, encoding_format="float").data]
    out = c.embed(model=s.model_id, input=texts)
    assert np.array_equal(np.array(out.embeddings, np.float32), np.array(want, np.float32))
    assert out.prompt_eval_count == sum(len(post(s, "/tokenize", {"content": t}).json()["tokens"]) for t in texts)
    assert np.array_equal(np.array(c.embeddings(model=s.model_id, prompt="hi").embedding, np.float32),
                          np.array(want[1], np.float32))
    long = "x" * 400  # 400 tokens: cut to the context of 128 unless truncate is false
    assert c.embed(model=s.model_id, input=long).prompt_eval_count == CONTEXT
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=s.model_id, input=long, truncate=False)
    assert e.value.status_code == 400 and "context" in e.value.error


def test_ollama_errors_are_ollamas_shape(tiny_server, tiny_ollama):
    s, c = tiny_server, tiny_ollama
    for call, status, word in (
            (lambda: c.generate(model=s.model_id, prompt="hi", options={"mirostat": 2}), 400, "options.mirostat"),
            (lambda: c.generate(model=s.model_id, prompt="hi", options={"num_predict": 0}), 400, "num_predict"),
            (lambda: c.chat(model=s.model_id, messages=[{"role": "robot", "content": "hi"}]), 400, "role"),
            (lambda: c.chat(model=s.model_id, messages=[{"role": "user", "content": "hi"}], think=True), 400,
             "thinking"),
            (lambda: c.generate(model=s.model_id, prompt="hi", options={"temperature": "hot"}), 400, "temperature"),
            (lambda: ollama.Client(host=s.base_url).list(), 401, "API key")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == status and word in e.value.error, e.value.error
    r = s.request("POST", "/api/generate", {"model": s.model_id, "prompt": "hi", "stream": "no"}, AUTH)
    assert r.status == 400 and set(r.json()) == {"error"} and "stream" in r.json()["error"]
    assert s.health()["status"] == "ok"


# --- on the real model ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path):
    config = {"model": str(smollm2_path), "context": 512, "max_tokens": 16, "threads": 1,
              "sampling": {"temperature": 0.0, "repeat_penalty": 1.0}}
    s = ServerProcess(tmp_path_factory.mktemp("endpoints-smollm2"), config)
    yield s
    s.stop()


@pytest.mark.model
def test_ollama_chat_on_smollm2(smollm2_server, smollm2):
    from tracelm.pipeline.runner import Runner
    from tracelm.session import chat_prompt
    from tracelm.state.records import SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    runner = Runner(smollm2, 512)
    want = "".join(runner.generate(chat_prompt(smollm2, messages), 12, SamplingParams(temperature=0.0,
                                                                                     repeat_penalty=1.0)))
    c = ollama.Client(host=smollm2_server.base_url, timeout=120)
    reply = c.chat(model="smollm2-135m-instruct", messages=messages, options={"num_predict": 12, "temperature": 0})
    assert reply.message.content == want and "Paris" in want
    parts = list(c.chat(model="smollm2-135m-instruct", messages=messages, stream=True,
                        options={"num_predict": 12, "temperature": 0}))
    assert "".join(p.message.content for p in parts) == want


TEXTS = ["The cat sat on the mat.", "Embeddings pool the final hidden state of every position of a text.",
         "Paris is the capital of France"]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.model
@pytest.mark.reference
def test_embeddings_agree_with_transformers(smollm2_server, smollm2, smollm2_path):
    """Mean pooling through the server and the openai client, last-token pooling through Session.embed: each
    within 1e-3 of transformers' final hidden state (after the final norm) of the same model, in cosine."""
    import torch

    from tracelm import Session

    hf_model = transformers_model(smollm2_path)
    client = openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    served = client.embeddings.create(model="smollm2-135m-instruct", input=TEXTS).data
    session = Session(smollm2)
    for text, item in zip(TEXTS, served, strict=True):
        ids = smollm2.tokenizer.encode(text)
        with torch.no_grad():
            h = hf_model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
        assert cosine(np.array(item.embedding), h.mean(axis=0)) > 1 - 1e-3
        assert cosine(session.embed(text, pooling="last"), h[-1]) > 1 - 1e-3
    assert cosine(np.array(served[0].embedding), np.array(served[1].embedding)) < 0.99  # texts apart stay apart
