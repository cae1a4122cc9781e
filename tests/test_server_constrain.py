"""`tracelm serve` with constraints, driven by the official `openai` client: response_format json_schema and
json_object, the guided_regex / guided_grammar extensions (streamed too), per-request logit_bias and seed, bad
schemas and grammars as 400s naming the argument. And issue 15's acceptance check on Qwen2.5-Coder-0.5B-Instruct:
a json_schema request validates in sampled runs (here seeds 1..3; `tracelm check structured-output` runs 1..20)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_constrain import PERSON, SCHEMA
from tests.test_server_helpers import ServerProcess

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

pytestmark = pytest.mark.model


def _serve(work: Path, model: Path, **extra) -> ServerProcess:
    config = {"model": str(model), "context": 1024, "max_tokens": 200, "threads": 1,
              "sampling": {"temperature": 0.8, "repeat_penalty": 1.0}, **extra}
    return ServerProcess(work, config)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path):
    server = _serve(tmp_path_factory.mktemp("constrain-server"), smollm2_path)
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    c.model_id = c.models.list().data[0].id
    yield c
    c.close()
    server.stop()


def _chat(client, content: str = PERSON, **kw):
    return client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": content}],
                                          **kw)


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def test_json_schema_response_format_validates(client) -> None:
    for seed in (1, 2, 3):
        out = _chat(client, temperature=0.8, seed=seed, response_format=schema_format(SCHEMA))
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    free = _chat(client, temperature=0.8, seed=1).choices[0].message.content
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)


def test_json_object_and_streaming_under_a_constraint(client) -> None:
    out = _chat(client, "Give me a JSON object about cats.", temperature=0.8, seed=4, max_tokens=120,
                response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object in the making
        assert out.choices[0].message.content.startswith("{")
    kw = dict(temperature=0.8, seed=7, response_format=schema_format(SCHEMA))
    whole = _chat(client, **kw).choices[0].message.content
    chunks = list(_chat(client, stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_guided_regex_and_grammar_on_both_endpoints(client) -> None:
    pattern = r"[A-Z][a-z]+ is [1-9][0-9]? years old\."
    for seed in (1, 2):
        out = client.completions.create(model=client.model_id, prompt="Tell me about Anna.", max_tokens=24,
                                        temperature=0.8, seed=seed, extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    lark = 'start: answer "."\nanswer: "yes" | "no"'
    text = _chat(client, "Is Paris in France?", temperature=0, extra_body={"guided_grammar": lark})
    assert text.choices[0].message.content in ("yes.", "no.")
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no"'  # llama-server's `grammar`: the same language in GBNF
    same = _chat(client, "Is Paris in France?", temperature=0, extra_body={"grammar": gbnf})
    assert same.choices[0].message.content == text.choices[0].message.content
    free = client.completions.create(model=client.model_id, prompt="Tell me about Anna.", max_tokens=24,
                                     temperature=0.8, seed=1)
    assert not re.fullmatch(pattern, free.choices[0].text)


def test_per_request_logit_bias_and_seed(client) -> None:
    def first(**kw) -> str:
        return client.completions.create(model=client.model_id, prompt="The capital of France is", max_tokens=1,
                                         **kw).choices[0].text

    top = first(temperature=0)
    tok = client.completions.create(model=client.model_id, prompt=top, max_tokens=1, temperature=0,
                                    logprobs=0).choices[0].logprobs  # just a call to make sure logprobs still work
    assert tok is not None
    from tracelm.io.loader import load_tokenizer
    from tracelm.io.registry import pull

    tokenizer = load_tokenizer(str(pull("smollm2-135m-instruct", progress=False)))
    top_id = tokenizer.encode(top)[0]
    assert first(temperature=0, logit_bias={str(top_id): -100}) != top
    zebra = tokenizer.encode(" zebra")[0]
    assert first(temperature=0.8, seed=3, logit_bias={str(zebra): 100}) == " zebra"
    long = dict(prompt="Once upon a time", max_tokens=12, temperature=0.8)
    a, b, c = (client.completions.create(model=client.model_id, seed=s, **long).choices[0].text for s in (11, 11, 12))
    assert a == b and a != c


@pytest.mark.parametrize("body, param", [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})},
     "response_format"),
    ({"response_format": schema_format({"type": "string", "format": "no-such-format"})}, "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),
])
def test_bad_constraints_are_400s(client, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=4, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert "Traceback" not in e.value.body["message"]


def test_issue_acceptance_check_on_qwen(qwen_coder_path: Path) -> None:
    """Issue 15's check (`tracelm check structured-output`, 20 seeds: ~90 s here, so outside the suite) on its first
    three seeds: Qwen2.5-Coder-0.5B-Instruct served, json_schema requests, every reply valid."""
    from tracelm.tools.check_structured import structured_output_check

    report = structured_output_check(str(qwen_coder_path), seeds=3)
    assert report["passed"] and report["valid"] == "3/3", report["runs"]
    assert all(r["finish_reason"] == "stop" for r in report["runs"])
    assert report["tools"]["valid"] and report["tools"]["finish_reason"] == "tool_calls", report["tools"]
    assert report["n"]["valid"] and len(report["n"]["choices"]) == 3, report["n"]


def test_the_check_reports_a_template_without_tools(smollm2_path: Path, capsys) -> None:
    """`tracelm check structured-output` on a model whose template has no tools section (SmolLM2): the server's 400
    is the tools line's reason and the check fails (exit 1), not a traceback from the openai client."""
    from tracelm.cli import main

    assert main(["check", "structured-output", "--model", str(smollm2_path), "--seeds", "1", "--threads", "2"]) == 1
    out = capsys.readouterr().out
    assert "tools: INVALID: HTTP 400: 'tools': this model's chat template has no tools section" in out, out
    assert re.search(r"^n=3: valid", out, re.M), out
