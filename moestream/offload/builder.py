"""Assemble the offload side of an engine: placement, page-locked host ranges, the streamer, the expert source."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile, torch_bytes
from moestream.kernels.gather import RowGather
from moestream.offload.device import CpuDevice, CudaDevice, cap_vram, make_device
from moestream.offload.expert_cache import ExpertCache
from moestream.offload.expert_tensors import ExpertTensors
from moestream.offload.experts import LayerExperts
from moestream.offload.host import PinnedRanges
from moestream.offload.options import EngineOptions
from moestream.offload.placement import (
    Footprint,
    Placement,
    cached_experts,
    kv_cache_bytes,
    parse_size,
    plan,
    workspace_bytes,
)
from moestream.offload.prefetch import Prefetcher, ring_bytes
from moestream.offload.schedule import SmallBatch
from moestream.offload.shards import ShardedStreamer, expert_ranges, shard_layer
from moestream.offload.streamer import HostLayer, Streamer


@dataclass
class Offload:
    placement: Placement
    footprint: Footprint
    experts: LayerExperts
    dev: CudaDevice | CpuDevice
    pinned: PinnedRanges | None
    bounce: bool  # registration was refused and bounce buffers carry the uploads
    owns_dev: bool  # made here (closed here) rather than handed in
    note: str = ""  # how the asked placement was read, when not literally (said in the placement line)
    extra_devs: list = field(default_factory=list)  # the other --devices, made (and closed) here

    def close(self) -> None:
        if self.experts.streamer is not None:
            self.experts.streamer.close()
        self.dev.synchronize()
        if self.owns_dev:
            self.dev.close()
        for d in self.extra_devs:
            d.close()
        if self.pinned is not None:
            self.pinned.unregister()

    def describe(self) -> str:
        p, gib = self.placement, 2**30
        lines = [
            f"placement: {len(p.resident)} layers' experts on the device ({p.resident_bytes / gib:.2f} GiB), "
            f"{len(p.streamed)} streamed from host RAM ({p.host_bytes / gib:.2f} GiB)"
            + (f": layers {p.streamed}" if p.spread else "")
            + (f" ({self.note})" if self.note else ""),
        ]
        if p.streamed:
            pinned = self.pinned.nbytes if self.pinned is not None else 0
            if self.bounce:
                how = "pinned bounce buffers (page-locking was refused)"
            elif pinned:
                how = f"{pinned / gib:.2f} GiB page-locked in place"
            else:
                how = "the mapped file, pageable (--host-memory pageable, serial schedule or CPU device)"
            lines.append(
                f"staging: {len(self.experts.streamer.slots)} slots x {p.slot_bytes / 2**20:.1f} MiB; host: {how}"
            )
            if (pf := self.experts.prefetcher) is not None:
                ring = sum(buf.numel() for slot in pf.slots for buf in slot.bufs)
                held = (
                    ""
                    if pf.cache is None
                    else (
                        f"; {pf.cache.n} of each held on the GPU, the most picked ({pf.cache.nbytes / 2**30:.2f} GiB, "
                        "--expert-cache)"
                    )
                )
                lines.append(
                    f"decode: {pf.n_guess} experts of each streamed layer guessed ahead and gathered beside compute "
                    f"(--prefetch; ring {ring / 2**20:.1f} MiB){held}"
                )
        return "\n".join(lines)


def streamed_layers(n_cpu_moe: int | str, n_layer: int) -> tuple[int | str, str]:
    """-ncmoe as the placement reads it, and a note when not literally: llama.cpp users write -ncmoe 99 for
    every layer, and "all" is n_layer; "auto" stays for the planner."""
    if n_cpu_moe == "all":
        return n_layer, ""
    if isinstance(n_cpu_moe, int) and n_cpu_moe > n_layer:
        note = f"--n-cpu-moe {n_cpu_moe} is more than the {n_layer} layers: every layer streams, as in llama.cpp"
        return n_layer, note
    return n_cpu_moe, ""


def check_expert_counts(opts: EngineOptions, spec) -> None:
    """--prefetch and --expert-cache count experts of a layer: at most the model's (the loader asks before any
    weight moves; each placement built asks again, for options changed since)."""
    for flag, n in (("--prefetch", opts.prefetch), ("--expert-cache", opts.expert_cache)):
        if isinstance(n, int) and n > spec.n_expert:
            raise MoestreamError(f"{flag} {n}: the model has {spec.n_expert} experts a layer; give at most that")


def build_offload(
    f: GGUFFile,
    arch,
    spec,
    opts: EngineOptions,
    dense_bytes: int,
    dev: CudaDevice | CpuDevice | None = None,
    pick: RowGather | None = None,
) -> Offload:
    """pick: the engine's expert picker, kept across placements (once its kernel failed, it is not retried)."""
    pick = pick or RowGather()
    device, dtype = opts.torch_device, opts.torch_dtype
    tensors = {
        il: ExpertTensors(tuple(f.tensor(n) for n in arch.expert_tensor_names(il))) for il in range(spec.n_layer)
    }
    n_ctx = opts.context(spec.n_ctx_train)
    check_expert_counts(opts, spec)
    n_guess = spec.n_expert_used if opts.prefetch is None else opts.prefetch
    # the ring of guesses is budgeted where small batches will gather, judged before page-locking is tried
    will_lock = device.type == "cpu" or (opts.host_memory == "pinned" and opts.stream.page_locks)
    sharded = opts.devices is not None and len(opts.devices) > 1
    may_gather = _prefetches(opts.small_batch, device, will_lock, pick, sharded)
    fp = Footprint(
        dense=dense_bytes,
        kv_cache=opts.n_seqs * (kv_cache_bytes(spec, n_ctx, dtype) + arch.state_bytes(spec)),
        workspace=workspace_bytes(spec, opts.ubatch, n_ctx, dtype),
        prefetch=ring_bytes(tensors, tensors, n_guess, spec.n_expert_used) if n_guess and may_gather else 0,
    )
    n_cpu_moe, note = streamed_layers(opts.n_cpu_moe, spec.n_layer)
    budget = parse_size(opts.vram_budget)
    placement = plan(
        [tensors[il].nbytes for il in range(spec.n_layer)],
        n_cpu_moe,
        opts.stream,
        opts.slots,
        budget,
        fp,
        opts.streamed_layers == "spread",
    )
    # allocations past the budget now fail, and the CLI says out of memory
    cap_vram(device, budget, opts.expandable_segments)
    given_extra: list = []  # tests hand in one simulated device per --devices entry
    if isinstance(dev, (list, tuple)):
        dev, *given_extra = dev
    owns_dev = dev is None
    dev = dev or make_device(device)
    made_extra: list = []  # the other --devices when made here (closed with the offload)
    pinned = PinnedRanges() if device.type == "cuda" else None
    try:
        resident = {}
        for il in tqdm(placement.resident, desc="experts", unit="layer", disable=not opts.progress, leave=False):
            resident[il] = [torch_bytes(v).to(device) for v in tensors[il].views]
        streamed = {il: HostLayer(tensors[il].host_bytes()) for il in placement.streamed}
        bounce = False
        if streamed and pinned is not None and opts.stream.page_locks and opts.host_memory == "pinned":
            bounce = not pinned.register([v.data for il in placement.streamed for v in tensors[il].views])
        streamer = None
        if streamed and opts.devices is not None and len(opts.devices) > 1:
            if not given_extra:
                made_extra = [make_device(torch.device(d)) for d in opts.devices[1:]]
            streamer = _sharded(streamed, tensors, spec, opts, [dev, *(given_extra or made_extra)], bounce)
        elif streamed:
            streamer = Streamer(dev, streamed, opts.stream, opts.slots, bounce)
        readable = device.type == "cpu" or (pinned is not None and pinned.nbytes > 0)  # page-locked: kernels read it
        small_batch = opts.small_batch.resolve(device.type == "cuda", readable, pick.kernel_ok, sharded)
        if small_batch is SmallBatch.GATHER and streamed and not readable:
            warnings.warn(
                "--small-batch gather needs the streamed experts page-locked (not --stream serial, and "
                "page-locking must succeed); small batches upload their experts instead",
                stacklevel=2,
            )
        prefetcher = None
        cache = None
        if streamed and n_guess and _prefetches(small_batch, device, readable, pick, sharded):
            sizes = [tensors[il].expert_bytes for il in placement.streamed]
            n_cached = cached_experts(opts.expert_cache, placement, fp, budget, sizes, spec.n_expert)
            cache = ExpertCache(tensors, placement.streamed, n_cached, device, pick) if n_cached else None
            fp = replace(fp, expert_cache=cache.nbytes if cache is not None else 0)
            prefetcher = Prefetcher(tensors, placement.streamed, n_guess, spec.n_expert_used, device, pick, cache)
        if streamed and opts.expert_cache not in ("auto", 0) and cache is None:
            warnings.warn(
                f"--expert-cache {opts.expert_cache}: the cache serves decode's guessed gathers, which need "
                "--small-batch gather (or auto on a GPU), streamed experts page-locked and --prefetch above 0; "
                "no experts are held",
                stacklevel=2,
            )
        experts = LayerExperts(
            tensors, resident, streamer, dtype, opts.stream_min_batch, dev, small_batch, readable, pick, prefetcher
        )
    except BaseException:
        if pinned is not None:
            pinned.unregister()
        for d in ([dev] if owns_dev else []) + made_extra:
            d.close()
        raise
    off = Offload(placement, fp, experts, dev, pinned, bounce, owns_dev, note, made_extra)
    if opts.progress:
        print(off.describe(), file=sys.stderr)
    return off


def _prefetches(mode: SmallBatch, device: torch.device, readable: bool, pick: RowGather, sharded: bool) -> bool:
    """Whether decode guesses and gathers experts ahead: small batches gather, from memory a kernel can read."""
    gathers = mode.resolve(device.type == "cuda", readable, pick.kernel_ok, sharded) is SmallBatch.GATHER
    return gathers and readable and (device.type == "cpu" or pick.kernel_ok)


def _sharded(streamed: dict, tensors: dict, spec, opts: EngineOptions, devs: list, bounce: bool) -> ShardedStreamer:
    """One ring a device, each carrying its range of every streamed layer's experts (--devices, --tensor-split)."""
    ranges = expert_ranges(spec.n_expert, opts.tensor_split)
    rings = [
        Streamer(d, {il: shard_layer(layer, lo, hi) for il, layer in streamed.items()}, opts.stream, opts.slots, bounce)
        for d, (lo, hi) in zip(devs, ranges, strict=True)
    ]
    return ShardedStreamer(rings, ranges)
