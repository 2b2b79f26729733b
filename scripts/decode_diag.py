"""Decode diagnostics on the GPU: how fast the gather kernel reads experts from host memory, the graphed
step under several tile settings of the quantized matvecs (side by side, one process), and where the
fastest step's GPU time goes (kernel table of eager static steps, the same kernels a graph replays).

    python scripts/decode_diag.py MODEL [stream]
"""

from __future__ import annotations

import sys

import torch

import moestream
from moestream.kernels.gather import RowGather


def _steps(engine, n: int = 72) -> list[int]:
    return [(7 * t) % 1000 + 1 for t in range(n)]  # not zeros: varied tokens, so varied experts


def step_ms(engine, n: int = 72) -> float:
    """Graphed one-token steps over positions 16..88, timed after a pass over the same positions (which
    captures each key bucket's graph), in CUDA-event ms a step."""
    engine._graphs.clear()
    cache = engine.new_cache()
    for _ in range(2):  # the first pass captures, the second is timed
        cache.reset()
        engine.forward(list(range(1, 17)), cache)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for t in _steps(engine, n):
            engine.forward([t], cache)
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / n


VARIANTS = {  # qmatvec's tile settings
    "defaults": {},
    "rows 16": dict(ROWS_PER_PROGRAM=16),
    "rows 4 warps 2": dict(ROWS_PER_PROGRAM=4, WARPS=2),
    "no grid minimum": dict(MIN_PROGRAMS=0),
    ">=528 programs": dict(MIN_PROGRAMS=528),
}


def use(variant: dict) -> dict:
    """Set qmatvec's tile settings; returns the ones they replaced."""
    from moestream.kernels import qmatvec

    saved = {k: getattr(qmatvec, k) for k in variant}
    for k, v in variant.items():
        setattr(qmatvec, k, v)
    return saved


def sweep(engine, variants: dict) -> dict:
    """The graphed step under each tile setting, side by side in one process (each recaptures its graphs).
    Returns the fastest setting."""
    best = (float("inf"), {})
    for name, v in variants.items():
        saved = use(v)
        ms = step_ms(engine)
        use(saved)
        print(f"step {name:<32} {ms:7.3f} ms  ({ms / engine.spec.n_layer * 1e3:6.1f} us a layer)", flush=True)
        best = min(best, (ms, v), key=lambda b: b[0])
    return best[1]


def kernel_table(engine, n_steps: int = 2) -> None:
    """Kernel times of eager static steps: the same kernels a graph replays, one launch each."""
    cache = engine.new_cache()
    engine.forward(list(range(1, 17)), cache)
    engine.forward([5], cache)
    engine._graphs_ok = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(n_steps):
            engine.forward([t + 2], cache)
        torch.cuda.synchronize()
    engine._graphs_ok = True
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / n_steps / 1e3
    count = sum(e.count for e in events) / n_steps
    per_layer = count / engine.spec.n_layer
    print(f"eager static step: {count:.0f} kernels ({per_layer:.1f} a layer), {total:.2f} ms of kernel time")
    print(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


def gather_rate(engine, reps: int = 50) -> None:
    pick = RowGather()
    experts = engine.model.experts
    streamed = [il for il in experts.tensors if il not in experts.resident]
    if not streamed:
        return
    t = experts.tensors[streamed[0]]
    raws = t.host_bytes()
    K = engine.spec.n_expert_used
    g = torch.Generator().manual_seed(0)
    ids = [torch.randperm(t.n_expert, generator=g)[:K].cuda() for _ in range(reps)]
    nbytes = K * (t.nbytes // t.n_expert)
    for i in range(3):
        for raw in raws:
            pick(raw, ids[i])
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        for raw in raws:
            pick(raw, ids[i])
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b) / reps
    mib, rate = nbytes / 2**20, nbytes / ms / 1e6
    print(f"gather: {K} experts of layer {streamed[0]} ({mib:.1f} MiB) in {ms:.3f} ms = {rate:.1f} GB/s")


if __name__ == "__main__":
    path, *rest = sys.argv[1:]
    opts = dict(n_cpu_moe=26, streamed_layers="spread", vram_budget="12GiB") if "stream" in rest else {}
    e = moestream.load(path, device="cuda", progress=False, **opts)
    gather_rate(e)
    best = sweep(e, VARIANTS)
    print(f"kernel table of the fastest: {best}")
    use(best)
    kernel_table(e)
    e.close()
