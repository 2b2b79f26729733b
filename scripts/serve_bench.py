"""Throughput and latency of a running OpenAI-compatible server under N streaming clients: the same client for
`moestream serve` and llama-server, so their rows compare (issue 35).

Each client sends streamed /v1/completions (greedy, `ignore_eos`, --max-tokens each) one after another until the
phase's --seconds are over; requests in flight then finish and count. A phase reports the aggregate generated
tokens/s (all clients' tokens over the phase's wall time), tokens/s a stream (a request's tokens after its first
over the time since it), and time to first token p50 / p95. Standard library only.

    python scripts/serve_bench.py --url http://127.0.0.1:8080 [--clients 1,16] [--seconds 60] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from sse_client import ServerError, stream_events

PROMPTS = [
    "The capital of France is",
    "Count with me: one, two, three,",
    "The lighthouse keeper climbed",
    "Bread needs flour, water and",
    "def keeper_log(hour, minute, note):",
    "Questions the inspector asked:",
    "In the winter of 1962 a storm",
    "Her colleagues asked her why.",
]


def one_request(url: str, prompt: str, max_tokens: int, key: str | None) -> dict:
    """Seconds to the first text, seconds in all, and generated tokens (the usage's count, else text chunks)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start, first, chunks, usage = time.perf_counter(), None, 0, {}
    for chunk in stream_events(url, "/v1/completions", body, key, timeout=600):
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                chunks += 1
                first = first if first is not None else time.perf_counter() - start
        usage = chunk.get("usage") or usage
    if first is None:
        raise ServerError("no text streamed")
    return {"ttft": first, "total": time.perf_counter() - start, "tokens": usage.get("completion_tokens", chunks)}


class Failures:
    """Failed requests of concurrent clients: counted, each distinct message said once."""

    def __init__(self):
        self.count, self._seen, self._lock = 0, set(), threading.Lock()

    def add(self, said: str) -> None:
        with self._lock:
            self.count += 1
            new = said not in self._seen
            self._seen.add(said)
        if new:
            print(f"request failed: {said}", flush=True)


def run_clients(n_clients: int, client: Callable[[int], None]) -> float:
    """client(k) for each k < n_clients, on threads at once; the seconds until the last one returned."""
    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def phase(url: str, n_clients: int, seconds: float, max_tokens: int, key: str | None) -> dict:
    done, failures, lock = [], Failures(), threading.Lock()
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        i = k
        while time.monotonic() < deadline:
            try:
                r = one_request(url, PROMPTS[i % len(PROMPTS)], max_tokens, key)
                with lock:
                    done.append(r)
            except ServerError as e:
                failures.add(str(e))
            i += 1

    wall = run_clients(n_clients, client)
    ttfts = sorted(r["ttft"] for r in done) or [float("nan")]
    rates = [(r["tokens"] - 1) / (r["total"] - r["ttft"]) for r in done if r["tokens"] > 1 and r["total"] > r["ttft"]]
    return {
        "clients": n_clients,
        "requests": len(done),
        "failed": failures.count,
        "seconds": wall,
        "tokens_s": sum(r["tokens"] for r in done) / wall,
        "stream_tokens_s": statistics.median(rates) if rates else float("nan"),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--clients", default="1,16", help="comma-separated client counts, one phase each")
    p.add_argument("--seconds", type=float, default=60, help="how long each phase sends new requests")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--label", default="server", help="the first column of the rows (which engine)")
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    url = a.url.rstrip("/").removesuffix("/v1")
    try:
        counts = [int(c) for c in a.clients.split(",")]
    except ValueError:
        raise SystemExit(f"--clients takes comma-separated counts, not {a.clients!r}") from None
    if min(counts) < 1 or a.seconds <= 0 or a.max_tokens < 2:
        raise SystemExit("--clients must be at least 1, --seconds positive, --max-tokens at least 2")
    try:
        one_request(url, PROMPTS[0], a.max_tokens, a.api_key)  # warm-up: first-use compiles, graphs
    except ServerError as e:
        raise SystemExit(f"warm-up request failed: {e}") from None
    print("| engine | clients | requests | failed | tokens/s | tokens/s a stream | TTFT p50 ms | TTFT p95 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        r = phase(url, n, a.seconds, a.max_tokens, a.api_key)
        print(
            f"| {a.label} | {n} | {r['requests']} | {r['failed']} | {r['tokens_s']:.1f} | {r['stream_tokens_s']:.1f}"
            f" | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p95'] * 1e3:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
