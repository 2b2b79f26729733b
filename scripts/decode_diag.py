"""Decode diagnostics on the GPU: how fast the gather kernel reads experts from host memory, the graphed
step with and without the fused kernels and with other tile sizes (side by side, one process), and where a
step's GPU time goes (kernel table of eager static steps, the same kernels a graph replays).

    python scripts/decode_diag.py MODEL [stream]
"""

from __future__ import annotations

import sys

import torch

import moestream
from moestream.kernels.gather import RowGather


def _steps(engine, n: int = 72) -> list[int]:
    return [(7 * t) % 1000 + 1 for t in range(n)]  # not zeros: varied tokens, so varied experts


def step_ms(engine) -> float:
    """Graphed one-token steps over positions 16..88, timed after a pass over the same positions (which
    captures each key bucket's graph), in CUDA-event ms a step."""
    engine._graphs.clear()
    cache = engine.new_cache()
    for _ in range(2):  # the first pass captures, the second is timed
        cache.reset()
        engine.forward(list(range(1, 17)), cache)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for t in _steps(engine):
            engine.forward([t], cache)
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / len(_steps(engine))


def sweep(engine) -> None:
    """The resident step with the fused kernels against the torch ops they replaced, and the kernels'
    tile sizes, side by side in one process (each variant recaptures its graphs)."""
    from moestream.kernels import decode_attention, fused, qmatvec

    saved = (fused.usable, decode_attention.usable, qmatvec.fuses)
    variants = [
        ("torch ops (no fused kernels)", dict(off=True)),
        ("fused (defaults)", {}),
        ("fused, matvec rows 8", dict(rows=8)),
        ("fused, matvec rows 32", dict(rows=32)),
        ("fused, down rows 4", dict(down=4)),
        ("fused, down rows 16", dict(down=16)),
        ("fused, attention chunk >= 64", dict(chunk=64)),
    ]
    for name, v in variants:
        if v.get("off"):
            fused.usable = decode_attention.usable = lambda *a: False
            qmatvec.fuses = lambda *a: False
        qmatvec.ROWS_PER_PROGRAM = v.get("rows", 16)
        qmatvec.DOWN_ROWS = v.get("down", 8)
        decode_attention.MIN_CHUNK = v.get("chunk", 256)
        ms = step_ms(engine)
        print(f"step {name:<32} {ms:7.3f} ms  ({ms / engine.spec.n_layer * 1e3:6.1f} us a layer)")
        fused.usable, decode_attention.usable, qmatvec.fuses = saved
    qmatvec.ROWS_PER_PROGRAM, qmatvec.DOWN_ROWS, decode_attention.MIN_CHUNK = 16, 8, 256


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
    sweep(e)
    kernel_table(e)
    e.close()
