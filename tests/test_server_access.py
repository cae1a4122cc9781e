"""Issue 29, item 2: with an API key every route but /health and the pages themselves needs it (the trace routes
included); an uploaded trace is bounded by server.max_upload_mb, refused as soon as more has come, and verified
off the event loop; the pages' API checks Host and Origin as browsers' rules expect, while a client that is not a
browser (no Origin) is served under any Host."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.test_library_errors import InProcessServer
from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm.server.access import Access, same_origin, split_host

KEY = "access-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    work = tmp_path_factory.mktemp("keyed-server")
    config = {"model": str(tiny_gguf), "context": 128, "max_tokens": 4, "threads": 1,
              "sampling": {"temperature": 0.0},
              "server": {"trace_dir": str(work / "traces"), "max_upload_mb": 1, "allowed_hosts": ["tracelm.lan"]}}
    s = ServerProcess(work, config, env={"TRACELM_API_KEY": KEY})
    yield s
    s.stop()


def chat(s: ServerProcess, headers: dict[str, str]):
    return s.request("POST", "/v1/chat/completions",
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, headers)


def test_every_route_but_health_and_the_pages_needs_the_key(keyed):
    r = chat(keyed, AUTH)
    assert r.status == 200, r.text
    rid = r.headers["x-request-id"]
    trace = keyed.request("GET", f"/api/trace/request/{rid}", headers=AUTH)
    assert trace.status == 200 and trace.json()["events"], trace.text
    lines = (Path(keyed.log_path).parent / "traces" / f"{rid}.jsonl").read_bytes()
    for method, path, body in [("GET", f"/api/trace/request/{rid}", None), ("POST", "/api/trace/verify", lines),
                               ("GET", "/api/info", None), ("GET", "/api/trace/preloaded", None),
                               ("GET", "/v1/models", None), ("GET", "/v1/attestation?nonce=00", None),
                               ("GET", "/props", None),
                               ("GET", "/no/such/route", None)]:
        r = keyed.request(method, path, body)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert "hi" not in r.text
    assert keyed.request("POST", "/api/trace/verify", lines, AUTH).json()["verdict"]["intact"]
    assert keyed.request("GET", "/api/info", headers=AUTH).json()["api_key_required"]
    assert_openai_error(keyed.request("POST", "/completion", {"prompt": "hi"}), 401, code="invalid_api_key")
    for path in ("/health", "/v1/health", "/", "/trace", "/static/key.js", "/static/chat.js"):  # no data in these
        assert keyed.request("GET", path).status == 200, path


def test_a_cross_origin_or_foreign_host_request_from_a_browser_is_refused(keyed):
    evil = {"Host": "evil.example:8080", "Origin": "http://evil.example:8080", "Content-Type": "text/plain"}
    # a DNS-rebinding page: its own origin, the attacker's name in Host; with the key (a user's browser may hold it)
    for path in ("/api/trace/verify", "/v1/chat/completions"):
        r = keyed.request("POST", path, b'{"model": "m", "prompt": "x"}', {**AUTH, **evil})
        assert_openai_error(r, 403, code="host_not_allowed")
    assert_openai_error(keyed.request("GET", "/api/info", headers={**AUTH, "Host": "evil.example"}), 403,
                        code="host_not_allowed")
    # a page elsewhere posting a "simple" text/plain request to this server (CSRF)
    local = f"127.0.0.1:{keyed.port}"
    for origin in ("http://evil.example", f"http://127.0.0.1:{keyed.port + 1}", "null"):
        r = keyed.request("POST", "/v1/chat/completions", b'{"model": "m", "prompt": "x"}',
                          {**AUTH, "Host": local, "Origin": origin, "Content-Type": "text/plain"})
        assert_openai_error(r, 403, code="cross_origin")
    # the page's own calls, and an allowed name
    assert keyed.request("GET", "/api/info", headers={**AUTH, "Origin": f"http://{local}"}).status == 200
    assert keyed.request("GET", "/api/info", headers={**AUTH, "Host": "tracelm.lan:8080",
                                                      "Origin": "http://tracelm.lan:8080"}).status == 200
    # a client that is not a browser sends no Origin: the OpenAI API answers it under any name
    assert keyed.request("GET", "/v1/models", headers={**AUTH, "Host": "gpu-box.internal:8080"}).status == 200


def test_an_upload_over_the_bound_is_refused_as_it_streams(keyed):
    """A chunked upload (no Content-Length to refuse it by) gets its 413 once 1 MiB (server.max_upload_mb) has
    come, not after the whole body; the server goes on serving."""
    head = (f"POST /api/trace/verify HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"%x\r\n" % (256 << 10) + b"x" * (256 << 10) + b"\r\n"
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as c:
        c.sendall(head)
        while sent < 64 << 20 and not answer:
            try:
                c.sendall(chunk)
            except OSError:
                break
            sent += 256 << 10
            if select.select([c], [], [], 0.02)[0]:
                answer = c.recv(65536)
        while True:  # the rest of the answer, up to the end the server's graceful close sends
            more = c.recv(65536)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"1 MiB (server.max_upload_mb)" in answer
    assert sent <= 4 << 20, f"{sent} bytes were taken before the 413"
    assert keyed.health()["status"] == "ok"


def test_health_answers_while_an_upload_is_verified(tiny_gguf, monkeypatch):
    """Verification runs in a thread: /health answers while a trace is being parsed."""
    from tracelm.server import pages

    parsing, release = threading.Event(), threading.Event()
    real = pages.parse_trace

    def slow_parse(data, path):
        parsing.set()
        release.wait(30)
        return real(data, path)

    monkeypatch.setattr(pages, "parse_trace", slow_parse)
    s = InProcessServer(tiny_gguf)
    try:
        upload = threading.Thread(target=lambda: s.request("POST", "/api/trace/verify", b"{}", timeout=60))
        upload.start()
        assert parsing.wait(30)
        t0 = time.monotonic()
        try:
            health = s.request("GET", "/health", timeout=5)
        except TimeoutError:
            health = None
        assert health is not None and health.status == 200, "the event loop was blocked by the verification"
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        upload.join(60)
        s.stop()


@pytest.mark.parametrize(("origin", "host", "same"), [
    ("http://127.0.0.1:8080", "127.0.0.1:8080", True),
    ("http://LOCALHOST", "localhost:80", True),
    ("https://a.example", "a.example", False),  # the request came over http (the scope's scheme): port 80 vs 443
    ("http://[::1]:8080", "[::1]:8080", True),
    ("http://127.0.0.1:8081", "127.0.0.1:8080", False),
    ("http://user@127.0.0.1:8080", "127.0.0.1:8080", False),
    ("null", "127.0.0.1:8080", False),
    ("http://127.0.0.1:x", "127.0.0.1:x", False),
])
def test_same_origin(origin, host, same):
    assert same_origin(origin, host, "http") is same


def test_access_rules_in_process():
    def refusal(method: str, path: str, headers: dict[str, str], key: str | None = "k"):
        scope = {"type": "http", "method": method, "path": path, "scheme": "http",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        err = Access(None, key, ("Box.Lan.",)).refusal(scope)
        return None if err is None else err.status

    assert refusal("GET", "/health", {"Host": "evil.example", "Origin": "http://x"}) is None
    assert refusal("GET", "/", {"Host": "127.0.0.1"}) is None and refusal("GET", "/static/x.js", {}) == 403
    assert refusal("POST", "/", {"Host": "127.0.0.1"}) == 401  # not a page: a page is only GET or HEAD
    assert refusal("GET", "/trace", {"Host": "box.lan:1"}) is None and refusal("GET", "/", {"Host": "a.lan"}) == 403
    assert refusal("GET", "/api/info", {"Host": "localhost:9"}) == 401
    assert refusal("GET", "/api/info", {"Host": "localhost:9", "Authorization": "Bearer k"}) is None
    assert refusal("GET", "/api/info", {"Host": "localhost:9"}, key=None) is None
    assert refusal("GET", "/v1/models", {"Host": "any.name", "Authorization": "bearer k"}) is None
    assert split_host("[::1]:80", "http") == ("::1", 80) and split_host("Box.LAN.", "https") == ("box.lan", 443)


def test_the_key_from_a_file_and_not_from_the_command_line(tmp_path: Path, tiny_gguf: Path, capsys):
    """`serve --api-key-file FILE` (llama-server's flag): its first line is the key every route but /health needs;
    `--api-key KEY` is refused (a key on the command line is visible in ps), as is an empty key file."""
    from tracelm.cli import main

    key_file = tmp_path / "key.txt"
    key_file.write_text("file-key-987\n")
    config = {"model": str(tiny_gguf), "context": 64, "max_tokens": 2, "threads": 1}
    s = ServerProcess(tmp_path / "serve", config, args=("--api-key-file", str(key_file)))
    try:
        assert_openai_error(chat(s, {}), 401, code="invalid_api_key")
        assert chat(s, {"Authorization": "Bearer file-key-987"}).status == 200
    finally:
        s.stop()
    assert main(["serve", "--model", str(tiny_gguf), "--api-key", "secret"]) == 2
    assert "--api-key is refused" in capsys.readouterr().err
    key_file.write_text("\n")
    assert main(["serve", "--model", str(tiny_gguf), "--api-key-file", str(key_file)]) == 2
    assert "holds no key on its first line" in capsys.readouterr().err
