"""Load test of `moestream serve` on loopback: N concurrent streaming clients for S seconds.

Checks zero failed requests and that every greedy answer equals the same request served alone, and reports
aggregate decode tokens/s against one client. Bounded: loopback only, a fixed duration.

    python scripts/load_test.py -m MODEL [--clients 16] [--seconds 60] [--max-seqs 4] [engine flags of serve]
"""

from __future__ import annotations

import argparse
import threading
import time

import openai
from local_server import LocalServer
from serve_bench import PROMPTS, Failures, run_clients

import moestream
from moestream.cli.args import engine_flags, engine_options

MODES = {None: "one pass or each alone, as measured", True: "one pass", False: "each sequence alone"}


def ask(c: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, int]:
    text, n = "", 0
    stream = c.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return text, n


def clients_for(url: str, n_clients: int, seconds: float, max_tokens: int, want: dict[str, str]) -> dict:
    stats, failures, lock = {"requests": 0, "mismatched": 0, "tokens": 0}, Failures(), threading.Lock()
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        i = k
        while time.monotonic() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                text, n = ask(c, prompt, max_tokens)
                with lock:
                    stats["requests"] += 1
                    stats["tokens"] += n
                    stats["mismatched"] += text != want[prompt]
            except Exception as e:  # counted, whatever the client raised
                failures.add(f"{type(e).__name__}: {e}")

    stats["seconds"] = run_clients(n_clients, client)
    stats["failed"] = failures.count
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_flags(ap)  # -m MODEL and the engine flags `moestream serve` takes
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens a request generates")
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="then the same clients with every decode turn one pass, and with each sequence stepped on its own",
    )
    a = ap.parse_args()
    engine = moestream.load(a.model, engine_options(a).replace(progress=False, n_seqs=a.max_seqs))
    runs = []
    try:
        for batched in (None, True, False) if a.baseline else (None,):
            server = LocalServer(engine, max_seqs=a.max_seqs, batched=batched)
            try:
                if not runs:
                    alone = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=600)
                    want = {p: ask(alone, p, a.max_tokens)[0] for p in PROMPTS}  # each request served alone
                    runs.append(("1 client", clients_for(server.url, 1, a.seconds / 4, a.max_tokens, want)))
                name = f"{a.clients} clients, " + MODES[batched]
                # not counted: this server's caches are new, and on a GPU their steps are captured first
                warm = clients_for(server.url, a.clients, a.seconds / 10, a.max_tokens, want)
                runs.append((name, clients_for(server.url, a.clients, a.seconds, a.max_tokens, want)))
                runs[-1][1]["failed"] += warm["failed"]
                runs[-1][1]["mismatched"] += warm["mismatched"]
                s = server.scheduler.stats
                print(f"{name}: {s.batched_turns} decode turns of several sequences in one pass, {s.alone_turns} alone")
            finally:
                server.stop()
    finally:
        engine.close()
    rate = {name: s["tokens"] / s["seconds"] for name, s in runs}
    for name, s in runs:
        print(
            f"{name}: {s['requests']} requests in {s['seconds']:.1f} s, {s['failed']} failed, "
            f"{s['mismatched']} not equal to the lone answer, {rate[name]:.1f} generated tokens/s"
        )
    names = [name for name, _ in runs]  # 1 client, the measured choice, and with --baseline one pass, each alone
    pairs = [("aggregate / one client", names[1], names[0])] + (
        [("one pass / each alone", names[2], names[3]), ("measured choice / each alone", names[1], names[3])]
        if a.baseline
        else []
    )
    for label, top, bottom in pairs:
        ratio = f"{rate[top] / rate[bottom]:.2f}x" if rate[bottom] else "n/a (nothing generated)"
        print(f"{label}: {ratio} (--max-seqs {a.max_seqs}, device {engine.options.model.device})")
    if any(s["failed"] or s["mismatched"] for _, s in runs):
        raise SystemExit("load test failed: requests failed or answers differed from the lone ones")


if __name__ == "__main__":
    main()
