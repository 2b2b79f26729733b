"""Stopping the server on Ctrl-C or SIGTERM: stop admitting (503 while draining), let the running requests finish
for --shutdown-timeout seconds, then end each stream with an error event and [DONE] and close what is left; the
caller then frees the engine and exits 130 (SIGINT) or 143 (SIGTERM). A second Ctrl-C skips the wait.

uvicorn's own handling waits on open streams without end, cuts them without [DONE] on a second Ctrl-C (a
traceback each), and re-raises SIGTERM after the server stops, which kills the process before its last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn

from moestream.errors import Terminated
from moestream.serving.errors import error_response

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLOSE_SECONDS = 2.0  # after the streams were told to end: time for their last events to go out


class Draining:
    """ASGI wrapper of the whole app: counts the requests in flight, and answers 503 once draining."""

    def __init__(self, app):
        self.app, self.draining, self.in_flight = app, False, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await error_response(503, "the server is shutting down; retry on another", "server_busy")(
                scope, receive, send
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown above. end_streams: ends every running request with an error event
    (Scheduler.stop; run on a worker thread, as it waits for the scheduler's turn to end)."""

    def __init__(self, config: uvicorn.Config, grace: float, end_streams: Callable[[], None]):
        self.drain = Draining(config.app)
        config.app = self.drain
        super().__init__(config)
        self.grace, self.end_streams = grace, end_streams
        self.signal: int | None = None
        self._cut = False
        self._task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.signal is None:
            self.signal = sig
            self.drain.draining = True
            self._loop.call_soon_threadsafe(self._start)
        else:
            self._cut = True  # a second signal: end the streams now

    def _start(self) -> None:
        self._task = self._loop.create_task(self._shut_down())

    async def _shut_down(self) -> None:
        deadline = time.monotonic() + self.grace
        while self.drain.in_flight and time.monotonic() < deadline and not self._cut:
            await asyncio.sleep(0.05)
        if self.drain.in_flight:
            await self._loop.run_in_executor(None, self.end_streams)
            closing = time.monotonic() + CLOSE_SECONDS
            while self.drain.in_flight and time.monotonic() < closing:
                await asyncio.sleep(0.05)
            for connection in list(self.server_state.connections):  # bodies never finished, readers gone
                connection.transport.close()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handler for SIGINT and SIGTERM while serving, the previous ones back after (not re-raised)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stopped(self) -> None:
        """After run(): exit as the signal asks (KeyboardInterrupt: 130, Terminated: 143)."""
        if self.signal == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal == signal.SIGTERM:
            raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM as an exception (while the model loads, say), so the command cleans up and exits 143 in one line."""

    def terminated(sig, frame):
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
