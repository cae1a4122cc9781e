"""`tracelm soak`: a server under a steady load of chat conversations, its memory watched.

The server runs in a child process (multiprocessing's spawn, so its RSS is its own) on the config's model, with
`server.trace_dir` in a temporary folder when `trace` is set. `clients` threads each send `requests` chat
completions, one at a time; each names one of `sessions` session ids, drawn at random, and continues that
session's conversation (up to MAX_TURNS turns, then it starts over), so the server keeps, reuses, evicts and
recreates session KV caches all along. The server's RSS is sampled every RSS_EVERY seconds. The verdict is
PASS when no request got a 5xx or failed outright and the RSS at the end is within the bound of issue 18:
server.session_memory_mb + the model's weights + SLACK_MB.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import random
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from tracelm.state.errors import TracelmError
from tracelm.state.run_config import RunConfig

SLACK_MB = 200
MAX_TURNS = 4
RSS_EVERY = 0.2
WORDS = ("llama", "river", "quartz", "violin", "harbor", "meadow", "comet", "lantern", "orchid", "glacier")


def _serve_child(cfg: RunConfig, port: int, log_path: str) -> None:
    """The child's body: serve `cfg` on 127.0.0.1:port, its output to log_path."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # uvicorn's access log
    os.dup2(fd, 2)
    from tracelm.server import serve

    serve(cfg, "127.0.0.1", port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise TracelmError(f"no VmRSS for process {pid}")


def _request(port: int, method: str, path: str, body: Any = None, timeout: float = 600.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode("utf-8", "replace")
    finally:
        conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


class ServerChild:
    """`serve(cfg)` in a spawned child on a free loopback port, ready when /health answers."""

    def __init__(self, cfg: RunConfig, log_path: Path, startup_timeout: float = 300.0):
        self.port, self.log_path = _free_port(), log_path
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=_serve_child, args=(cfg, self.port, str(log_path)), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + startup_timeout
        while True:
            if not self.proc.is_alive():
                raise TracelmError(f"the server exited with code {self.proc.exitcode}: {self._log_tail()}")
            try:
                if _request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TracelmError(f"the server did not answer within {startup_timeout:g} s: {self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else "(no log)"

    def health(self) -> dict[str, Any]:
        return _request(self.port, "GET", "/health")[1]

    def stop(self) -> None:
        if self.proc.is_alive():  # SIGINT: the server shuts down and the child exits through its finalizers
            os.kill(self.proc.pid, signal.SIGINT)
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Conversations:
    """The soak's session ids and each one's conversation so far; a session is used by one request at a time."""

    def __init__(self, n: int, seed: int):
        self.ids = [f"soak-{i}" for i in range(n)]
        self.messages: dict[str, list[dict[str, str]]] = {s: [] for s in self.ids}
        self.locks = {s: threading.Lock() for s in self.ids}
        self.rng = random.Random(seed)
        self._lock = threading.Lock()

    def pick(self) -> tuple[str, int]:
        with self._lock:
            return self.rng.choice(self.ids), self.rng.randrange(1 << 31)

    def turn(self, session_id: str, seed: int) -> list[dict[str, str]]:
        """The session's conversation plus a new user turn (a fresh conversation after MAX_TURNS)."""
        history = self.messages[session_id]
        if len(history) >= 2 * MAX_TURNS:
            history.clear()
        words = random.Random(seed).sample(WORDS, 3)
        return [*history, {"role": "user", "content": f"Write one sentence about a {' and a '.join(words)}."}]


def _client(port: int, conv: Conversations, n: int, max_tokens: int, tally: Counter, lock: threading.Lock) -> None:
    """One client: n chat completions in a row, each continuing a random session's conversation."""
    for _ in range(n):
        session_id, seed = conv.pick()
        with conv.locks[session_id]:
            messages = conv.turn(session_id, seed)
            body = {"model": "soak", "messages": messages, "max_tokens": max_tokens, "temperature": 0.8,
                    "seed": seed, "session_id": session_id}
            try:
                status, reply = _request(port, "POST", "/v1/chat/completions", body)
            except OSError as e:
                status, reply = 0, str(e)
            if status == 200:
                conv.messages[session_id] = [*messages, {"role": "assistant",
                                                         "content": reply["choices"][0]["message"]["content"]}]
        with lock:
            tally["requests"] += 1
            tally["5xx" if status >= 500 else "ok" if status == 200 else "other_errors"] += 1


def _watch_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(RSS_EVERY):
        try:
            peak[0] = max(peak[0], rss_bytes(pid))
        except (OSError, TracelmError):
            return


def soak(cfg: RunConfig, clients: int = 8, requests: int = 100, sessions: int = 40, trace: bool = False,
         max_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """Run the soak on a server of `cfg`; the figures as a dict (see `describe`)."""
    with tempfile.TemporaryDirectory(prefix="tracelm-soak-") as tmp:
        server_opts = attrs.evolve(cfg.server, queue_size=max(cfg.server.queue_size, clients),
                                   trace_dir=str(Path(tmp) / "traces") if trace else None)
        server = ServerChild(attrs.evolve(cfg, server=server_opts), Path(tmp) / "server.log")
        try:
            return _drive(server, cfg, clients, requests, sessions, trace, max_tokens, seed)
        finally:
            server.stop()


def _drive(server: ServerChild, cfg: RunConfig, clients: int, requests: int, sessions: int, trace: bool,
           max_tokens: int, seed: int) -> dict[str, Any]:
    start = rss_bytes(server.proc.pid)
    peak, stop = [start], threading.Event()
    watcher = threading.Thread(target=_watch_rss, args=(server.proc.pid, stop, peak), daemon=True)
    watcher.start()
    conv, tally, lock = Conversations(sessions, seed), Counter(), threading.Lock()
    t0 = time.monotonic()
    threads = [threading.Thread(target=_client, args=(server.port, conv, requests, max_tokens, tally, lock))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    health = server.health()
    stop.set()
    watcher.join()
    end = rss_bytes(server.proc.pid)
    memory = health["memory"]
    bound = (cfg.server.session_memory_mb << 20) + memory["model_bytes"] + (SLACK_MB << 20)
    ok = tally["5xx"] == 0 and tally["requests"] == tally["ok"] + tally["other_errors"] and end <= bound
    return {"clients": clients, "requests_per_client": requests, "session_ids": sessions, "trace": trace,
            "max_tokens": max_tokens, "seconds": round(seconds, 1), "requests": tally["requests"],
            "ok": tally["ok"], "5xx": tally["5xx"], "other_errors": tally["other_errors"],
            "rss_start_mb": start >> 20, "rss_peak_mb": max(peak[0], end) >> 20, "rss_end_mb": end >> 20,
            "bound_mb": bound >> 20, "session_memory_mb": cfg.server.session_memory_mb,
            "model_mb": memory["model_bytes"] >> 20, "sessions_held": health["sessions"],
            "sessions_bytes_mb": round(memory["sessions_bytes"] / (1 << 20), 1),
            "sessions_evicted": memory["sessions_evicted"], "counters": health["counters"],
            "verdict": "PASS" if ok else "FAIL"}


def describe(r: dict[str, Any]) -> str:
    return "\n".join([
        f"soak: {r['clients']} clients x {r['requests_per_client']} requests, {r['session_ids']} session ids, "
        f"max_tokens {r['max_tokens']}, tracing {'on' if r['trace'] else 'off'}: {r['seconds']} s",
        f"requests {r['requests']}: {r['ok']} ok, {r['5xx']} 5xx, {r['other_errors']} other errors",
        f"sessions: {r['sessions_held']} held ({r['sessions_bytes_mb']} MB of arrays), {r['sessions_evicted']} "
        f"evicted",
        f"RSS: start {r['rss_start_mb']} MB, peak {r['rss_peak_mb']} MB, end {r['rss_end_mb']} MB; bound "
        f"{r['bound_mb']} MB (session_memory_mb {r['session_memory_mb']} + model {r['model_mb']} + {SLACK_MB})",
        r["verdict"],
    ])
