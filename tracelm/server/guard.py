"""uvicorn's h11 protocol with guards on the request: a time limit and a size limit on its head, a time limit on its
body.

uvicorn (0.54) has neither: its keep-alive timer is cancelled by the first byte that arrives, so a client sending
a head a byte at a time holds its connection forever; and h11 refuses a head past `h11_max_incomplete_event_size`
with a 400 written just before the connection is closed with the rest of the head unread, which the kernel turns
into a reset the client sees instead of the answer. `guarded_protocol` returns a subclass that

- closes a connection (after a 408) when no complete request head has arrived `header_timeout` seconds after the
  connection opened or the previous response ended;
- closes a connection (after a 408, when no response has started) whose request body is not complete
  `body_timeout` seconds after its head was (a body sent a byte a second would otherwise hold it for ever); the
  request's scope then says so (BODY_TIMED_OUT), for the one line the app logs;
- answers 431 to a head over `max_header_bytes` and then closes gracefully: the response is written, the sending
  side shut down, and what the client still sends is read and dropped (up to DRAIN_BYTES, for at most
  LINGER_SECONDS), so the client reads the 431 rather than a reset;
- closes as gracefully a connection whose response is complete before its request body is (a 413 or 401 answered
  without reading the body): uvicorn would keep it open, dropping what arrives, for as long as the client sends.

`uvicorn_config` gives uvicorn's settings with this protocol under a config's server options.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_SECONDS = 5.0
DRAIN_BYTES = 16 << 20
BODY_TIMED_OUT = "tracelm.body_timed_out"  # set in a request's scope when its body did not arrive in time


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI error body that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0
    max_header_bytes = 65536
    body_timeout = 20.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timing: str | None = None  # what the timer waits for: "head" or "body"
        self._head_bytes = 0  # bytes of the current request head received so far
        self._tail = b""  # the last 3 of them: the blank line that ends a head may span two reads
        self._drained: int | None = None  # after a 431: bytes read and dropped (None: not draining)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, self._head_timed_out, "head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._drained is not None:
            self._drained += len(data)
            if self._drained > DRAIN_BYTES:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE and self._head_over(data):  # still reading a request head
            return self._refuse_head()
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # the head is complete, the body is not: it has body_timeout seconds
            if self._timing != "body":
                self._arm(self.body_timeout, self._body_timed_out, "body")
        elif state is not h11.IDLE:  # the whole request is in: it is the app's now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:  # answered before the body was read: no next request here
            self._disarm()
            return self._linger_close()
        self._head_bytes, self._tail = 0, b""  # a kept-alive connection waits for the next head, in time
        self._arm(self.header_timeout, self._head_timed_out, "head")

    def _head_over(self, data: bytes) -> bool:
        """Count the head's bytes in `data` (up to its blank line: a body read with it is not the head's); True
        when the head is over the limit."""
        seen = self._tail + data
        end = seen.find(b"\r\n\r\n")
        self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
        self._tail = seen[-3:]
        return self._head_bytes > self.max_header_bytes

    def eof_received(self) -> bool | None:
        if self._drained is not None:
            self.transport.close()
        return super().eof_received()

    def _arm(self, seconds: float, then: Any, timing: str) -> None:
        self._disarm()
        self._timer, self._timing = self.loop.call_later(seconds, then), timing

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timing = None, None

    def _head_timed_out(self) -> None:
        self._timer, self._timing = None, None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            message = f"no complete request head within {self.header_timeout:g} s (server.header_timeout)"
            self.transport.write(_response(408, "Request Timeout", message, "request_timeout"))
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._timer, self._timing = None, None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None:
            cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
        if cycle is not None and cycle.response_started:
            return self.transport.close()
        message = f"the request body was not complete within {self.body_timeout:g} s (server.body_timeout)"
        self.transport.write(_response(408, "Request Timeout", message, "request_timeout"))
        if cycle is not None:  # to the app the client is gone now: its receive() says so, its sends go nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self._linger_close()

    def _refuse_head(self) -> None:
        self._disarm()
        message = (f"the request head (request line and headers) is larger than {self.max_header_bytes} bytes "
                   "(server.max_header_bytes)")
        self.transport.write(_response(431, "Request Header Fields Too Large", message, "request_header_too_large"))
        self._linger_close()

    def _linger_close(self) -> None:
        """Shut the sending side down (what was written goes out first), read and drop what the client still sends
        for LINGER_SECONDS, then close: the client reads the answer rather than a reset."""
        self._drained = 0
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:  # the client is gone already (a reset)
            return self.transport.close()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


def guarded_protocol(header_timeout: float, max_header_bytes: int, body_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes,
                 "body_timeout": body_timeout})


def uvicorn_config(app: Any, opts: Any, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for the app under `opts` (ServerOptions): the guarded protocol with its limits."""
    return uvicorn.Config(app, log_level=log_level, limit_concurrency=4 * (opts.queue_size + 1) + 16,
                          timeout_keep_alive=5, timeout_graceful_shutdown=5, server_header=False,
                          http=guarded_protocol(opts.header_timeout, opts.max_header_bytes, opts.body_timeout),
                          h11_max_incomplete_event_size=opts.max_header_bytes + 1024)
