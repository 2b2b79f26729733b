"""Placement: which layers' experts stay in host RAM (streamed) and which live on the GPU, within a budget.

`n_cpu_moe` = N keeps the experts of layers 0..N-1 in the mapped file, as llama.cpp's --n-cpu-moe does (it
counts blocks: a leading dense layer, which has no experts, counts too); with `spread`, N layers with experts
spaced evenly through the model instead, so resident layers compute while streamed ones upload (with the first
N, a one-micro-batch prompt computes every resident layer after the last upload).
With a VRAM budget and N = "auto", the smallest N whose GPU footprint fits is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moestream.errors import MoestreamError
from moestream.formats.quants.reference import scratch_bytes
from moestream.kernels import kv_quant
from moestream.offload.small_batch import evenly_spaced
from moestream.ops.linear import HEAD_ROWS
from moestream.ops.prefix_attention import KEY_CHUNK, attention_keys
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
class Sizing:
    """The two numbers a user trades against streamed layers, the context (-c) and the micro-batch (-ub), and
    the footprint at other values of them: what a refusal's advice searches."""

    n_ctx: int
    ubatch: int
    at: Callable[[int, int], Footprint]  # (n_ctx, ubatch) -> the footprint then

    @property
    def footprint(self) -> Footprint:
        return self.at(self.n_ctx, self.ubatch)


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
        return evenly_spaced(moe, self.n_cpu_moe)

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
    sizing: Sizing | None = None,
) -> Placement:
    """Choose the placement, budgeting the staging slots the schedule allocates for --slots `slots`; raise a
    clear error when the asked one cannot fit (with sizing: naming the largest -c and -ub that would)."""
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
        gib = 2**30
        raise MoestreamError(
            f"--n-cpu-moe {n_cpu_moe} needs {p.gpu_bytes(fp) / gib:.2f} GiB on the GPU (resident experts "
            f"{p.resident_bytes / gib:.2f}, weights {fp.dense / gib:.2f}, KV caches {fp.kv_cache / gib:.2f}, "
            f"{p.staging_bytes / gib:.2f} staging, workspace {fp.workspace / gib:.2f}) but --vram-budget is "
            f"{budget / gib:.2f} GiB; {_advice(p, budget, fp, sizing)}"
        )
    return p


def _advice(p: Placement, budget: int, fp: Footprint, sizing: Sizing | None) -> str:
    """What would fit instead of p: the largest -c, the largest -ub at p's N, and auto's N."""
    fits = []
    if sizing is not None:
        ctx = _largest(sizing.n_ctx - 1, lambda c: p.gpu_bytes(sizing.at(c, sizing.ubatch)) <= budget)
        ub = _largest(sizing.ubatch - 1, lambda u: p.gpu_bytes(sizing.at(sizing.n_ctx, u)) <= budget)
        fits = [f"-c {ctx}"] * bool(ctx) + [f"-ub {ub}"] * bool(ub)
    said = f"at --n-cpu-moe {p.n_cpu_moe} it fits with {' or '.join(fits)}; " if fits else ""
    n_layer = len(p.expert_bytes)
    auto = next(
        (n for n in range(n_layer + 1) if Placement(n, p.expert_bytes, p.n_slots, p.spread).gpu_bytes(fp) <= budget),
        None,
    )
    if auto is None:
        return said + "no --n-cpu-moe fits it, auto included: raise the budget or lower -c / -ub / --max-seqs"
    return said + f"--n-cpu-moe auto picks {auto} (streams more layers)"


def _largest(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 1..most with fits(n) (fits is monotone: true up to some n), 0 if none."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# Left free by an auto-sized expert cache: the footprint above undercounts a decode run's memory by 256-330 MiB
# (qwen3-30b-a3b at -ncmoe 26 under 12 GiB: a cache sized with 256 spare ran out of memory in bench tg128)
CACHE_SLACK = 640 * 2**20


def cached_experts(
    asked: int | str, p: Placement, fp: Footprint, budget: int | None, sizes: list[int], n_expert: int
) -> int:
    """Experts of each streamed layer the expert cache holds: `asked`, or (auto) as many as the budget leaves
    after everything else, CACHE_SLACK spared (none without a budget); at most the n_expert a layer has.
    sizes: one expert's bytes in each streamed layer the cache serves (the gathered ones). An asked count spares
    no slack: the user chose it (at most n_expert: builder.check_expert_counts)."""
    if not sizes:
        return 0
    per = len(sizes) * max(sizes)
    if asked == "auto":
        return 0 if budget is None else min(n_expert, max(0, (budget - p.gpu_bytes(fp) - CACHE_SLACK) // per))
    if budget is not None and p.gpu_bytes(fp) + asked * per > budget:
        room = max(0, (budget - p.gpu_bytes(fp)) // per)
        raise MoestreamError(
            f"--expert-cache {asked} needs {asked * per / 2**30:.2f} GiB on the GPU but --vram-budget leaves room "
            f"for {room} experts a streamed layer; use --expert-cache auto or a smaller count"
        )
    return asked


def cache_rows(
    asked: int | str, p: Placement, fp: Footprint, budget: int | None, sizes: list[int], n_expert: int
) -> Callable[[int], int]:
    """The expert cache's rows a layer beside KV caches of kv_bytes in all (the argument): an auto cache takes
    the room of the fp.kv_cache budgeted that no KV cache holds yet (a server makes them as its sequences come,
    sized to them), where it holds a row with all of it held; else cached_experts' count whatever they hold."""
    full = cached_experts(asked, p, fp, budget, sizes, n_expert)
    if asked != "auto" or full == 0:
        return lambda kv_bytes: full

    def rows(kv_bytes: int) -> int:
        return cached_experts(asked, p, replace(fp, kv_cache=min(kv_bytes, fp.kv_cache)), budget, sizes, n_expert)

    return rows


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


def workspace_bytes(
    spec, ubatch: int, n_ctx: int, dtype: torch.dtype, device_type: str = "cuda", stacks: int = 1
) -> int:
    """Peak temporaries of a micro-batch, and allocator slack."""
    return temporaries_bytes(spec, ubatch, n_ctx, dtype, device_type, stacks) + ALLOCATOR_SLACK


def temporaries_bytes(
    spec, ubatch: int, n_ctx: int, dtype: torch.dtype, device_type: str = "cuda", stacks: int = 1
) -> int:
    """The most a micro-batch of `ubatch` tokens allocates at once, at any depth up to n_ctx: the largest weight
    dequantized at once (an expert stack, made one at a time, or a slice of the output head), its grouped
    activations, and attention's keys and values repeated to every query head (at most a chunk of the prefix
    besides its own: ops/prefix_attention.py) with its queries and outputs, in float32 where chunks merge. On
    the CPU the blocks expand through the torch reference, whose steps have scratch of their own (a GPU's
    dequant kernels write the output directly; a type without one there falls in the allocator slack). Besides
    the micro-batch, the residual stream of a whole prompt of up to n_ctx tokens: every micro-batch is embedded
    up front, and layer-major order keeps them all between layers (runtime/engine.py). stacks: expert stacks
    alive at once (3 where prefill keeps a layer's dequantized stacks across its micro-batches)."""
    size = torch.empty((), dtype=dtype).element_size()
    stack = spec.n_expert * spec.n_ff_exp * spec.n_embd
    largest = max(stack, min(spec.n_vocab, HEAD_ROWS) * spec.n_embd)
    weights = max(stacks * stack, largest) * size + (scratch_bytes(largest, device_type) if device_type == "cpu" else 0)
    acts = ubatch * spec.n_expert_used * (3 * spec.n_ff_exp + 2 * spec.n_embd) * size
    rows = spec.n_head * spec.head_dim
    attention = (2 * attention_keys(n_ctx, ubatch) + 4 * ubatch) * rows * size
    if n_ctx > KEY_CHUNK:  # the running output and log-sum-exp, a chunk's in float32, their merge
        attention += 3 * ubatch * (rows + spec.n_head) * 4
    prompt = n_ctx * spec.n_embd * size
    return weights + acts + attention + prompt
