"""What a connection may cost the server: a read timeout (a request's headers must all arrive within it, each
read of its body too, and an idle keep-alive connection is closed after it), a limit on open connections, and
small socket buffers, so that hundreds of half-open connections hold little and not for long."""

from __future__ import annotations

import asyncio
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

BUFFER = 64 << 10  # bytes of each accepted socket's kernel buffers: a request body is at most 1 MiB


class _Timed(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read deadline and a connection limit (uvicorn has neither)."""

    timeout: float = 30.0
    max_connections: int = 512

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            transport.close()  # refused before it sends anything: the client sees the connection closed
            return
        self._arm()

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.timeout, self._expired)

    def _expired(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()  # an endpoint reading the body sees the client gone

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is None:
            return
        if self.conn.their_state is h11.SEND_BODY:
            self._arm()  # each read of the body within the timeout
        elif self.conn.their_state is not h11.IDLE:
            self._deadline.cancel()  # the request is in: the app answers it in its own time
            self._deadline = None
        # IDLE: the headers are still coming, against the deadline armed when the wait began

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # keep-alive: the next request's headers within the timeout

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        super().connection_lost(exc)


def server_config(app, sock: socket.socket | None, timeout: float, max_connections: int, **kwargs) -> uvicorn.Config:
    """uvicorn's settings for the server (sock: a bound socket, whose buffers are shrunk here)."""
    if sock is not None:
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # accepted sockets inherit them
            sock.setsockopt(socket.SOL_SOCKET, option, BUFFER)
    protocol = type("TimedH11", (_Timed,), {"timeout": timeout, "max_connections": max_connections})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=max(1, int(timeout)), **kwargs)
