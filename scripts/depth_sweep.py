"""Decode speed deep in a context, per KV cache type (issue 36): tgN after D tokens of context for each depth and
each -ctk/-ctv pair, with the engine flags of `moestream run`, one process and one load.

    python scripts/depth_sweep.py -m MODEL -d 0,4096,8192,16384,32768 -n 128 -ctk bf16,q8_0,q4_0 -ctv same \
        [-ncmoe 26 --vram-budget 12GiB ...]

-ctv same pairs each -ctk type with itself. For each row: the prompt of D random tokens is prefilled once (not
timed), then N one-token steps are timed twice from position D: the first pass captures each key bucket's
graph, the second is reported (the cache is rewound to D between them; a delta-net state just runs on, which
costs the same). Prints a markdown row as each finishes: tokens/s, ms a token, and the KV cache's GiB.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from moestream.cli.args import engine_flags, engine_options, int_list
from moestream.runtime.loader import load


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_flags(p, lists=("cache_type_k", "cache_type_v"))
    p.add_argument("-d", "--depths", type=int_list, default=[0, 4096, 8192, 16384, 32768], help="context depths")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="decode steps timed at each depth")
    return p.parse_args(argv)


def pairs(a: argparse.Namespace) -> list[tuple[str, str]]:
    if a.cache_type_v == ["same"]:
        return [(k, k) for k in a.cache_type_k]
    return [(k, v) for k in a.cache_type_k for v in a.cache_type_v]


def decode_seconds(engine, cache, depth: int, n: int) -> float:
    """Seconds of n one-token steps from position depth (the second of two passes)."""
    rng = random.Random(depth)
    tokens = [rng.randrange(1, engine.spec.n_vocab) for _ in range(n)]
    for _ in range(2):
        cache.n_past = depth
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        start = time.perf_counter()
        for t in tokens:
            logits = engine.forward([t], cache)
        float(logits[0, 0])  # the last step's result on the host: every step has finished
        seconds = time.perf_counter() - start
    return seconds


def main(argv: list[str]) -> None:
    a = parse(argv)
    types = pairs(a)
    a.cache_type_k, a.cache_type_v = [types[0][0]], [types[0][1]]
    opts = engine_options(a, ctx=max(a.depths) + a.n_gen + 1)
    engine = load(a.model, opts)
    try:
        print("| type_k | type_v | depth | test | t/s | ms a token | KV GiB |")
        print("|---|---|---:|---|---:|---:|---:|")
        for type_k, type_v in types:
            engine.setup.reconfigure(cache_type_k=type_k, cache_type_v=type_v, progress=False)
            cache = engine.new_cache()
            kv_gib = sum(t.nbytes for s in (cache.kv.k, cache.kv.v) for t in s.values()) / 2**30
            filled = 0
            for depth in sorted(a.depths):
                rng = random.Random(0)
                cache.n_past = filled  # rewind past the last row's decode steps, then fill up to depth
                if depth > filled:
                    engine.forward([rng.randrange(1, engine.spec.n_vocab) for _ in range(depth - filled)], cache)
                filled = depth
                secs = decode_seconds(engine, cache, depth, a.n_gen)
                print(
                    f"| {type_k} | {type_v} | {depth} | tg{a.n_gen} @ d{depth} | {a.n_gen / secs:.1f} | "
                    f"{secs / a.n_gen * 1e3:.2f} | {kv_gib:.2f} |",
                    flush=True,
                )
            del cache
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
