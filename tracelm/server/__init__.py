"""`tracelm serve`: an OpenAI-compatible HTTP API over one model.

- app.py: the Starlette application (routes, request checks, response shapes, SSE / JSON lines);
- params.py: OpenAI request bodies -> checked requests, and the OpenAI error shape;
- queue.py: the engine: one worker thread serving a bounded queue in arrival order;
- sessions.py: conversations whose KV cache is kept between requests (bounded, least recently used out);
- guard.py: uvicorn's h11 protocol with a time and a size limit on the request head (408 / 431), a time limit
  on its body (408);
- access.py: the API key on every route but /health and the pages, and the Host / Origin checks browsers need;
- metrics.py: GET /metrics (Prometheus, a registry per server); tokens.py: /tokenize, /detokenize (llama-server's
  shapes), /v1/embeddings; ollama.py: Ollama's /api routes over the same engine;
- pages.py: the chat page and the trace viewer, and their API.

Starlette + uvicorn: a small, well-kept ASGI pair whose streaming response notices a client that hangs
up; request bodies are checked by hand (params.py) so every mistake gets the OpenAI error shape.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from typing import Any

import attrs

from tracelm.state.errors import TracelmError


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a one-line TracelmError (address in use, unknown host, ...)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise TracelmError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: Any, host: str | None = None, port: int | None = None, api_key: str | None = None) -> None:
    """Load the config's model (a Session: its thread limits, its runners) and serve it until interrupted
    (SIGINT / SIGTERM). `api_key`: the key requests need (`--api-key-file`); None: the variable
    cfg.server.api_key_env names, if it is set."""
    import uvicorn

    from tracelm.server.app import Server
    from tracelm.server.guard import uvicorn_config
    from tracelm.session import Session

    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    if not 0 <= port <= 65535:
        raise TracelmError(f"--port {port}: expected 0..65535")
    api_key = api_key or os.environ.get(cfg.server.api_key_env) or None
    cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, host=host))  # its pages answer under this name too
    sock = _listen(host, port)
    try:
        session = Session(config=cfg, progress=True)
        server = Server(session, api_key)
        bound = sock.getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        print(f"tracelm: serving {server.model_id} at http://{url_host}:{bound}/v1 "
              f"({'API key required' if api_key else 'no API key'})", file=sys.stderr, flush=True)
        if not _is_loopback(host) and not api_key:
            print(f"tracelm: warning: listening on {host} without an API key; set {cfg.server.api_key_env}",
                  file=sys.stderr, flush=True)
        logging.getLogger("tracelm.server").addHandler(logging.StreamHandler(sys.stderr))
        config = uvicorn_config(server.app(), cfg.server)
        uvicorn.Server(config).run(sockets=[sock])
        session.close()
    finally:
        sock.close()
