"""`tracelm check structured-output`: issue 15's acceptance check, run as a user would -- `tracelm serve` started
in a child process, then one OpenAI chat request per seed (seeds 1..N, temperature 0.8) with a `response_format`
json_schema (an object with required string, integer and enum fields and a nested array), each reply parsed and
validated by the `jsonschema` package (an independent validator, in the test extra), not by the grammar engine
that produced it. Then, through the official `openai` client (also in the test extra): a `tools` request with a
weather function (tool_choice auto: the model decides to call it), whose tool_calls entry must name the function
with arguments that validate against its parameters schema; and an `n=3` request, which must return three choices
(indexes 0, 1, 2) from one prefill (`usage.prefill_passes` == 1). It takes ~90 s for 20 seeds on
Qwen2.5-Coder-0.5B on a 2-core machine: too long for the test suite, which runs the same function on three seeds
(tests/test_server_constrain.py).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from typing import Any

from tracelm.state.errors import TracelmError
from tracelm.tools.bench_grammar import PROMPT, SCHEMA

WEATHER_PROMPT = "What is the weather like in Paris right now? Give me the temperature in celsius."
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city, e.g. San Francisco"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a "
                                                 "city", "parameters": WEATHER_SCHEMA}}
N_CHOICES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def _serve(model: str, threads: int, max_tokens: int, startup_seconds: float = 180.0) -> tuple[subprocess.Popen, int]:
    """`tracelm serve --model M` in a child process on a free loopback port, once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tracelm.cli", "serve", "--model", model, "--port", str(port),
           "--set", f"threads={threads}", "--set", f"max_tokens={max_tokens}", "--set", "context=2048"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + startup_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode("utf-8", "replace").strip().splitlines() if proc.stderr else []
            raise TracelmError(f"tracelm serve exited ({proc.returncode}): {err[-1] if err else 'no message'}")
        try:
            if _request(port, "GET", "/health", timeout=2)[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TracelmError(f"tracelm serve did not answer within {startup_seconds:.0f} s")


def _validator() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise TracelmError("check structured-output validates with the jsonschema package: "
                           "pip install 'tracelm[test]'") from None
    return jsonschema


def _openai_client(port: int) -> Any:
    try:
        import openai
    except ImportError:
        raise TracelmError("check structured-output asks with the official openai client: "
                           "pip install 'tracelm[test]'") from None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)


def _asked(client: Any, **request: Any) -> Any:
    """A chat completion through the openai client, or why the server refused it (its status and message: e.g. a
    model whose template cannot take tools), so the check reports it rather than raising."""
    import openai

    try:
        return client.chat.completions.create(**request)
    except openai.APIStatusError as e:
        said = e.body.get("message") if isinstance(e.body, dict) else None
        return f"HTTP {e.status_code}: {said or e.message}"
    except openai.APIConnectionError as e:
        return f"no reply from the server: {e}"


def _tool_run(client: Any, model_id: str, jsonschema: Any) -> dict[str, Any]:
    """The weather tool offered (tool_choice auto): the reply must call it, its arguments valid under its schema."""
    reply = _asked(client, model=model_id, messages=[{"role": "user", "content": WEATHER_PROMPT}],
                   tools=[WEATHER_TOOL], tool_choice="auto", temperature=0.0, seed=1)
    if isinstance(reply, str):
        return {"valid": False, "finish_reason": None, "calls": 0, "name": None, "arguments": None, "why": reply}
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    why, name, arguments = None, None, None
    if not calls:
        why = f"no tool call; the reply was {choice.message.content!r}"
    else:
        name, arguments = calls[0].function.name, calls[0].function.arguments
        try:
            jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
            if name != "get_weather":
                why = f"called {name!r}, not get_weather"
        except (ValueError, jsonschema.ValidationError) as e:
            why = str(e).splitlines()[0]
    return {"valid": why is None, "finish_reason": choice.finish_reason, "calls": len(calls), "name": name,
            "arguments": arguments, "why": why}


def _n_run(client: Any, model_id: str) -> dict[str, Any]:
    """n = 3 sampled choices: three of them, indexed 0..2, and the usage says the prompt was prefilled once."""
    reply = _asked(client, model=model_id, messages=[{"role": "user", "content": "Name a fruit."}], n=N_CHOICES,
                   temperature=0.8, seed=1, max_tokens=16)
    if isinstance(reply, str):
        return {"valid": False, "choices": [], "usage": {}, "why": reply}
    usage = reply.usage.model_dump()
    indexes = [c.index for c in reply.choices]
    why = None
    if indexes != list(range(N_CHOICES)):
        why = f"choices {indexes}, expected {list(range(N_CHOICES))}"
    elif usage.get("prefill_passes") != 1:
        why = f"usage.prefill_passes = {usage.get('prefill_passes')}, expected 1"
    return {"valid": why is None, "choices": [c.message.content for c in reply.choices], "usage": usage, "why": why}


def _one(port: int, model_id: str, seed: int, temperature: float, jsonschema: Any) -> dict[str, Any]:
    body = {"model": model_id, "messages": [{"role": "user", "content": PROMPT}], "temperature": temperature,
            "seed": seed, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}
    status, reply = _request(port, "POST", "/v1/chat/completions", body)
    if status != 200:
        return {"seed": seed, "valid": False, "why": f"HTTP {status}: {reply}"}
    choice = reply["choices"][0]
    content, why = choice["message"]["content"], None
    try:
        jsonschema.validate(json.loads(content), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as e:
        why = str(e).splitlines()[0]
    return {"seed": seed, "valid": why is None, "finish_reason": choice["finish_reason"],
            "tokens": reply["usage"]["completion_tokens"], "why": why, "content": content}


def structured_output_check(model: str = "qwen2.5-coder-0.5b-instruct", seeds: int = 20, temperature: float = 0.8,
                            threads: int = 0, max_tokens: int = 256) -> dict[str, Any]:
    """Seeds 1..`seeds` through a served `model` (see the module docstring): how many replies validate, and each."""
    jsonschema = _validator()
    proc, port = _serve(model, threads, max_tokens)
    t0 = time.monotonic()
    try:
        model_id = _request(port, "GET", "/v1/models")[1]["data"][0]["id"]
        runs = [_one(port, model_id, seed, temperature, jsonschema) for seed in range(1, seeds + 1)]
        with _openai_client(port) as client:
            tools, n = _tool_run(client, model_id, jsonschema), _n_run(client, model_id)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    valid = sum(r["valid"] for r in runs)
    return {"model": model_id, "schema": SCHEMA, "temperature": temperature, "valid": f"{valid}/{seeds}",
            "passed": valid == seeds and tools["valid"] and n["valid"], "seconds": round(time.monotonic() - t0, 1),
            "runs": runs, "tools": tools, "n": n}
