"""The connection policy under the app: what a client can do to a socket before and after a request.

uvicorn's h11 protocol, extended with four limits (each a `ServerLimits` field and a `lmforge serve` flag):

* **header deadline** (`header_timeout_s`, `--header-timeout`): the request line and headers must
  arrive within this many seconds of the connection opening (or of the first byte of a keep-alive
  connection's next request), else 408 and close. A connection that never sends a byte is closed at
  the same deadline, so neither a slow-headers client (slowloris) nor an idle socket holds a slot.
* **keep-alive timeout** (`keep_alive_timeout_s`, `--keep-alive-timeout`): an idle connection between
  requests is closed after this (uvicorn's `timeout_keep_alive`).
* **connection cap** (`max_connections`, `--max-connections`): a connection past the cap is answered
  503 at once and closed, before it can take memory or a request slot.
* **lingering close** (`linger_s`, `linger_bytes`), as nginx's `lingering_close`: when the server closes a
  connection whose client may still be sending (an early 413, 408, 401 or 429 answered before the body
  was read), it sends the reply, shuts down its writing side (FIN), and keeps reading and discarding
  for at most `linger_s` seconds and `linger_bytes` bytes before the socket is closed. Closing at once
  with unread bytes in the receive buffer makes the kernel send a reset, which destroys the reply
  before a client that is still writing (an async `httpx`, a browser) has read it.

The body's own limits (size, per-read and whole-body deadlines) are the app's (`guard.py`): they need
the route and the model's context. `uvicorn_config(app, ...)` is what `lmforge serve` and the tests'
`ServerThread` both run, so the tests exercise this policy. Knows nothing about the engine.
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerLimits
from .errors import OpenAIError

_REASONS = {408: b"Request Timeout", 503: b"Service Unavailable"}


def raw_error(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response with OpenAI's error JSON, for answers sent before a request
    exists (h11 cannot frame a response to a request it has not parsed)."""
    body = json.dumps(OpenAIError(status, message, None, code).body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _REASONS[status], len(body))) + body


class LingeringTransport:
    """The socket's transport as the protocol sees it: `close()` lingers when the client may still be
    sending (see the module's docstring); everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol):
        self._t, self._protocol = transport, protocol
        self.lingering, self._budget, self._timer = False, 0, None

    def __getattr__(self, name: str):
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def write(self, data: bytes) -> None:
        if not self.lingering:
            self._t.write(data)

    def close(self) -> None:
        if self.is_closing():
            return
        if not self._protocol.client_may_be_sending() or not self._t.can_write_eof():
            self._t.close()
            return
        limits = self._protocol.limits
        try:
            self._t.write_eof()  # after the buffered reply: the client reads it, then sees our FIN
        except OSError:  # the client is gone already (reset: ENOTCONN): nothing to linger for
            self._t.close()
            return
        self.lingering, self._budget = True, limits.linger_bytes
        self._t.resume_reading()
        self._timer = asyncio.get_running_loop().call_later(limits.linger_s, self._t.close)

    def discard(self, n: int) -> None:
        self._budget -= n
        if self._budget < 0:
            self._t.close()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header deadline, the connection cap and the lingering close.
    `limits` is set on the subclass `protocol_class` makes."""

    limits: ServerLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.refused, self._header_timer = False, None
        super().connection_made(LingeringTransport(transport, self))
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            self._refuse(503, f"the server has {cap} connections open (--max-connections); retry later",
                         "too_many_connections")
            return
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self.transport.cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            self.transport.discard(len(data))
            return
        if self.refused:
            return
        if self.conn.their_state is h11.IDLE and self._header_timer is None:
            self._arm_header_deadline()  # a keep-alive connection's next request starts
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in
            self._disarm_header_deadline()

    def client_may_be_sending(self) -> bool:
        """True while the client may have bytes on their way: a request we have not read to its end, or
        a connection refused before its request was read."""
        return self.refused or self.conn.their_state is h11.SEND_BODY

    def _arm_header_deadline(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:  # a response is being written
            self.transport.close()
            return
        self._refuse(408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s "
                     "(--header-timeout)", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.refused = True
        self._disarm_header_deadline()
        self.transport.write(raw_error(status, message, code))
        self.transport.close()


def protocol_class(limits: ServerLimits) -> type[GuardedH11Protocol]:
    return type("LmforgeH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app, **kwargs) -> uvicorn.Config:
    """uvicorn's config for `app` (from `build_app`) with its connection policy. The event loop and the
    HTTP parser are fixed (asyncio, h11) rather than "whatever is installed", so every machine runs
    the code the tests ran; websockets are off (no route uses them)."""
    state = getattr(app.state, "server", None)
    limits = state.limits if state is not None else ServerLimits()
    return uvicorn.Config(app, http=protocol_class(limits), loop="asyncio", ws="none",
                          timeout_keep_alive=limits.keep_alive_timeout_s, **kwargs)
