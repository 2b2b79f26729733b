"""Decode diagnostics on the GPU: where a one-token step's GPU time goes (kernel table of eager static
steps, the same kernels a graph replays) and how fast the gather kernel reads experts from host memory."""

from __future__ import annotations

import sys
import time

import torch

import moestream
from moestream.kernels import gather


def kernel_table(engine, n_steps: int = 4) -> None:
    cache = engine.new_cache()
    engine.forward(list(range(16)), cache)
    for t in range(8):  # captured and replayed
        engine.forward([t], cache)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t in range(32):
        engine.forward([t], cache)
    torch.cuda.synchronize()
    print(f"graphed step: {(time.perf_counter() - start) / 32 * 1e3:.2f} ms wall")
    engine._graphs_ok = False  # eager static steps: the same kernels, one launch each
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(n_steps):
            engine.forward([t], cache)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / n_steps / 1e3
    count = sum(e.count for e in events) / n_steps
    print(f"eager static step: {count:.0f} kernels, {total:.2f} ms of kernel time")
    print(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=70))
    engine._graphs_ok = True


def gather_rate(engine, reps: int = 50) -> None:
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
            gather.gather_rows(raw, ids[i])
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        for raw in raws:
            gather.gather_rows(raw, ids[i])
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b) / reps
    mib, rate = nbytes / 2**20, nbytes / ms / 1e6
    print(f"gather: {K} experts of layer {streamed[0]} ({mib:.1f} MiB) in {ms:.3f} ms = {rate:.1f} GB/s")


def matvec_rate(engine, reps: int = 50) -> None:
    """Gate, up and down of 8 random experts by matvec, from VRAM and from page-locked host memory."""
    from moestream.kernels import qmatvec

    experts = engine.model.experts
    streamed = [il for il in experts.tensors if il not in experts.resident]
    layers = [("device", next(iter(experts.resident)))] + ([("host", streamed[0])] if streamed else [])
    K, D = engine.spec.n_expert_used, engine.spec.n_embd
    g = torch.Generator().manual_seed(0)
    for rows in (8, 16, 32):
        qmatvec.ROWS_PER_PROGRAM = rows
        for where, il in layers:
            t = experts.tensors[il]
            raws = experts.resident[il] if where == "device" else t.host_bytes()
            ids = [torch.randperm(t.n_expert, generator=g)[:K].cuda() for _ in range(reps)]
            x = torch.randn(K, D, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(K, t.views[0].shape[1], device="cuda", dtype=torch.bfloat16)

            def run(i, raws=raws, views=t.views, inputs=(x, x, h), ids=ids):
                for raw, v, inp in zip(raws, views, inputs, strict=True):
                    qmatvec.matvec(raw, v.qtype, v.shape[1], inp, ids[i])

            for i in range(3):
                run(i)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(reps):
                run(i)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / reps
            nbytes = K * (t.nbytes // t.n_expert)
            rate = nbytes / ms / 1e6
            print(f"matvec ROWS={rows} {where}: {K} experts of layer {il} in {ms:.3f} ms = {rate:.1f} GB/s")
    qmatvec.ROWS_PER_PROGRAM = 16


if __name__ == "__main__":
    path, *rest = sys.argv[1:]
    opts = dict(n_cpu_moe=26, streamed_layers="spread", vram_budget="12GiB") if "stream" in rest else {}
    e = moestream.load(path, device="cuda", progress=False, **opts)
    gather_rate(e)
    matvec_rate(e)
    kernel_table(e)
    e.close()
