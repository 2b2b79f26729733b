"""Placement's GPU budget against the memory a long prompt really takes (issue 36): for each context, the
footprint's terms beside torch's allocator counters after load and at the prefill's peak, and the layers and
micro-batches where the peak was reached.

    python scripts/placement_peak.py -m MODEL --contexts 16384,32768 -ub 2048 -ncmoe 30 --streamed-layers spread \
        --stream layer-major --expert-cache 0

Prefills c - 1 random tokens (not zeros) from an empty cache, once to warm the kernels and once measured. The
`temporaries` row is the measured peak less what was allocated before the pass (weights, caches, ring, slots);
placement budgets `workspace` for it.
"""

from __future__ import annotations

import argparse
import random

import torch

from moestream.cli.args import engine_flags, engine_options, int_list
from moestream.runtime.loader import load

GIB = 2**30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_flags(p)
    p.add_argument("--contexts", type=int_list, default=[16384, 32768], help="contexts (prompt = c - 1 tokens)")
    return p.parse_args(argv)


class Visits:
    """on_layer for a pass: the allocator's high-water mark between one layer visit and the next."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.clear()

    def clear(self) -> None:
        self.peaks: dict[tuple[int, int], int] = {}  # (layer, visit number) -> peak bytes
        self.last: tuple[int, int] | None = None

    def __call__(self, il: int, x: torch.Tensor) -> None:
        self.close()
        torch.cuda.reset_peak_memory_stats(self.dev)
        self.last = (il, len(self.peaks))

    def close(self) -> int:
        """Ends the visit under way; the pass's peak."""
        if self.last is not None:
            self.peaks[self.last] = torch.cuda.max_memory_allocated(self.dev)
        return max(self.peaks.values(), default=0)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    dev = torch.device("cuda")
    print("| ctx | term | budgeted GiB | measured GiB |\n|---:|---|---:|---:|")
    for n_ctx in a.contexts:
        engine = load(a.model, engine_options(a, ctx=n_ctx))
        try:
            off = engine.setup.offload
            fp, pl = off.footprint, off.placement
            static = torch.cuda.memory_allocated(dev)
            tokens = [random.Random(n_ctx).randrange(1, engine.spec.n_vocab) for _ in range(n_ctx - 1)]
            visits = Visits(dev)
            for measured in (False, True):
                cache = engine.new_cache()
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
                visits.clear()
                engine.forward(tokens, cache, on_layer=visits if measured else None)
                torch.cuda.synchronize(dev)
                peak = visits.close() if measured else torch.cuda.max_memory_allocated(dev)
                del cache
            rows = [
                ("streamed layers", len(pl.streamed), None),
                ("dense", fp.dense / GIB, None),
                ("resident experts", pl.resident_bytes / GIB, None),
                ("staging", pl.staging_bytes / GIB, None),
                ("kv cache", fp.kv_cache / GIB, None),
                ("prefetch + expert cache", (fp.prefetch + fp.expert_cache) / GIB, None),
                (
                    "static (after load; the KV cache comes later)",
                    (pl.gpu_bytes(fp) - fp.workspace - fp.kv_cache) / GIB,
                    static / GIB,
                ),
                ("temporaries (peak - before pass)", fp.workspace / GIB, (peak - before) / GIB),
                ("total", pl.gpu_bytes(fp) / GIB, peak / GIB),
                ("reserved at the end", None, torch.cuda.memory_reserved(dev) / GIB),
            ]
            for name, budgeted, got in rows:
                b = "" if budgeted is None else f"{budgeted:.3f}"
                g = "" if got is None else f"{got:.3f}"
                print(f"| {n_ctx} | {name} | {b} | {g} |", flush=True)
            top = sorted(visits.peaks.items(), key=lambda kv: -kv[1])[:6]
            print(
                f"ctx {n_ctx}: highest (layer, visit) peaks: "
                + ", ".join(f"{k}: {(v - before) / GIB:.3f}" for k, v in top),
                flush=True,
            )
        finally:
            engine.close()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
