"""Decode diagnostics on the GPU: how fast the gather kernel reads experts from host memory, the graphed
step under several tile settings of the quantized matvecs (side by side, one process), and
where the fastest step's GPU time goes (kernel table of eager static steps, the same kernels a graph replays).

    python scripts/decode_diag.py MODEL [stream] [table]

table: the graphed step and the kernel table at the default tile settings alone (no sweep: each setting compiles
its kernels anew, ~40 s a fused projection).
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch

import moestream
from moestream.kernels import dots, matvec, moe_matvec, tuning
from moestream.kernels.gather import RowGather


def _steps(n: int = 72) -> list[int]:
    return [(7 * t) % 1000 + 1 for t in range(n)]  # not zeros: varied tokens, so varied experts


def step_ms(engine, n: int = 72) -> float:
    """Graphed one-token steps over positions 16..87, timed after a pass over the same positions (which
    captures each key bucket's graph), in CUDA-event ms a step."""
    engine.step.close()
    cache = engine.new_cache()
    for _ in range(2):  # the first pass captures, the second is timed
        cache.reset()
        engine.forward(list(range(1, 17)), cache)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for t in _steps(n):
            engine.forward([t], cache)
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / n


VARIANTS = {  # changes to the kernels' tuning
    "defaults": {},
    "rows not unrolled": dict(unrolled=0),
    "one block a row at a time": dict(blocks_at_once=1),
    "8 blocks at once": dict(blocks_at_once=8),
    "gate+up 4 blocks at once": dict(gate_up_blocks_at_once=4),
    "rows 4": dict(rows_per_program=4),
    "rows 16": dict(rows_per_program=16),
    "no grid minimum": dict(programs_per_sm=0),
}


def kernel_cases(engine) -> list[tuple[str, int, object]]:
    """(label, bytes read, run) for the matvec of every quantized dense weight of layer 0 and the head, and
    the first resident layer's picked experts: swiglu_picked whole, and its down products alone."""
    w, dev, dtype = engine.model.weights, engine.device, engine.dtype
    cases = []
    for name in [n for n in w._blocks if n.startswith("blk.0.") or n == "output.weight"]:
        raw, qtype, shape = w._blocks[name]
        if qtype not in dots.DOTS:  # dequantized and multiplied instead: nothing to tile
            continue
        x = torch.randn(1, shape[1], device=dev, dtype=dtype)
        run = partial(matvec.matvec, raw, qtype, shape[0], x)
        cases.append((f"{name} {qtype.name} {shape[0]}x{shape[1]}", raw.nbytes, run))
    experts = engine.experts
    if not experts.resident:
        return cases
    il = min(experts.resident)
    t, raws = experts.tensors[il], experts.resident[il]
    K, E, D = engine.spec.n_expert_used, t.n_expert, engine.spec.n_embd
    x = torch.randn(1, D, device=dev, dtype=dtype)
    ids = torch.randperm(E, generator=torch.Generator().manual_seed(1))[:K].view(1, K).to(dev)
    weights = torch.softmax(torch.randn(1, K, device=dev), -1).to(dtype)
    qtypes = tuple(v.qtype for v in t.views)
    n_ff = t.views[0].shape[1]
    assert moe_matvec.fuses(qtypes), "gate and up stored alike, as swiglu_picked needs"
    per = [r.nbytes // E * K for r in raws]
    h = torch.randn(K, n_ff, device=dev, dtype=dtype)
    cases.append(
        (
            f"layer {il}'s {K} experts (gate+up {qtypes[0].name}, down, sum)",
            sum(per),
            partial(moe_matvec.swiglu_picked, x, weights, ids, raws, qtypes, n_ff),
        )
    )
    cases.append(
        (
            f"layer {il}'s {K} down products {qtypes[2].name} {D}x{n_ff}",
            per[2],
            partial(matvec.matvec, raws[2], qtypes[2], D, h, ids.view(-1), K),
        )
    )
    return cases


def check_dots(engine) -> None:
    """Each variant against the defaults on the model's stored weights, before anything is timed."""
    for label, _, run in kernel_cases(engine):
        ref = run().float()
        for name, v in VARIANTS.items():
            with tuning.use(**v):
                got = run().float()
            err = float((got - ref).abs().max() / ref.abs().max())
            print(f"check {label} {name}: max relative difference {err:.1e}")
            assert err < 2e-2, "a variant disagrees with the defaults"


def sweep(engine, variants: dict, rounds: int = 3) -> dict:
    """The graphed step under each tile setting, side by side in one process (each recaptures its graphs),
    `rounds` times, each round starting one variant later: one pass in a fixed order once drifted with the
    order (every variant after the second 13-38% slower than the defaults). Returns the fastest setting by
    median."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with tuning.use(**variants[name]):
                times[name].append(step_ms(engine))
    for name in names:
        ms = statistics.median(times[name])
        each = " ".join(f"{t:.3f}" for t in times[name])
        print(f"step {name:<36} {ms:7.3f} ms  ({ms / engine.spec.n_layer * 1e3:6.1f} us a layer; rounds {each})")
    return variants[min(names, key=lambda name: statistics.median(times[name]))]


def kernel_table(engine, n_steps: int = 2) -> None:
    """Kernel times of eager static steps: the same kernels a graph replays, one launch each."""
    cache = engine.new_cache()
    engine.forward(list(range(1, 17)), cache)
    engine.forward([5], cache)
    capturing = engine.setup.capturing
    graphs_ok, capturing.one = capturing.one, False
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for t in range(n_steps):
                engine.forward([t + 2], cache)
            torch.cuda.synchronize()
    finally:
        capturing.one = graphs_ok
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / n_steps / 1e3
    count = sum(e.count for e in events) / n_steps
    per_layer = count / engine.spec.n_layer
    print(f"eager static step: {count:.0f} kernels ({per_layer:.1f} a layer), {total:.2f} ms of kernel time")
    print(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


def gather_rate(engine, reps: int = 50) -> None:
    pick = RowGather()
    experts = engine.experts
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
    if "table" in rest:
        best = sweep(e, {"defaults": {}})
    else:
        check_dots(e)
        best = sweep(e, VARIANTS)
    print(f"kernel table of the fastest: {best}")
    with tuning.use(**best):
        kernel_table(e)
    e.close()
