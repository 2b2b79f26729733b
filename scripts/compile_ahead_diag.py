"""Why a decode step's throwaway capture (runtime/step.py `_compile_ahead`) compiles only part of the step side by
side (issue 36, benchmarks.md thirtieth session): with compile_ahead on and an empty Triton cache of its own, the
first decode steps of MODEL, each compile named with its thread and phase (load, prefill, the capture's block,
after it), and the exception that ended the capture, if one did (the engine swallows it). CAPTURE_MODE=global
captures in CUDA's default mode instead of the engine's relaxed one (the A/B of why it stopped).

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile_ahead_diag.py MODEL [n_cpu_moe] [vram_budget]
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

import torch
import triton

from moestream.kernels import compiles, tuning
from moestream.runtime.loader import load

phase = ["load"]
seen: list[tuple[str, str, str, float]] = []  # (phase, thread, kernel, seconds)
listener = triton.knobs.compilation.listener  # moestream's own, installed at its import


def noting(**kw) -> None:
    if not kw["cache_hit"]:
        seconds = compiles.compile_seconds(kw["times"])
        seen.append((phase[0], threading.current_thread().name, getattr(kw["src"], "name", "?"), seconds))
    if listener is not None:
        listener(**kw)


triton.knobs.compilation.listener = noting
real = compiles.side_by_side


@contextlib.contextmanager
def watched(triton, workers=None):
    phase[0] = "ahead"
    start = time.perf_counter()
    try:
        with real(triton, workers):
            try:
                yield
            except BaseException as e:
                print(f"the capture stopped: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=12, file=sys.stdout)
                raise
    finally:
        print(f"the block took {time.perf_counter() - start:.2f} s (pool compiles waited for)", flush=True)
        phase[0] = "after"


compiles.side_by_side = watched
MODE = os.environ.get("CAPTURE_MODE")
if MODE:
    graph = torch.cuda.graph

    class Forced(graph):  # every capture in MODE (the throwaway one is the one that matters here)
        def __init__(self, cuda_graph, *args, capture_error_mode="global", **kw):
            super().__init__(cuda_graph, *args, capture_error_mode=MODE, **kw)

    torch.cuda.graph = Forced


def main() -> None:
    path = sys.argv[1]
    ncmoe = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    budget = sys.argv[3] if len(sys.argv) > 3 else None
    flat = dict(device="cuda", progress=False, n_cpu_moe=ncmoe, streamed_layers="spread", small_batch="gather")
    if budget:
        flat["vram_budget"] = budget
    mode = MODE or "relaxed (the engine's)"
    print(f"{path}: {ncmoe} layers streamed, capture mode {mode}", flush=True)
    with tuning.use(compile_ahead=True):
        engine = load(path, **flat)
        cache = engine.new_cache()
        phase[0] = "prefill"
        start = time.perf_counter()
        token = int(engine.forward([1, 2, 3, 4, 5, 6, 7, 8, 9], cache)[-1].argmax())
        print(f"prefill of 9 tokens: {time.perf_counter() - start:.2f} s", flush=True)
        for i in range(3):
            phase[0] = "step"
            start = time.perf_counter()
            token = int(engine.forward([token], cache)[-1].argmax())
            print(f"decode step {i}: {time.perf_counter() - start:.2f} s", flush=True)
        engine.close()
    for name in ("load", "prefill", "step", "ahead", "after"):
        rows = [r for r in seen if r[0] == name]
        threads = sorted({r[1] for r in rows})
        total = sum(r[3] for r in rows)
        print(f"{name}: {len(rows)} compiles, {total:.1f} s summed, on {len(threads)} thread(s) {threads[:3]}")
        for _, thread, kernel, seconds in rows:
            print(f"    {seconds:5.2f} s  {kernel}  ({thread})")


if __name__ == "__main__":
    main()
