"""The web pages: a chat with the served model at `/` and a trace viewer at `/trace`, plain HTML/JS/CSS from
tracelm/server/web (no build step, nothing fetched from elsewhere: they work offline).

Routes (`page_routes`, registered by `Server.app`; `viewer_app` serves the viewer alone for `tracelm trace view`):
- GET /, GET /trace, GET /static/NAME: the pages and their files;
- GET /api/info: what the chat page needs (model, context, default sampling, whether the server traces);
- POST /api/trace/verify: a trace file's bytes (at most server.max_upload_mb, refused with a 413 as soon as more
  has come) -> its verdict under the policy the pages were given (tracelm.audit.trust.judge, the same as `tracelm
  trace verify`; the default policy trusts no key) and its events, or {"not_a_trace": why}; the trace is parsed
  and judged in a thread, off the event loop;
- GET /api/trace/request/ID: the same for the trace the server wrote for request ID (with server.trace_dir);
- GET /api/trace/preloaded, GET /api/replay/preloaded: the files `tracelm trace view` was given.

With an API key every route but the pages themselves needs it (server/access.py, which also refuses cross-origin
requests and foreign Host names); the pages send the key the user typed into them.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tracelm.audit.policy import Policy
from tracelm.audit.trust import TrustVerdict, judge
from tracelm.audit.verify import Trace, parse_trace, read_trace
from tracelm.server.access import Access, body_lost, read_body
from tracelm.state.errors import TracelmError
from tracelm.state.run_config import ServerOptions

WEB = Path(__file__).with_name("web")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
REQUEST_ID = re.compile(r"(chatcmpl|cmpl)-[0-9a-f]{24}")
NO_STORE = {"Cache-Control": "no-store"}


@attrs.define
class TraceKey:
    """The HMAC key signatures are checked with, and the name it is shown by (the environment variable's)."""

    key: bytes
    name: str

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.key).hexdigest()[:16]


@attrs.define
class Pages:
    """What the pages can show: the chat (when a model is served), the server's per-request traces, the files a
    `tracelm trace view` was started with, and the key that checks signatures."""

    info: dict[str, Any] | None = None  # the chat page's /api/info; None: no chat (the viewer alone)
    trace_dir: Path | None = None
    trace: Path | None = None
    replay: dict[str, Any] | None = None
    key: TraceKey | None = None
    policy: Policy = attrs.Factory(Policy)  # whose keys and attestation requirements the verdicts use
    max_upload_mb: int = ServerOptions().max_upload_mb  # an uploaded trace larger than this is refused (413)

    def routes(self) -> list[Route]:
        routes = [
            Route("/trace", self.trace_page, methods=["GET"]),
            Route("/static/{name}", self.static, methods=["GET"]),
            Route("/api/trace/verify", self.verify_upload, methods=["POST"]),
            Route("/api/trace/request/{request_id}", self.request_trace, methods=["GET"]),
            Route("/api/trace/preloaded", self.preloaded_trace, methods=["GET"]),
            Route("/api/replay/preloaded", self.preloaded_replay, methods=["GET"]),
            Route("/api/info", self.api_info, methods=["GET"]),
        ]
        home = self.chat_page if self.info is not None else self.to_viewer
        return [Route("/", home, methods=["GET"]), *routes]

    async def chat_page(self, _request: Request) -> Response:
        return _web_file("index.html")

    async def trace_page(self, _request: Request) -> Response:
        return _web_file("trace.html")

    async def to_viewer(self, _request: Request) -> Response:
        return RedirectResponse("/trace", status_code=307)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _web_names() or name.endswith(".html"):
            return _problem(404, f"no such page file: {name[:100]}")
        return _web_file(name)

    async def api_info(self, _request: Request) -> Response:
        base = {"chat": self.info is not None, "tracing": self.trace_dir is not None,
                "preloaded": {"trace": self.trace is not None, "replay": self.replay is not None},
                "key": None if self.key is None else {"name": self.key.name, "fingerprint": self.key.fingerprint}}
        return JSONResponse({**base, **(self.info or {})}, headers=NO_STORE)

    async def verify_upload(self, request: Request) -> Response:
        data = await read_body(request, self.max_upload_mb << 20)
        if data is None:
            return _problem(413, f"the trace is larger than the viewer's limit of {self.max_upload_mb} MiB "
                                 "(server.max_upload_mb)")
        name = (request.query_params.get("name") or "uploaded trace")[:200]
        return JSONResponse(await run_in_threadpool(self._verify, data, name), headers=NO_STORE)

    def _verify(self, data: bytes, name: str) -> dict[str, Any]:
        try:
            trace = parse_trace(data, Path(name))
        except TracelmError as e:  # a verdict as well (`trace verify` exits 2): the file is not a trace
            return {"name": name, "not_a_trace": str(e)}
        return self.described(trace)

    async def request_trace(self, request: Request) -> Response:
        rid = request.path_params["request_id"]
        if self.trace_dir is None:
            return _problem(404, "this server writes no traces (start it with --set server.trace_dir=DIR)")
        if not REQUEST_ID.fullmatch(rid):
            return _problem(400, f"not a request id: {rid[:100]}")
        return await self._read(self.trace_dir / f"{rid}.jsonl")

    async def preloaded_trace(self, _request: Request) -> Response:
        if self.trace is None:
            return _problem(404, "no trace was given to this viewer")
        return await self._read(self.trace)

    async def preloaded_replay(self, _request: Request) -> Response:
        if self.replay is None:
            return _problem(404, "no replay report was given to this viewer")
        return JSONResponse(self.replay, headers=NO_STORE)

    async def _read(self, path: Path) -> Response:
        try:
            described = await run_in_threadpool(lambda: self.described(read_trace(path)))
        except TracelmError as e:
            return _problem(404 if not path.exists() else 400, str(e))
        return JSONResponse(described, headers=NO_STORE)

    def described(self, trace: Trace) -> dict[str, Any]:
        """A trace as the viewer shows it: its verdict under the policy (the chain; with the key, every mac; the
        signature, whether the policy trusts its key, the attestation evidence) and its events as parsed (null for
        a line that is not JSON)."""
        key = self.key.key if self.key is not None and trace.header.get("mac_algorithm") else None
        verdict = judge(trace, self.policy, key, None if key is None else self.key.name)  # type: ignore[union-attr]
        return {"name": trace.path.name, "verdict": verdict_dict(verdict, self.key if key else None),
                "events": trace.events}


def verdict_dict(verdict: TrustVerdict, key: TraceKey | None) -> dict[str, Any]:
    """The chain's verdict and the trust verdict, with the one-line state the viewer shows: 'broken at line N', or
    'chain intact, ' and the trust level ('unsigned: nothing authenticated', 'signed by key K, which the policy
    does not trust', 'trusted: ...', 'attested (...)')."""
    chain = verdict.chain
    assert chain is not None
    fp = str(chain.key_fingerprint)[:16]
    if verdict.level == "broken":
        state = f"broken at line {chain.bad_line}"
    elif verdict.level == "attested":
        state = "chain intact, " + verdict.headline.split(":")[0]
    elif verdict.level == "trusted":
        state = (f"chain intact, trusted: signed by key {fp}" if verdict.basis == "key" else
                 f"chain intact, trusted: every mac checked with key {key.name if key else '?'} (sha256 "
                 f"{key.fingerprint if key else '?'})")
    elif verdict.level == "signed":
        state = f"chain intact, signed by key {fp}, which the policy does not trust"
    else:
        state = "chain intact, unsigned: nothing authenticated"
    return {**attrs.asdict(chain), **verdict.as_dict(), "state": state}


def page_routes(server: Any) -> list[Route]:
    """The pages of `tracelm serve`: the chat on `server`'s model, and the viewer of its traces."""
    cfg, s = server.cfg, server.cfg.sampling
    info = {"model": server.model_id, "context": cfg.context, "max_tokens": cfg.max_tokens, "system": cfg.system,
            "api_key_required": server.api_key is not None,
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p}}
    return Pages(info=info, trace_dir=server.engine.trace_dir, policy=server.policy,
                 max_upload_mb=cfg.server.max_upload_mb).routes()


def viewer_app(trace: Path, replay: dict[str, Any] | None = None, key: TraceKey | None = None,
               policy: Policy | None = None) -> Starlette:
    """The trace viewer alone, with `trace` (and a replay report) preloaded: `tracelm trace view`."""
    read_trace(trace)  # not a trace at all: say so before serving
    pages = Pages(trace=trace, replay=replay, key=key, policy=policy or Policy())
    return Starlette(routes=pages.routes(), middleware=[Middleware(Access, api_key=None)],
                     exception_handlers={ClientDisconnect: body_lost})


def _web_names() -> set[str]:
    return {p.name for p in WEB.iterdir() if p.suffix in CONTENT_TYPES}


def _web_file(name: str) -> Response:
    path = WEB / name
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix], headers=NO_STORE)


def _problem(status: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=NO_STORE)


def read_replay_report(path: Path) -> dict[str, Any]:
    """A `tracelm replay --json` report from a file, or a TracelmError saying why it is not one."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TracelmError(f"{path}: cannot read the replay report: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError):
        raise TracelmError(f"{path}: not JSON: not a `tracelm replay --json` report") from None
    if not isinstance(report, dict) or "status" not in report or "divergence" not in report:
        raise TracelmError(f"{path}: not a `tracelm replay --json` report (no status and divergence)")
    return report


def serve_viewer(trace: Path, replay: Path | None, key: TraceKey | None, port: int,
                 policy: Policy | None = None) -> None:
    """`tracelm trace view`: the viewer on 127.0.0.1 with the files preloaded, until interrupted; prints the URL."""
    import uvicorn

    from tracelm.server.guard import uvicorn_config

    app = viewer_app(trace, read_replay_report(replay) if replay is not None else None, key, policy)
    try:
        sock = socket.create_server(("127.0.0.1", port))
    except OSError as e:
        raise TracelmError(f"trace view: cannot listen on 127.0.0.1:{port}: {e.strerror or e}") from None
    try:
        print(f"tracelm: trace viewer for {trace} at http://127.0.0.1:{sock.getsockname()[1]}/trace "
              "(Ctrl-C stops it)", file=sys.stderr, flush=True)
        config = uvicorn_config(app, ServerOptions(), log_level="warning")  # the server's guards (guard.py)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
