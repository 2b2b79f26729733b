"""`--small-batch auto`, measured: at load, a few decode steps under each way this placement can serve a
streamed layer's few tokens (gather from the page-locked map, upload the picked experts, compute them on the
CPU), and the fastest is kept.

Which is fastest depends on the machine: on the H200 gathering was 8x the CPU's way, on a slow link or with a
fast CPU it may not be. One way serves every streamed layer: a step that mixes them cannot replay as one CUDA
graph (upload and cpu wait on the host), which would cost more than any per-layer difference gains (the
streamed layers of one model have the same shapes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from moestream.kernels import cpu_quant
from moestream.offload.schedule import SmallBatch
from moestream.offload.streamer import Streamer

ON_CPU_DEVICE = False  # measure on the CPU device too (tests, with injected delays): there the rule stands,
# every way reading the same RAM
WARM_UP = 2  # untimed steps a way: the first compiles kernels and captures the step's graph
STEPS = 4  # timed steps a way (their median counts)


@dataclass(frozen=True)
class Measured:
    """What auto chose, a decode step's seconds under each way it tried, and what choosing cost at load:
    the measuring (compiles and captures included) and the rebuild of the placement for the chosen way."""

    chosen: SmallBatch
    seconds: dict[SmallBatch, float]
    measuring: float = 0.0
    rebuilding: float = 0.0

    def describe(self) -> str:
        tried = ", ".join(f"{way} {s * 1e3:.1f}" for way, s in self.seconds.items())
        return (
            f"small batches: {self.chosen} (auto, measured ms a decode step: {tried}; "
            f"{self.measuring:.1f} s measuring, {self.rebuilding:.1f} s rebuilding the placement)"
        )


def ways(experts) -> list[SmallBatch]:
    """The ways this placement's streamed layers can serve a small batch."""
    out = []
    if experts.can_gather(experts.dev.device):
        out.append(SmallBatch.GATHER)
    if isinstance(experts.streamer, Streamer):  # across --devices no device holds a layer to upload into
        out.append(SmallBatch.UPLOAD)
    stored = {v.qtype for t in experts.tensors.values() for v in t.views}
    if stored <= cpu_quant.TYPES and cpu_quant.available():  # torch's dequantizing fallback is no contender
        out.append(SmallBatch.CPU)
    return out


def needed(engine) -> bool:
    """Whether auto has a choice to measure: streamed layers whose one-token steps take a small-batch way."""
    experts = engine.experts
    return (
        engine.options.small_batch is SmallBatch.AUTO
        and (engine.device.type == "cuda" or ON_CPU_DEVICE)
        and experts.streamer is not None
        and experts.min_batch > 1
        and len(ways(experts)) > 1
    )


def measure(engine) -> Measured:
    """Time decode steps from an empty sequence under each way (greedy tokens, not zeros). The steps leave
    their traces in the placement (byte counts, the expert cache's picks): the caller builds a fresh one."""
    experts, start = engine.experts, time.perf_counter()
    seconds = {}
    for way in ways(experts):
        experts.small_batch = way
        seconds[way] = _step_seconds(engine)
    return Measured(min(seconds, key=seconds.__getitem__), seconds, time.perf_counter() - start)


def _step_seconds(engine) -> float:
    cache = engine.new_cache()  # freed on return, its captured steps with it
    token, took = 1, []
    for i in range(WARM_UP + STEPS):
        start = time.perf_counter()
        token = int(engine.forward([token], cache)[-1].argmax())  # reading the token waits for the step
        if i >= WARM_UP:
            took.append(time.perf_counter() - start)
    return statistics.median(took)
