"""`moestream warmup -m MODEL [run/serve's flags]`: compile every kernel a run with those flags needs, ahead of a
server start, so its first request does not wait a minute on a fresh machine (the caches keep them)."""

from __future__ import annotations

import argparse
import sys

from moestream.cli.args import at_least, check_engine, engine_options


def add_warmup(sub) -> None:
    from moestream.cli.args import engine_flags

    warm = sub.add_parser("warmup", help="compile the kernels a run or a server with these flags needs, ahead of it")
    engine_flags(warm)
    warm.add_argument(
        "--max-seqs", "-np", "--parallel", type=int, default=1, help="also the batched steps of a server's sequences"
    )


def check_warmup(a: argparse.Namespace) -> None:
    at_least(a.max_seqs, 1, "--max-seqs")
    check_engine(a)


def cmd_warmup(a: argparse.Namespace) -> None:
    from moestream.kernels import compiles, cpu_quant

    opts = engine_options(a).replace(n_seqs=a.max_seqs)
    if opts.model.torch_device.type == "cpu":
        from moestream.formats.gguf import GGUFFile

        GGUFFile(a.model).close()  # nothing loads here: a damaged file is still said now, not at the run
        cpu_quant.available()  # the CPU device's one compiled kernel, built here if it is not yet
        compiles.summary()
        print(
            f"moestream: warmup: nothing to compile on the CPU device (its C matvec is built, in "
            f"{compiles.c_cache_dir()})",
            file=sys.stderr,
        )
        return
    from moestream.runtime.loader import load
    from moestream.tools.tokens import random_prompt

    engine = load(a.model, opts)  # --small-batch auto's measuring compiles the decode step's kernels
    try:
        n_vocab, ub = engine.spec.n_vocab, opts.model.ubatch
        cache = engine.new_cache()
        lengths = sorted({min(ub, engine.n_ctx // 2), 17})  # a full micro-batch and a short prompt's shapes
        for n in lengths:
            cache.reset()
            engine.forward(random_prompt(n, n_vocab), cache)
            for t in random_prompt(4, n_vocab, seed=1):
                engine.forward([t], cache)
        caches = []
        for _ in range(a.max_seqs if a.max_seqs > 1 else 0):  # each new KV cache may shrink an auto expert
            caches.append(engine.new_cache())  # cache (Setup.new_cache): a step at each of its sizes
            engine.forward(random_prompt(5, n_vocab), caches[-1])
            engine.forward(random_prompt(1, n_vocab, seed=2), caches[-1])
        for k in range(2, len(caches) + 1):  # a server's running batches of 2..--max-seqs sequences
            engine.forward_each(random_prompt(k, n_vocab, seed=k), caches[:k])
    finally:
        engine.close()
    if not compiles.summary():
        print("moestream: warmup: nothing to compile: every kernel these flags need is cached", file=sys.stderr)
    else:
        print("moestream: warmup: done; a run or server with these flags starts without compiling", file=sys.stderr)
