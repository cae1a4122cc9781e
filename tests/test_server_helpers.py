"""Helpers for the server tests (no tests here): a real `tracelm serve` in a subprocess on a free loopback
port, and raw HTTP requests through the standard library."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reply:
    def __init__(self, status: int, headers: dict[str, str], text: str):
        self.status, self.headers, self.text = status, headers, text

    def json(self) -> Any:
        return json.loads(self.text)


class ServerProcess:
    """`python -m tracelm.cli serve CONFIG --port P` with the config written from a dict."""

    def __init__(self, workdir: Path, config: dict[str, Any], env: dict[str, str] | None = None,
                 startup_timeout: float = 120.0, args: tuple[str, ...] = ()):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cfg_path = workdir / "serve.yaml"
        cfg_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log_path = workdir / "server.log"
        full_env = {k: v for k, v in os.environ.items() if k != "TRACELM_API_KEY"}
        full_env.update(env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tracelm.cli", "serve", str(cfg_path), "--port", str(self.port), *args],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in {startup_timeout} s:\n{self.log()}")
            time.sleep(0.2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 60.0) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace"))
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health").json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if not h["running"] and h["queued"] == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {h}")
            time.sleep(0.05)

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def assert_openai_error(reply: Reply, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The status, and the OpenAI error body: {"error": {"message", "type", "param", "code"}}, no traceback."""
    assert reply.status == status, (reply.status, reply.text)
    assert "Traceback" not in reply.text
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
