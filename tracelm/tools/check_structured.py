"""`tracelm check structured-output`: issue 15's acceptance check, run as a user would -- `tracelm serve` started
in a child process, then one OpenAI chat request per seed (seeds 1..N, temperature 0.8) with a `response_format`
json_schema (an object with required string, integer and enum fields and a nested array), each reply parsed and
validated by the `jsonschema` package (an independent validator, in the test extra), not by the grammar engine
that produced it. It takes ~90 s for 20 seeds on Qwen2.5-Coder-0.5B on a 2-core machine: too long for the test
suite, which runs the same function on three seeds (tests/test_server_constrain.py).
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
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    valid = sum(r["valid"] for r in runs)
    return {"model": model_id, "schema": SCHEMA, "temperature": temperature, "valid": f"{valid}/{seeds}",
            "passed": valid == seeds, "seconds": round(time.monotonic() - t0, 1), "runs": runs}
