"""Time to first token of a chat follow-up turn whose conversation shares a long prefix with the turn before, cold
and warm, against a running OpenAI-compatible server (`moestream serve` or llama-server: only the HTTP API).

Each round writes a fresh system prompt of about --tokens tokens, asks turn 1 (its answer streamed in full), then
turn 2 (the conversation so far plus a question: warm, the prefix cached), then the same turn 2 over another
fresh system prompt of the same length (cold: nothing of it cached). Streamed, greedy; standard library only.

    python scripts/prompt_cache_ttft.py --url http://127.0.0.1:8080 [--tokens 8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from sse_client import ServerError, stream_events

WORDS = (
    "harbour light keeper storm night ship rope lamp tower island wave stone wind salt gull boat tide rock "
    "fog bell lens oil wick stair door window glass iron brass chart log entry hour minute weather north "
    "south east west coast cliff bay reef sand shell net fish crew captain mate deck mast sail anchor "
    "supply winter summer spring autumn morning evening dawn dusk cloud rain snow ice frost sun moon star "
    "keeper's wife child letter inspector report repair paint white red black green signal horn flag "
    "distance mile nautical chart coastguard radio message answer question note book pen table chair bed"
).split()
PROBE_WORDS = 100
QUESTION_1 = "Summarise the keeper's log above in three sentences."
QUESTION_2 = "Which entry mentions the storm first, and what did the keeper repair afterwards?"


def prefix_text(n_words: int, seed: int) -> str:
    """A system prompt of n_words pseudo-log words, different for each seed (so nothing of it is cached)."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choices(WORDS, k=12)) + f" (entry {i})." for i in range(n_words // 14 + 1)]
    return "\n".join(lines) + "\nThat was the log of the lighthouse you keep."  # differs from its first word


def stream_chat(url: str, messages: list[dict], max_tokens: int, key: str | None) -> dict:
    """One streamed chat request: seconds to the first generated text, the text, and the usage if reported."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    start, first, text, usage = time.perf_counter(), None, "", {}
    try:
        for chunk in stream_events(url, "/v1/chat/completions", body, key):
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {})
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter() - start
                text += delta.get("content") or ""
            usage = chunk.get("usage") or usage
    except ServerError as e:
        raise SystemExit(f"the server failed: {e}") from None
    if first is None:
        raise SystemExit("the server streamed no text: raise --answer-tokens, or check the model")
    return {"ttft": first, "text": text, "usage": usage}


def cached(usage: dict) -> str:
    details = usage.get("prompt_tokens_details") or {}
    return str(details.get("cached_tokens", "?"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--tokens", type=int, default=8192, help="about how many tokens the shared prefix has")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of turn 1's answer")
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    url = a.url.rstrip("/").removesuffix("/v1")
    if a.tokens < 64 or a.rounds < 1 or a.answer_tokens < 1:
        raise SystemExit("--tokens must be at least 64, --rounds and --answer-tokens at least 1")
    # words per token from two texts of their own (which the measured prompts do not share): the difference leaves
    # out the chat template's tokens, which made a one-text estimate ask 8192 and get ~7100
    counts = []
    for n in (PROBE_WORDS, 3 * PROBE_WORDS):
        probe = stream_chat(url, [{"role": "user", "content": prefix_text(n, seed=-1)}], 1, a.api_key)
        counts.append(probe["usage"].get("prompt_tokens", n))
    per_token = 2 * PROBE_WORDS / max(counts[1] - counts[0], 1)
    n_words = int(a.tokens * per_token)
    rows = []
    for r in range(a.rounds):
        system = {"role": "system", "content": prefix_text(n_words, seed=2 * r)}
        turn1 = [system, {"role": "user", "content": QUESTION_1}]
        t1 = stream_chat(url, turn1, a.answer_tokens, a.api_key)
        follow = [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": QUESTION_2}]
        warm = stream_chat(url, turn1 + follow, 1, a.api_key)
        other = {"role": "system", "content": prefix_text(n_words, seed=2 * r + 1)}
        cold = stream_chat(url, [other, turn1[1], *follow], 1, a.api_key)
        rows.append((cold["ttft"], warm["ttft"]))
        print(
            f"round {r}: turn 1 {t1['usage'].get('prompt_tokens', '?')} prompt tokens, ttft {t1['ttft'] * 1e3:.0f} ms;"
            f" turn 2 {warm['usage'].get('prompt_tokens', '?')} prompt tokens: cold ttft {cold['ttft'] * 1e3:.0f} ms"
            f" (cached {cached(cold['usage'])}), warm {warm['ttft'] * 1e3:.0f} ms (cached {cached(warm['usage'])})",
            flush=True,
        )
    cold_ms = statistics.median(c for c, _ in rows) * 1e3
    warm_ms = statistics.median(w for _, w in rows) * 1e3
    ratio = warm_ms / cold_ms
    print(f"median time to first token: cold {cold_ms:.0f} ms, warm {warm_ms:.0f} ms, warm/cold {ratio:.1%}")


if __name__ == "__main__":
    sys.exit(main())
