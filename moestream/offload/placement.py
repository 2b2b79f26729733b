"""Placement: which layers' experts stay in host RAM (streamed) and which live on the GPU, within a budget.

`n_cpu_moe` = N keeps the experts of layers 0..N-1 in the mapped file, as llama.cpp's --n-cpu-moe does (it
counts blocks: a leading dense layer, which has no experts, counts too); with `spread`, N layers with experts
spaced evenly through the model instead, so resident layers compute while streamed ones upload (with the first
N, a one-micro-batch prompt computes every resident layer after the last upload).
With a VRAM budget and N = "auto", the smallest N whose GPU footprint fits is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.kernels import kv_quant
from moestream.ops.linear import HEAD_ROWS
from moestream.options import Schedule


@dataclass(frozen=True)
class Footprint:
    """Bytes the engine allocates on the GPU, besides the resident experts."""

    dense: int  # attention, norms, routers, output head, shared experts (dequantized)
    kv_cache: int  # every sequence's (Options.n_seqs) KV cache and recurrent state
    workspace: int  # one layer's experts dequantized + activations of one micro-batch
    prefetch: int = 0  # decode's ring of guessed experts (offload/prefetch.py), when any layer streams
    expert_cache: int = 0  # streamed layers' experts held for decode (offload/expert_cache.py)


@dataclass(frozen=True)
class Placement:
    n_cpu_moe: int
    expert_bytes: list[int]  # stored bytes of each layer's experts; 0 for a layer without (a dense one)
    n_slots: int  # staging slots allocated: Schedule.staging_slots
    spread: bool = False  # stream N evenly spaced layers rather than the first N

    @property
    def expert_layers(self) -> list[int]:
        return [il for il, n in enumerate(self.expert_bytes) if n]

    @property
    def streamed(self) -> list[int]:
        moe = self.expert_layers
        if not self.spread:
            return [il for il in moe if il < self.n_cpu_moe]
        n = min(self.n_cpu_moe, len(moe))
        return [moe[int((i + 0.5) * len(moe) / n)] for i in range(n)]

    @property
    def resident(self) -> list[int]:
        streamed = set(self.streamed)
        return [il for il in self.expert_layers if il not in streamed]

    @property
    def slot_bytes(self) -> int:
        return max((self.expert_bytes[i] for i in self.streamed), default=0)

    @property
    def staging_bytes(self) -> int:
        return min(self.n_slots, len(self.streamed)) * self.slot_bytes

    @property
    def resident_bytes(self) -> int:
        return sum(self.expert_bytes[i] for i in self.resident)

    @property
    def host_bytes(self) -> int:
        return sum(self.expert_bytes[i] for i in self.streamed)

    def gpu_bytes(self, fp: Footprint) -> int:
        decode = fp.prefetch + fp.expert_cache if self.streamed else 0
        return fp.dense + fp.kv_cache + fp.workspace + decode + self.resident_bytes + self.staging_bytes


def plan(
    expert_bytes: list[int],
    n_cpu_moe: int | str,
    schedule: Schedule,
    slots: int,
    budget: int | None,
    fp: Footprint,
    spread: bool = False,
) -> Placement:
    """Choose the placement, budgeting the staging slots the schedule allocates for --slots `slots`; raise a
    clear error when the asked one cannot fit."""
    n_layer = len(expert_bytes)
    n_slots = schedule.staging_slots(slots)  # the options checked --slots
    if n_cpu_moe == "auto":  # with a budget: Options refuses auto without one
        for n in range(n_layer + 1):
            p = Placement(n, expert_bytes, n_slots, spread)
            if p.gpu_bytes(fp) <= budget:
                return p
        smallest = Placement(n_layer, expert_bytes, n_slots, spread)
        raise MoestreamError(
            f"--vram-budget {budget / 2**30:.2f} GiB is too small: even with every layer's experts in host RAM "
            f"the GPU needs {smallest.gpu_bytes(fp) / 2**30:.2f} GiB (weights {fp.dense / 2**30:.2f}, "
            f"KV caches {fp.kv_cache / 2**30:.2f}, {n_slots} staging slots {smallest.staging_bytes / 2**30:.2f}, "
            f"workspace {fp.workspace / 2**30:.2f}, decode's prefetch ring {fp.prefetch / 2**30:.2f}); raise the "
            "budget or lower --ctx / --ubatch / --max-seqs (or --prefetch 0)"
        )
    if not isinstance(n_cpu_moe, int) or not 0 <= n_cpu_moe <= n_layer:
        raise MoestreamError(f"--n-cpu-moe {n_cpu_moe}: must be between 0 and {n_layer} (the layer count) or auto")
    p = Placement(n_cpu_moe, expert_bytes, n_slots, spread)
    if budget is not None and p.gpu_bytes(fp) > budget:
        raise MoestreamError(
            f"--n-cpu-moe {n_cpu_moe} needs {p.gpu_bytes(fp) / 2**30:.2f} GiB on the GPU but --vram-budget is "
            f"{budget / 2**30:.2f} GiB; use --n-cpu-moe auto or stream more layers"
        )
    return p


# Left free by an auto-sized expert cache: the footprint above undercounts a decode run's memory by 256-330 MiB
# (qwen3-30b-a3b at -ncmoe 26 under 12 GiB: a cache sized with 256 spare ran out of memory in bench tg128)
CACHE_SLACK = 640 * 2**20


def cached_experts(
    asked: int | str, p: Placement, fp: Footprint, budget: int | None, sizes: list[int], n_expert: int
) -> int:
    """Experts of each streamed layer the expert cache holds: `asked`, or (auto) as many as the budget leaves
    after everything else, CACHE_SLACK spared (none without a budget); at most the n_expert a layer has.
    sizes: one expert's bytes in each streamed layer. An asked count spares no slack: the user chose it (at most
    n_expert: builder.check_expert_counts)."""
    if not p.streamed:
        return 0
    per = len(p.streamed) * max(sizes)
    if asked == "auto":
        return 0 if budget is None else min(n_expert, max(0, (budget - p.gpu_bytes(fp) - CACHE_SLACK) // per))
    if budget is not None and p.gpu_bytes(fp) + asked * per > budget:
        room = max(0, (budget - p.gpu_bytes(fp)) // per)
        raise MoestreamError(
            f"--expert-cache {asked} needs {asked * per / 2**30:.2f} GiB on the GPU but --vram-budget leaves room "
            f"for {room} experts a streamed layer; use --expert-cache auto or a smaller count"
        )
    return asked


def kv_cache_bytes(
    spec, n_ctx: int, dtype: torch.dtype, *, type_k: str | None = None, type_v: str | None = None
) -> int:
    """The KV cache of one sequence (runtime/kv_cache.py): K and V [n_ctx, Hkv, Dh] for each attention layer, in
    dtype or as -ctk/-ctv's types (kernels/kv_quant.py)."""
    width = spec.n_head_kv * spec.head_dim
    row = sum(
        width * torch.empty((), dtype=dtype).element_size() if name is None else kv_quant.row_bytes(name, width)
        for name in (type_k, type_v)
    )
    return len(spec.attention_layers) * n_ctx * row


ALLOCATOR_SLACK = 256 * 2**20  # rounding in the caching allocator, cuBLAS workspaces, small temporaries


def workspace_bytes(spec, ubatch: int, n_ctx: int, dtype: torch.dtype) -> int:
    """Peak temporaries: the largest weight dequantized at once (an expert stack, made one at a time, or a
    slice of the output head), one micro-batch's grouped activations, attention's keys and values repeated to
    every query head, and allocator slack."""
    size = torch.empty((), dtype=dtype).element_size()
    weights = max(spec.n_expert * spec.n_ff_exp * spec.n_embd, min(spec.n_vocab, HEAD_ROWS) * spec.n_embd) * size
    acts = ubatch * spec.n_expert_used * (3 * spec.n_ff_exp + 2 * spec.n_embd) * size
    attention = (2 * n_ctx + 4 * ubatch) * spec.n_head * spec.head_dim * size
    return weights + acts + attention + ALLOCATOR_SLACK
