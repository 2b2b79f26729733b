"""Hostile load on `moestream serve` over loopback, all at once: streaming clients, half-open connections (part of
a request, then silence) and chat requests whose template renders a huge text, against a generated tiny model on
the CPU device. Reports /health latency throughout, failed requests and the server's peak RSS.

Bounded: loopback only, a fixed duration, every client with a deadline; the server is stopped (Ctrl-C) at the end.

    python scripts/hostile_load.py [--seconds 30] [--clients 64] [--half-open 300] [--hostile 4] [--template-mb 60]
        [--serve-flag=-to --serve-flag=5 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np

from moestream.formats.gguf import GGUFFile
from moestream.formats.writer import TensorPlan, write_gguf
from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model

HUGE = "HUGE"  # the message that makes the template render --template-mb
DEADLINE = 30.0  # seconds a request may take before it counts as failed (default)
CLOSE = {"Connection": "close"}  # a connection a request: no race with the server closing an idle one


def write_hostile_model(path: Path, template_mb: float) -> str:
    """A generated tiny model whose chat template renders a huge text for the message HUGE (and the model's own
    chat format for any other)."""
    plain = path.with_suffix(".plain.gguf")
    make_model(plain, get_preset("tiny"), quant="Q4_K_M", seed=1, progress=False)
    with GGUFFile(plain) as f:
        meta = dict(f.metadata)
        words = int(template_mb * 1e6 / 12)
        meta["tokenizer.chat_template"] = (
            f"{{% if messages[-1]['content'] == '{HUGE}' %}}{{{{ 'lorem ipsum ' * {words} }}}}{{% else %}}"
            + meta["tokenizer.chat_template"]
            + "{% endif %}"
        )
        plans = [TensorPlan(name, t.qtype, t.shape) for name, t in f.tensors.items()]
        data = {name: np.array(t.data).reshape(-1) for name, t in f.tensors.items()}
        produce = lambda p: data[p.name].reshape(p.byte_shape)  # noqa: E731
        write_gguf(path, meta["general.architecture"], meta, plans, produce, progress=False)
    plain.unlink()
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a script run in the background has it ignored


def start_server(model: str, port: int, flags: list[str], log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "moestream.cli", "serve", "-m", model, "--device", "cpu", "--port", str(port)]
    p = subprocess.Popen(argv + flags, stdout=log, stderr=log, preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    p.kill()
    raise SystemExit("the server did not start")


def warm_up(base: str) -> None:
    """One chat and one completion first, not measured: a cold server's first passes set things up."""
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ]:
        httpx.post(base + path, json=body | {"max_tokens": 8}, timeout=120).raise_for_status()


def rss_kib(pid: int, key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Load:
    def __init__(self, base: str, seconds: float, deadline: float):
        self.base, self.end, self.deadline = base, time.monotonic() + seconds, deadline
        self.health: list[float] = []
        kinds = ["streams", "streams failed", "hostile requests", "hostile failed", "health failed"]
        self.counts = dict.fromkeys(kinds, 0)
        self.half_open_closed = 0
        self.errors: dict[str, int] = {}

    def failed(self, kind: str, why: str) -> None:
        self.counts[kind + " failed"] += 1
        self.errors[why] = self.errors.get(why, 0) + 1

    async def probe_health(self) -> None:
        """GET /health every 50 ms, each probe on its own (a frozen server leaves many waiting, each counted)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)
        async with httpx.AsyncClient(timeout=self.deadline, limits=limits, headers=CLOSE) as c:

            async def probe() -> None:
                start = time.perf_counter()
                try:
                    ok = (await c.get(self.base + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append(time.perf_counter() - start)
                if not ok:
                    self.counts["health failed"] += 1

            probes = []
            while time.monotonic() < self.end:
                probes.append(asyncio.create_task(probe()))
                await asyncio.sleep(0.05)
            await asyncio.gather(*probes)

    async def stream(self, c: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.monotonic() < self.end:
            i += 1
            chat = i % 2 == 0
            body = {"max_tokens": 8, "stream": True, "ignore_eos": True, "temperature": 0}
            if chat:
                body["messages"] = [{"role": "user", "content": f"Tell me about lighthouse {i}"}]
            else:
                body["prompt"] = f"The lighthouse keeper number {i} climbed"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            self.counts["streams"] += 1

            try:
                status, lines = await asyncio.wait_for(self._read(c, path, body), self.deadline)
            except (asyncio.TimeoutError, httpx.HTTPError) as e:  # noqa: UP041 (Python 3.10)
                self.failed("streams", type(e).__name__)
                continue
            if status != 200:
                self.failed("streams", f"HTTP {status}")
            elif lines[-1:] != ["data: [DONE]"] or any('"error"' in line for line in lines):
                self.failed("streams", "a stream without [DONE] or with an error")

    async def _read(self, c: httpx.AsyncClient, path: str, body: dict) -> tuple[int, list[str]]:
        async with c.stream("POST", self.base + path, json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]

    async def hostile(self, c: httpx.AsyncClient) -> None:
        """Chat requests whose template renders --template-mb: a quick 4xx is right, anything else fails."""
        while time.monotonic() < self.end:
            self.counts["hostile requests"] += 1
            body = {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 8}
            try:
                r = await asyncio.wait_for(c.post(self.base + "/v1/chat/completions", json=body), self.deadline)
                if not 400 <= r.status_code < 500:
                    self.failed("hostile", f"HTTP {r.status_code} to a hostile template")
            except (asyncio.TimeoutError, httpx.HTTPError) as e:  # noqa: UP041 (Python 3.10)
                self.failed("hostile", type(e).__name__)

    async def half_open(self, port: int) -> None:
        """A connection that sends headers and part of a body, then nothing; reopened when the server closes it."""
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: 5000\r\n\r\n"
        while time.monotonic() < self.end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            try:
                writer.write(head + b'{"prompt": "')
                await writer.drain()
                left = self.end - time.monotonic()
                if left > 0:
                    await asyncio.wait_for(reader.read(), timeout=left)  # b"" or a refusal: the server closed it
                    self.half_open_closed += 1
            except (asyncio.TimeoutError, OSError):  # noqa: UP041 (Python 3.10)
                pass
            finally:
                writer.close()
            await asyncio.sleep(random.random())  # reopened apart, not all in the same instant


async def run_clients(port: int, seconds: float, clients: int, half_open: int, hostile: int, deadline: float) -> Load:
    """The half-open connections first (a second to open them all), then everything else for `seconds`."""
    ramp = 1.0 if half_open else 0.0
    load = Load(f"http://127.0.0.1:{port}", ramp + seconds, deadline)
    limits = httpx.Limits(max_connections=clients + hostile, max_keepalive_connections=clients + hostile)
    async with httpx.AsyncClient(timeout=deadline, limits=limits, headers=CLOSE) as c:
        held = [asyncio.create_task(load.half_open(port)) for _ in range(half_open)]
        await asyncio.sleep(ramp)
        tasks = [load.probe_health()]
        tasks += [load.stream(c, k) for k in range(clients)]
        tasks += [load.hostile(c) for _ in range(hostile)]
        await asyncio.gather(*tasks, *held)
    return load


def run_load(
    seconds: float = 30,
    clients: int = 64,
    half_open: int = 300,
    hostile: int = 4,
    template_mb: float = 60,
    serve_flags: tuple[str, ...] = (),
    deadline: float = DEADLINE,
) -> dict:
    """The whole test: model, server, load, Ctrl-C; the results as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        model = write_hostile_model(Path(tmp) / "hostile.gguf", template_mb)
        port = free_port()
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            server = start_server(model, port, ["-c", "4096", *serve_flags], log)
            warm_up(f"http://127.0.0.1:{port}")
            peak, stop_sampling = [rss_kib(server.pid)], False

            async def sample_rss() -> None:
                while not stop_sampling:
                    peak.append(rss_kib(server.pid))
                    await asyncio.sleep(0.1)

            async def everything() -> Load:
                nonlocal stop_sampling
                sampler = asyncio.create_task(sample_rss())
                try:
                    return await run_clients(port, seconds, clients, half_open, hostile, deadline)
                finally:
                    stop_sampling = True
                    await sampler

            try:
                load = asyncio.run(everything())
            finally:
                peak.append(rss_kib(server.pid, "VmHWM"))  # the kernel's peak, between samples too
                server.send_signal(signal.SIGINT)
                try:
                    code = server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    code = "killed after 60 s"
        log_text = log_path.read_text(errors="replace")
    health = np.array(load.health) * 1000
    return {
        "seconds": seconds,
        "clients": clients,
        "half-open": half_open,
        "hostile": hostile,
        "template MB": template_mb,
        "health probes": len(health),
        "health p50 ms": float(np.percentile(health, 50)) if len(health) else None,
        "health p99 ms": float(np.percentile(health, 99)) if len(health) else None,
        "health max ms": float(health.max()) if len(health) else None,
        **load.counts,
        "failed": load.counts["streams failed"] + load.counts["hostile failed"] + load.counts["health failed"],
        "failures": load.errors,
        "half-open closed by the server": load.half_open_closed,
        "server peak RSS MiB": max(peak) / 1024,
        "server exit": code,
        "server tracebacks": log_text.count("Traceback"),
        "server log lines": len(log_text.splitlines()),
        "server log tail": log_text.splitlines()[-4:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--clients", type=int, default=64, help="streaming clients, each one request after another")
    ap.add_argument("--half-open", type=int, default=300, help="connections that send part of a request, then wait")
    ap.add_argument("--hostile", type=int, default=4, help="clients sending chat requests the template blows up")
    ap.add_argument("--template-mb", type=float, default=60, help="what the hostile template renders, in MB")
    ap.add_argument("--serve-flag", action="append", default=[], help="a flag for `moestream serve` (repeat)")
    ap.add_argument("--deadline", type=float, default=DEADLINE, help="seconds a request may take, or it failed")
    a = ap.parse_args()
    out = run_load(a.seconds, a.clients, a.half_open, a.hostile, a.template_mb, tuple(a.serve_flag), a.deadline)
    for key, value in out.items():
        print(f"{key}: {value:.1f}" if isinstance(value, float) else f"{key}: {value}")
    print(json.dumps(out))
    if out["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
