"""Who may use the server: its API key, and the checks browsers' rules against cross-site requests call for.

`Access` wraps the whole application (an ASGI middleware) and runs before any route:

- `GET /health` answers anyone (probes);
- the pages themselves (`GET /`, `/trace`, `/static/NAME`: HTML, JavaScript and CSS, no data) load without the
  key; the calls they make to the API send it;
- every other route, when the server has an API key, needs `Authorization: Bearer KEY` (401 otherwise);
- a request a browser sends from a page carries `Origin`: it must be this server's own origin, the Origin's host
  and port those of `Host` (403 otherwise), so a page elsewhere cannot post to this server, not even the
  "simple" requests (a `text/plain` POST) that no CORS preflight stops;
- a request with an `Origin`, and any request for the pages or their API (`/api/...`: a page's same-origin GET
  carries no Origin), must name in `Host` an IP address, `localhost`, the host the server listens on or one of
  `server.allowed_hosts` (403 otherwise): a DNS-rebinding page, served under the attacker's name that resolves to
  this server, sends that name.

A client that is not a browser sends no Origin: the OpenAI API answers it under any Host.

`read_body` reads a request's body up to a limit, counting as it streams in: past the limit it stops at once.
`body_lost` answers a body that stopped coming (the client went away, or server.body_timeout passed: guard.py) with
one line in the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tracelm.server.errors import ApiError
from tracelm.server.guard import BODY_TIMED_OUT

log = logging.getLogger("tracelm.server")

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_page(method: str, path: str) -> bool:
    """A page or one of its files: HTML, JavaScript, CSS, which hold no data."""
    return method in ("GET", "HEAD") and (path in ("/", "/trace") or path.startswith("/static/"))


def split_host(value: str, scheme: str) -> tuple[str, int | None]:
    """`host[:port]` (a Host header, an Origin's netloc) -> (lower-case name without brackets or final dot, port
    or the scheme's default); a port that is not a number gives (value, None), which matches nothing."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            return value, None
    else:
        name, sep, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        if not sep:
            name, port = value, ""
    if port and not port.isdigit():
        return value, None
    return name.rstrip("."), int(port) if port else DEFAULT_PORTS.get(scheme)


def host_allowed(name: str, allowed: frozenset[str]) -> bool:
    """An IP address, localhost (or a name under .localhost), or a name the operator allowed."""
    if name == "localhost" or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether a browser's `Origin` is the origin the request was sent to (its `Host`): same name and port."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme not in DEFAULT_PORTS or not parts.netloc or "@" in parts.netloc:
        return False  # "null" (a sandboxed or file: page) and anything that is not a web origin
    theirs = split_host(parts.netloc, parts.scheme)
    return theirs[1] is not None and theirs == split_host(host, scheme)


class Access:
    """The ASGI middleware: see the module's docstring."""

    def __init__(self, app: Any, api_key: str | None, allowed_hosts: Iterable[str] = (),
                 error_shapes: Mapping[str, Callable[[ApiError], Response]] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed = frozenset(h.strip().lower().strip("[]").rstrip(".") for h in allowed_hosts if h.strip())
        self.error_shapes = dict(error_shapes or {})  # path -> its API's error response (Ollama's); else OpenAI's

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                shape = self.error_shapes.get(scope["path"])
                response = shape(refused) if shape else JSONResponse(refused.body(), status_code=refused.status,
                                                                     headers=refused.headers)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope: dict[str, Any]) -> ApiError | None:
        """Why a request is refused before any route sees it, or None."""
        method, path = scope["method"], scope["path"]
        if path in ("/health", "/v1/health"):  # (llama-server's alias)
            return None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        origin, host = headers.get("origin"), headers.get("host", "")
        page = is_page(method, path)
        if origin is not None or page or path.startswith("/api/"):
            name = split_host(host, scope.get("scheme", "http"))[0]
            if not host_allowed(name, self.allowed):
                return ApiError(403, f"Host {host[:200]!r} is not a name this server answers pages and browsers "
                                     "under (IP addresses, localhost, its listening host and server.allowed_hosts)",
                                code="host_not_allowed")
        if origin is not None and not same_origin(origin, host, scope.get("scheme", "http")):
            return ApiError(403, f"a request from the page at {origin[:200]!r}: cross-origin requests are refused",
                            code="cross_origin")
        if self.api_key is not None and not page and not self._key_ok(headers.get("authorization", "")):
            return ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _key_ok(self, authorization: str) -> bool:
        assert self.api_key is not None
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as more than `limit` bytes have come (a Content-Length over it: before
    reading any). Nothing past the limit is kept."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def body_lost(request: Request, _exc: Exception) -> Response:
    """The handler of starlette's ClientDisconnect, raised while a request's body is read: one line in the log, no
    traceback (nobody is left to answer)."""
    why = ("not complete within server.body_timeout: closed with a 408" if request.scope.get(BODY_TIMED_OUT) else
           "the client closed the connection before it was complete")
    log.warning("%s %s: request body lost: %s", request.method, request.url.path[:200], why)
    return Response(status_code=499)
