"""Time JsonConstraint.mask over a synthetic vocabulary of a real model's size (docs/benchmarks.md).

The mask is built only when a pick breaks the JSON; this is what such a step costs on the host."""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from moestream.runtime.json_constraint import JsonConstraint, feed

ALPHA = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
PREFIXES = ["", " ", '"', "\n", ", ", '":', "{"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=151_000)
    a = p.parse_args()
    rng = random.Random(0)
    toks = [bytes([i]) for i in range(256)]
    while len(toks) < a.vocab:
        word = "".join(rng.choice(ALPHA) for _ in range(rng.randint(2, 9)))
        toks.append((rng.choice(PREFIXES) + word).encode())
    tok = SimpleNamespace(token_bytes=toks.__getitem__, token_types=[1] * len(toks), tokens=toks, eos_ids=frozenset())
    schema = {"type": "object"}
    t0 = time.perf_counter()
    JsonConstraint(tok, schema)._index()
    print(f"index of {len(toks)} tokens: {time.perf_counter() - t0:.3f} s")
    import torch  # noqa: F401 (imported before timing: the mask imports it on first use)

    for text in (b"{", b'{"na', b'{"name": "Ann is', b'{"name": "Ann", '):
        c = JsonConstraint(tok, schema)
        c._index()
        for b in text:
            c.state = feed(c.state, b)
        t0 = time.perf_counter()
        allowed = int(c.mask(len(toks)).sum())
        print(f"mask after {text.decode()!r:20} {time.perf_counter() - t0:.3f} s, {allowed} tokens allowed")


if __name__ == "__main__":
    main()
