"""Run the server in a background thread on a free loopback port (tests/serving/test_app.py and load_test.py)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from moestream.serving.app import create_app
from moestream.serving.connections import server_config
from moestream.serving.scheduler import Scheduler


class LocalServer:
    """A real uvicorn server on 127.0.0.1; `url` is its /v1 base. Stop it to drain the scheduler."""

    def __init__(
        self,
        engine,
        api_key: str | None = None,
        max_seqs: int = 4,
        model_id: str = "tiny",
        batched: bool | None = None,
        timeout: float = 30.0,
        max_connections: int = 512,
        **scheduling,  # the rest of Scheduler's options (cache_prompt, cache_ram)
    ):
        self.scheduler = Scheduler(engine, max_seqs=max_seqs, batched=batched, **scheduling)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = create_app(self.scheduler, model_id, api_key=api_key)
        where = dict(host="127.0.0.1", port=self.port, log_level="warning")
        config = server_config(app, None, timeout, max_connections, **where)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.scheduler.stop()
