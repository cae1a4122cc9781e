"""The server under hostile or heavy use (issue 18, item 8): a request head sent a byte at a time is closed after
server.header_timeout, a head over server.max_header_bytes gets a 431 (not a reset), the sessions' arrays stay
within server.session_memory_mb as sessions are evicted, a request stops at server.request_cpu_seconds, a chat
template over its budget is a 400 naming it; and a small soak passes."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path

import gguf
import pytest

from tests.test_hardening import rewrite_gguf
from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm.server.sessions import SessionStore

CONTEXT = 4096  # the tiny model's sessions then hold ~2.6 MB of arrays each


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    work = tmp_path_factory.mktemp("hardened-server")
    config = {"model": str(tiny_gguf), "context": CONTEXT, "max_tokens": 8, "threads": 1,
              "sampling": {"temperature": 0.0},
              "server": {"header_timeout": 1.5, "body_timeout": 1.5, "session_memory_mb": 6, "max_sessions": 16,
                         "request_cpu_seconds": 0.3}}
    s = ServerProcess(work, config)
    yield s
    s.stop()


def chat(s: ServerProcess, content: str, **kw):
    return s.request("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": content}],
                                                      **kw})


def test_a_head_sent_a_byte_at_a_time_is_closed_after_the_timeout(server):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.settimeout(0.1)
        t0, answer = time.monotonic(), None
        for byte in head:
            try:
                c.sendall(bytes([byte]))
                answer = c.recv(4096)
                break  # the server answered (408) or closed
            except TimeoutError:
                pass
            except OSError:  # reset: closed
                answer = b""
                break
            assert time.monotonic() - t0 < 10, "the connection was never closed"
    assert 1.4 < time.monotonic() - t0 < 4
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    assert server.health()["status"] == "ok"  # and the server goes on serving


def test_a_200_kb_head_gets_431(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    try:
        conn.request("GET", "/health", headers={"X-Big": "a" * 200_000})
        r = conn.getresponse()
        body = r.read().decode()
    finally:
        conn.close()
    assert r.status == 431 and "65536 bytes (server.max_header_bytes)" in body
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    conn.request("GET", "/health", headers={"X-Big": "a" * 30_000})  # under the limit (h11 alone refused 16 KB)
    assert conn.getresponse().status == 200


def test_a_body_read_with_its_head_is_not_counted_as_head(server):
    body = json.dumps({"model": "m", "prompt": "x" * 150_000, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as c:
        c.sendall(head.encode() + body)  # one write: the server reads the head and much of the body together
        status = c.recv(4096).split(b"\r\n", 1)[0]
    assert b" 431 " not in status, status


def test_a_body_sent_a_byte_at_a_time_is_closed_after_the_body_timeout(server):
    """Issue 29, item 6: the body has server.body_timeout seconds after the head; then a 408, closed, one log line."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    before = server.log().count("request body lost")
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.sendall(head)
        c.settimeout(0.1)
        t0, answer = time.monotonic(), None
        while answer is None:
            try:
                c.sendall(b"{")
                answer = c.recv(4096)
            except TimeoutError:
                pass
            except OSError:  # reset: closed
                answer = b""
            assert time.monotonic() - t0 < 10, "the connection was never closed"
    assert 1.4 < time.monotonic() - t0 < 4
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"server.body_timeout" in answer or answer == b""
    assert server.health()["status"] == "ok"
    deadline = time.monotonic() + 10
    while server.log().count("request body lost") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.log().count("request body lost: not complete within server.body_timeout") == before + 1


def test_a_client_dropping_mid_body_logs_one_line_and_no_traceback(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n")
    lines = server.log().splitlines()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
            c.sendall(head + b'{"model": "m", ')
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while len([x for x in server.log().splitlines()[len(lines):] if "request body lost" in x]) < 5:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert server.health()["status"] == "ok"
    new = server.log().splitlines()[len(lines):]
    lost = [x for x in new if "request body lost" in x]
    assert lost == ["POST /v1/chat/completions: request body lost: the client closed the connection before it was "
                    "complete"] * 5
    assert not [x for x in new if "Traceback" in x or "Exception" in x or x.startswith("ERROR")], new


def test_the_trace_dir_keeps_within_its_bound_oldest_first(tmp_path, tiny_gguf: Path):
    """server.traces_max_mb: past it the oldest traces go first (down to 90 %); other files stay."""
    traces = tmp_path / "traces"
    traces.mkdir()
    for i in range(3):  # older traces, oldest first
        old = traces / f"old-{i}.jsonl"
        old.write_bytes(b"x" * (400 << 10))
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    (traces / "notes.txt").write_bytes(b"n" * (2 << 20))
    config = {"model": str(tiny_gguf), "context": 256, "max_tokens": 32, "threads": 1,
              "server": {"trace_dir": str(traces), "traces_max_mb": 1}}
    s = ServerProcess(tmp_path / "work", config)
    try:
        assert sorted(p.name for p in traces.iterdir()) == ["notes.txt", "old-1.jsonl", "old-2.jsonl"]  # at start
        written = []
        for _ in range(8):  # about 200 KB each
            r = s.request("POST", "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 32})
            assert r.status == 200, r.text
            written.append(traces / f"{r.headers['x-request-id']}.jsonl")
            s.wait_idle()
            deadline = time.monotonic() + 10  # the trace closes (and the folder is bounded) just after the answer
            while not (written[-1].exists() and sum(p.stat().st_size for p in traces.glob("*.jsonl")) <= 1 << 20):
                assert time.monotonic() < deadline, sorted((p.name, p.stat().st_size) for p in traces.iterdir())
                time.sleep(0.05)
        left = sorted(traces.glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
        assert not any(p.name.startswith("old-") for p in left) and left == written[-len(left):]
        assert (traces / "notes.txt").stat().st_size == 2 << 20
        assert s.health()["counters"]["traces_deleted"] == 3 + len(written) - len(left)
    finally:
        s.stop()


def test_the_session_bound_holds_under_eviction(server):
    for turn in range(2):
        for i in range(6):
            r = chat(server, f"turn {turn} of session {i}", session_id=f"s{i}")
            assert r.status == 200, r.text
    memory = server.health()["memory"]
    assert memory["session_memory_bytes"] == 6 << 20
    assert 0 < memory["sessions_bytes"] <= memory["session_memory_bytes"]
    assert memory["sessions_evicted"] > 0


def test_a_request_stops_at_its_cpu_budget(server):
    r = chat(server, "go on", max_tokens=CONTEXT - 64)
    assert r.status in (200, 400), r.text
    if r.status == 400:  # the prompt alone used the budget
        assert_openai_error(r, 400, code="cpu_budget_exceeded")
        return
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] < CONTEXT - 64
    assert "CPU budget of 0.3 s (server.request_cpu_seconds)" in choice["finish_note"]
    assert server.health()["counters"]["cpu_limited"] >= 1
    assert "finish_note" not in chat(server, "short").json()["choices"][0]  # a request within it: as before


def test_session_store_bound_counts_what_the_runners_hold():
    sizes: dict[object, int] = {}

    def new() -> object:
        runner = object()
        sizes[runner] = 100
        return runner

    released = []
    store = SessionStore(new, max_sessions=10, max_bytes=300, bytes_per_session=100, measure=sizes.__getitem__,
                         release=lambda: released.append(1))
    a = store.get("a")
    store.get("b")
    sizes[a] = 250  # a's Cache grew (masks, pass buffers)
    assert store.bound(busy={"a"}) == 1 and store.ids() == ["a"]  # b went: a is in use
    assert store.nbytes == 250 and released == [1]
    store.get("c")  # a new one needs 100 more: a (least recently used, idle now) goes
    assert store.ids() == ["c"] and store.evicted == 2


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    work = tmp_path_factory.mktemp("hostile-template")
    template = ("{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}{% elif messages[0]['content'] == 'big' %}{{ 'x' * 10**9 }}"
                "{% else %}{{ messages[0]['content'] }}{% endif %}")
    model = rewrite_gguf(tiny_gguf, work / "hostile.gguf",
                         {"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})
    config = {"model": str(model), "context": 128, "max_tokens": 4, "threads": 1, "template_cpu_seconds": 0.5,
              "template_max_chars": 10_000}
    s = ServerProcess(work, config)
    yield s
    s.stop()


def test_a_template_over_its_budget_is_a_400_naming_it(hostile_server):
    t0 = time.monotonic()
    err = assert_openai_error(chat(hostile_server, "loop"), 400, param="messages")
    assert "chat template: rendering exceeded 0.5 s of CPU (template_cpu_seconds)" in err["message"]
    assert time.monotonic() - t0 < 10
    err = assert_openai_error(chat(hostile_server, "big"), 400, param="messages")
    assert "output over 10000 characters (template_max_chars)" in err["message"]
    assert chat(hostile_server, "hello").status == 200  # and it keeps serving


def test_a_small_soak_passes(tiny_gguf: Path):
    from tracelm.session import run_config
    from tracelm.tools.soak import soak

    cfg = run_config(str(tiny_gguf), None, [f"context={CONTEXT}", "threads=1", "server.session_memory_mb=3"])
    report = soak(cfg, clients=2, requests=10, sessions=5, trace=True, max_tokens=8)
    assert report["verdict"] == "PASS", report
    assert report["requests"] == 20 and report["ok"] == 20 and report["5xx"] == 0
    assert report["sessions_evicted"] > 0 and report["sessions_bytes_mb"] <= 3
