"""Assemble the offload side of an engine: placement, page-locked host ranges, the streamer, the expert source."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile, torch_bytes
from moestream.kernels import cpu_quant, tuning
from moestream.kernels.gather import RowGather
from moestream.models.registry import layout
from moestream.offload.device import CpuDevice, CudaDevice, cap_vram, make_device
from moestream.offload.expert_cache import ExpertCache
from moestream.offload.expert_tensors import ExpertTensors
from moestream.offload.experts import ExpertBytes, LayerExperts
from moestream.offload.host import PinnedRanges, locked_for_upload
from moestream.offload.placement import (
    Footprint,
    Placement,
    Sizing,
    cache_rows,
    kv_cache_bytes,
    plan,
    workspace_bytes,
)
from moestream.offload.prefetch import Prefetcher, ring_bytes
from moestream.offload.shards import ShardedStreamer, expert_ranges, shard_layer
from moestream.offload.small_batch import Access, DecodePlan, Measured, decode_plan, ways
from moestream.offload.streamer import HostLayer, Streamer
from moestream.options import Options, SmallBatch, count_of, format_size, parse_size


@dataclass
class Offload:
    """One placement and what it holds: the experts where it put them, page locks, devices, and the decode side
    built from its DecodePlan (experts.plan)."""

    placement: Placement
    footprint: Footprint
    experts: LayerExperts
    pinned: PinnedRanges | None
    bounce: bool  # registration was refused and bounce buffers carry the uploads
    owns_dev: bool  # made here (closed here) rather than handed in
    note: str = ""  # how the asked placement was read, when not literally (said in the placement line)
    extra_devs: list = field(default_factory=list)  # the other --devices, made (and closed) here

    @property
    def dev(self) -> CudaDevice | CpuDevice:
        return self.experts.dev

    @property
    def plan(self) -> DecodePlan:
        return self.experts.plan

    def ways(self) -> list[SmallBatch]:
        """The ways this placement's streamed layers can serve a small batch (what auto may measure)."""
        stored = {v.qtype for t in self.experts.tensors.values() for v in t.views}
        return ways(self.plan.access, stored <= cpu_quant.TYPES and cpu_quant.available())

    def trial(self, way: SmallBatch) -> LayerExperts:
        """This placement's experts with small batches served `way`, for auto to time: its own decode side when
        that is the way it was built for, else one over the same bytes that guesses nothing (its ring and
        expert cache serve the way they were built for)."""
        plan = self.plan.trying(way)
        return self.experts if plan == self.plan else LayerExperts(self.experts.stored, plan)

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
        p = self.placement
        lines = [
            f"placement: {_layers_experts(len(p.resident))} on the device ({format_size(p.resident_bytes)}), "
            f"{len(p.streamed)} streamed from host RAM ({format_size(p.host_bytes)})"
            + (f": layers {p.streamed}" if p.spread else "")
            + (f" ({self.note})" if self.note else ""),
        ]
        if p.streamed:
            pinned = self.pinned.nbytes if self.pinned is not None else 0
            if self.bounce:
                how = "pinned bounce buffers (page-locking was refused)"
            elif pinned:
                how = f"{format_size(pinned)} page-locked in place"
            else:
                how = "the mapped file, pageable (--host-memory pageable, serial schedule or CPU device)"
            lines.append(
                f"staging: {count_of(len(self.experts.streamer.slots), 'slot')} x "
                f"{p.slot_bytes / 2**20:.1f} MiB; host: {how}"
            )
            if (pf := self.experts.prefetcher) is not None:
                ring = sum(buf.numel() for slot in pf.slots for buf in slot.bufs)
                held = ""
                if pf.cache is not None:
                    held = (
                        f"; {pf.cache.n} of each held on the GPU, the most picked "
                        f"({format_size(pf.cache.nbytes)}, --expert-cache)"
                    )
                    if (least := pf.cache.rows_for(self.footprint.kv_cache)) < pf.cache.n:  # auto: KV room
                        held += f", down to {least} as sequences' KV caches take the room budgeted for them"
                rows = f" for each of up to {pf.rows} sequences a pass" if pf.rows > 1 else ""
                ahead = f" {pf.ahead} streamed layers" if pf.ahead > 1 else ""
                lines.append(
                    f"decode: {count_of(pf.n_guess, 'expert')} of each streamed layer guessed{ahead} ahead{rows} "
                    f"and gathered beside compute (--prefetch; ring {ring / 2**20:.1f} MiB){held}"
                )
        return "\n".join(lines)


def _layers_experts(n: int) -> str:
    """'1 layer's experts', '2 layers' experts'."""
    return f"{n} layer's experts" if n == 1 else f"{n} layers' experts"


def streamed_layers(n_cpu_moe: int | str, n_layer: int) -> tuple[int | str, str]:
    """-ncmoe as the placement reads it, and a note when not literally: llama.cpp users write -ncmoe 99 for
    every layer, and "all" is n_layer; "auto" stays for the planner."""
    if n_cpu_moe == "all":
        return n_layer, ""
    if isinstance(n_cpu_moe, int) and n_cpu_moe > n_layer:
        layers = count_of(n_layer, "layer")
        note = f"--n-cpu-moe {n_cpu_moe} is more than the {layers}: every layer streams, as in llama.cpp"
        return n_layer, note
    return n_cpu_moe, ""


def check_expert_counts(opts: Options, spec) -> None:
    """--prefetch and --expert-cache count experts of a layer: at most the model's (the loader asks before any
    weight moves; each placement built asks again, for options changed since)."""
    for flag, n in (("--prefetch", opts.decode.prefetch), ("--expert-cache", opts.decode.expert_cache)):
        if isinstance(n, int) and n > spec.n_expert:
            raise MoestreamError(f"{flag} {n}: the model has {spec.n_expert} experts a layer; give at most that")


def build_offload(
    f: GGUFFile,
    spec,
    state_bytes: int,
    opts: Options,
    dense_bytes: int,
    dev: CudaDevice | CpuDevice | list | None = None,
    pick: RowGather | None = None,
    measured: Measured | None = None,
) -> Offload:
    """The placement for opts, its experts put where it says and served by its decode plan. state_bytes: one
    sequence's state besides its KV cache (the model module's state_bytes); dev: the compute
    device (tests hand in simulated ones, a list for --devices); pick: the engine's expert picker, kept across
    placements (once its kernel failed, it is not retried); measured: what --small-batch auto timed."""
    pick = pick or RowGather()
    device = opts.model.torch_device
    names = layout(spec.arch).expert_tensor_names  # the file's layout: a layer's expert tensors
    tensors = {il: ExpertTensors(tuple(f.tensor(n) for n in names(il))) for il in spec.expert_layers}
    check_expert_counts(opts, spec)
    # the ring of guesses is budgeted where small batches will gather, judged before page-locking is tried
    will_lock = device.type == "cpu" or (opts.placement.host_memory == "pinned" and opts.streaming.stream.page_locks)
    expected = decode_plan(opts, spec.n_expert_used, _access(opts, pick, will_lock), measured)
    rows = _guessed_rows(opts, spec)
    sizing = Sizing(
        opts.model.context(spec.n_ctx_train),
        opts.model.ubatch,
        lambda n_ctx, ubatch: _footprint(spec, state_bytes, opts, dense_bytes, tensors, expected, rows, n_ctx, ubatch),
    )
    fp = sizing.footprint
    n_cpu_moe, note = streamed_layers(opts.placement.n_cpu_moe, spec.n_layer)
    budget = parse_size(opts.placement.vram_budget)
    sizes = [tensors[il].nbytes if il in tensors else 0 for il in range(spec.n_layer)]  # 0: a dense layer
    placement = plan(
        sizes,
        n_cpu_moe,
        opts.streaming.stream,
        opts.streaming.slots,
        budget,
        fp,
        opts.placement.streamed_layers == "spread",
        sizing,
    )
    cap_vram(
        device, budget, opts.placement.expandable_segments
    )  # allocations past it now fail: the CLI says out of memory
    given = list(dev) if isinstance(dev, (list, tuple)) else [dev] if dev is not None else []
    first = given[0] if given else make_device(device)
    made: list = []  # the other --devices when made here (closed with the offload)
    pinned = PinnedRanges() if device.type == "cuda" else None
    try:
        resident = {}
        show = opts.model.progress and bool(placement.resident)  # no empty bar when every layer streams
        for il in tqdm(placement.resident, desc="experts", unit="layer", disable=not show, leave=False):
            with locked_for_upload([v.data for v in tensors[il].views], device) as fast:
                resident[il] = [torch_bytes(v).to(device, non_blocking=fast) for v in tensors[il].views]
        devs = [first]
        if placement.streamed and opts.placement.devices is not None and len(opts.placement.devices) > 1:
            made = [] if len(given) > 1 else [make_device(torch.device(d)) for d in opts.placement.devices[1:]]
            devs += given[1:] or made
        streamer, bounce = _streamer(tensors, placement, spec, opts, devs, pinned)
        asked = opts.streaming.stream.staging_slots(opts.streaming.slots)
        if streamer is not None and len(streamer.slots) < asked and opts.model.progress:
            print(
                f"moestream: note: --slots {opts.streaming.slots}: {count_of(len(streamer.slots), 'staging slot')}, "
                "as many as layers stream (more would hold nothing)",
                file=sys.stderr,
            )
        readable = device.type == "cpu" or (pinned is not None and pinned.nbytes > 0)  # page-locked: kernels read it
        decode = decode_plan(opts, spec.n_expert_used, _access(opts, pick, readable, streamer is not None), measured)
        decode.warn()
        stored = ExpertBytes(tensors, resident, streamer, first, opts.model.torch_dtype, pick)
        experts, fp = _serve(stored, decode, placement, fp, budget, spec, rows, opts.serving.n_seqs)
    except BaseException:
        if pinned is not None:
            pinned.unregister()
        for d in ([] if given else [first]) + made:
            d.close()
        raise
    off = Offload(placement, fp, experts, pinned, bounce, not given, note, made)
    if opts.model.progress:
        print(off.describe(), file=sys.stderr)
    return off


def _streamer(
    tensors: dict, placement: Placement, spec, opts: Options, devs: list, pinned: PinnedRanges | None
) -> tuple[Streamer | ShardedStreamer | None, bool]:
    """The streamed layers' streamer (one ring a device over several --devices), their ranges of the map
    page-locked first; and whether that was refused (then bounce buffers carry the uploads)."""
    streamed = {il: HostLayer(tensors[il].host_bytes()) for il in placement.streamed}
    if not streamed:
        return None, False
    bounce = False
    if pinned is not None and opts.streaming.stream.page_locks and opts.placement.host_memory == "pinned":
        views = [v.data for il in placement.streamed for v in tensors[il].views]
        if opts.model.progress:
            size = format_size(sum(v.nbytes for v in views))
            print(f"moestream: page-locking {size} of streamed experts in place", file=sys.stderr, flush=True)
        bounce = not pinned.register(views)
    if len(devs) > 1:
        return _sharded(streamed, spec, opts, devs, bounce), bounce
    return Streamer(devs[0], streamed, opts.streaming.stream, opts.streaming.slots, bounce), bounce


def _access(opts: Options, pick: RowGather, readable: bool, streams: bool = True) -> Access:
    sharded = opts.placement.devices is not None and len(opts.placement.devices) > 1
    return Access(opts.model.torch_device.type == "cuda", readable, pick.kernel_ok, sharded, streams)


def _guessed_rows(opts: Options, spec) -> int:
    """The most rows (a token for each of --max-seqs sequences) a static pass guesses ahead for, the ring sized
    for them: as many as a GPU pass holds (DecodeStep.each: the tuning's max_tokens), fewer than
    --stream-min-batch, and picking fewer experts than a layer has (else the layer uploads or gathers whole).
    At least one: a one-token step guesses wherever it can."""
    most = min(opts.serving.n_seqs, opts.streaming.stream_min_batch - 1, (spec.n_expert - 1) // spec.n_expert_used)
    if opts.model.torch_device.type == "cuda":
        most = min(most, tuning.current().max_tokens)
    return max(1, most)


def _footprint(
    spec,
    state_bytes: int,
    opts: Options,
    dense_bytes: int,
    tensors: dict,
    decode: DecodePlan,
    rows: int,
    n_ctx: int,
    ubatch: int,
) -> Footprint:
    """Device bytes besides the resident experts and staging slots, the guesses' ring for passes of up to rows
    rows where decode plans one, for a context of n_ctx positions and micro-batches of ubatch tokens."""
    dtype = opts.model.torch_dtype
    n_guess, n_used = decode.n_guess, spec.n_expert_used
    ring = ring_bytes(tensors, tensors, n_guess, n_used, rows, decode.ahead) if decode.guesses else 0
    kv_types = dict(zip(("type_k", "type_v"), opts.model.kv_types, strict=True))
    stacks = 3 if opts.streaming.keeps_dequantized(n_ctx, ubatch) else 1
    return Footprint(
        dense=dense_bytes,
        kv_cache=opts.serving.n_seqs * (kv_cache_bytes(spec, n_ctx, dtype, **kv_types) + state_bytes),
        workspace=workspace_bytes(spec, ubatch, n_ctx, dtype, opts.model.torch_device.type, stacks),
        prefetch=ring,
    )


def _serve(
    stored: ExpertBytes,
    decode: DecodePlan,
    placement: Placement,
    fp: Footprint,
    budget: int | None,
    spec,
    rows: int,
    n_seqs: int,
) -> tuple[LayerExperts, Footprint]:
    """The decode side the plan asks for: where static steps guess ahead, the ring of guesses (for passes of up
    to rows rows) and an expert cache as large as asked or as the budget leaves (auto: larger while the n_seqs
    sequences' KV caches hold less than their budget). Returns it and the footprint with the cache counted."""
    on_cpu = decode.on_cpu(placement.streamed)
    gathered = [il for il in placement.streamed if il not in on_cpu]  # the others compute on the CPU
    if not decode.guesses or not gathered:
        return LayerExperts(stored, decode), fp
    sizes = [stored.tensors[il].expert_bytes for il in gathered]
    rows_for = cache_rows(decode.expert_cache, placement, fp, budget, sizes, spec.n_expert)
    device, streamed, n_rows = stored.dev.device, gathered, rows_for(fp.kv_cache // n_seqs)  # beside one full
    cache = None
    if n_rows:
        cache = ExpertCache(stored.tensors, streamed, n_rows, device, stored.pick, decode.cache_policy, rows_for)
    # the budget counts the cache as it is beside every sequence's whole KV cache
    fp = replace(fp, expert_cache=cache.nbytes // cache.n * rows_for(fp.kv_cache) if cache is not None else 0)
    n_used = spec.n_expert_used
    prefetcher = Prefetcher(
        stored.tensors, streamed, decode.n_guess, n_used, stored.dev, stored.pick, cache, rows, decode.ahead
    )
    return LayerExperts(stored, decode, prefetcher), fp


def _sharded(streamed: dict, spec, opts: Options, devs: list, bounce: bool) -> ShardedStreamer:
    """One ring a device, each carrying its range of every streamed layer's experts (--devices, --tensor-split)."""
    ranges = expert_ranges(spec.n_expert, opts.placement.tensor_split)
    rings = [
        Streamer(
            d,
            {il: shard_layer(layer, lo, hi) for il, layer in streamed.items()},
            opts.streaming.stream,
            opts.streaming.slots,
            bounce,
        )
        for d, (lo, hi) in zip(devs, ranges, strict=True)
    ]
    return ShardedStreamer(rings, ranges)
