"""Where the MoE layer gets its experts. The model asks for layer L's stored experts; this module decides
whether the bytes are already on the device (resident), arrive through the streamer (streamed), are gathered
from the page-locked map (a small batch's picks, guessed ahead or not), or whether the few experts a small
batch needs are cheaper to compute on the CPU straight from the map, and hands the model a `StoredExperts`
its MoE multiplies (`ops/experts.py`). The same bytes reach the same math, so resident and streamed layers give
the same bits for the same micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestream.kernels import host_swiglu, matvec
from moestream.kernels.gather import RowGather, first_picks
from moestream.kernels.grouped_moe import runs_on_device
from moestream.offload.counters import Counters
from moestream.offload.device import Device
from moestream.offload.expert_tensors import ExpertTensors
from moestream.offload.prefetch import Prefetcher
from moestream.offload.shards import ShardedLayer, ShardedStreamer
from moestream.offload.small_batch import DecodePlan
from moestream.offload.streamer import Streamer
from moestream.ops.experts import StoredExperts
from moestream.ops.moe_swiglu import expert_counts
from moestream.options import SmallBatch
from moestream.profiling.timeline import NULL, Timeline

OnRoute = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, its MoE input x [T, D], ids [T, K])


def _matvec_serves(t: ExpertTensors, device: torch.device, n_tokens: int) -> bool:
    """A token or few on a GPU: the experts multiply straight from their stored blocks."""
    return all(matvec.usable(v.qtype, device, n_tokens) for v in t.views)


@dataclass(frozen=True)
class ExpertBytes:
    """Where a placement put each layer's expert bytes: resident stacks on the compute device, streamed ones
    in host memory behind the streamer; pick: the engine's expert picker (after its kernel failed once it picks
    through the host, for every placement the engine builds)."""

    tensors: dict[int, ExpertTensors]
    resident: dict[int, list[torch.Tensor]]
    streamer: Streamer | ShardedStreamer | None
    dev: Device
    dtype: torch.dtype
    pick: RowGather


class LayerExperts:
    """Where each layer's experts come from: resident layers, streamed layers, and for micro-batches under
    plan.min_batch what the decode plan says. Models reach it through the ExpertPass of the pass they run in;
    what it moves is counted in `counters`."""

    def __init__(self, stored: ExpertBytes, plan: DecodePlan, prefetcher: Prefetcher | None = None):
        self.stored = stored
        self.tensors, self.resident, self.streamer = stored.tensors, stored.resident, stored.streamer
        self.dev, self.dtype, self.pick = stored.dev, stored.dtype, stored.pick
        self.plan = plan
        self.on_cpu = plan.on_cpu([il for il in sorted(self.tensors) if il not in self.resident])
        self.prefetcher = prefetcher  # gathered layers' experts guessed ahead (--prefetch, --prefetch-ahead)
        self.counters = Counters.of(self.streamer, prefetcher is not None, self.dev.device)

    def begin(
        self,
        visits: list[int],
        static: bool = False,
        timeline: Timeline = NULL,
        on_route: OnRoute | None = None,
        keep_dequantized: bool = False,
    ) -> ExpertPass:
        """A pass over the layers starts: the streamed layers it will visit, in order (uploads start now).
        keep_dequantized: a layer's whole stacks, once dequantized, serve all its micro-batches (layer-major)."""
        if self.streamer is not None:
            self.streamer.begin(visits)
        return ExpertPass(self, static, timeline, on_route, keep_dequantized)

    def record(self, timeline: Timeline) -> None:
        """Send the streamer's copy spans to timeline (compute spans go to each pass's)."""
        if self.streamer is not None:
            self.streamer.timeline = timeline

    @property
    def gathers(self) -> bool:
        """Small batches gather their experts as planned; not once the gather kernel failed on a GPU (then
        they take the upload way, picking through the host)."""
        return self.plan.gathers and (not self.plan.access.on_gpu or self.pick.kernel_ok)

    def guess_plan(self, n_tokens: int, static: bool) -> dict[int, list[int]]:
        """For a pass of n_tokens (a token for each of that many sequences): {layer at whose start (-1: before
        layer 0) to call prefetch(): the gathered layers to guess, in order}. Empty unless a static pass of at most the
        rows the prefetcher's ring holds, gathered, prefetch on."""
        p = self.prefetcher
        if p is None or not static or n_tokens > p.rows or n_tokens >= self.plan.min_batch:
            return {}  # a batch of min_batch tokens uploads whole layers
        if n_tokens * p.n_used >= p.n_expert or not self.gathers:
            return {}  # as many picks as experts: the layer gathers whole
        return p.schedule()

    @property
    def guess_width(self) -> int:
        """How many experts a guess names (--prefetch)."""
        return self.prefetcher.n_guess if self.prefetcher is not None else 0

    @property
    def guess_ahead(self) -> int:
        """How many streamed layers before its own a layer's guess is made (--prefetch-ahead; 0: no guesses)."""
        return self.prefetcher.ahead if self.prefetcher is not None else 0

    @property
    def cached_width(self) -> int:
        """How many experts of each streamed layer the expert cache holds (--expert-cache)."""
        p = self.prefetcher
        return p.cache.n if p is not None and p.cache is not None else 0

    def prefetch(self, il: int, guess: torch.Tensor, timeline: Timeline = NULL) -> None:
        """Start gathering layer il's experts guess [R, G] names (each row's), beside compute (no host sync);
        nothing once the gather kernel has failed (the layer then picks through the host)."""
        if self.gathers:
            self.prefetcher.prefetch(il, guess, self.counters, timeline)

    def streams(self, il: int, n_tokens: int) -> bool:
        """Whether a micro-batch of n_tokens makes the streamer upload layer il (a layer without experts: no)."""
        return il in self.tensors and il not in self.resident and n_tokens >= self.plan.min_batch

    def capturable(self, n_tokens: int, n_expert_used: int) -> bool:
        """Whether a static pass of n_tokens queues the same device work every time, with no host sync:
        the expert products run on the device (matvecs, or grouped matmuls), and streamed layers (if any) read
        their experts there or run them on the CPU as a host function in the stream."""
        t = next(iter(self.tensors.values()))
        _, n_ff, n_embd = t.views[0].shape
        dev = self.dev.device
        if not _matvec_serves(t, dev, n_tokens) and not runs_on_device(dev, self.dtype, n_ff, n_embd):
            return False
        if len(self.resident) == len(self.tensors):
            return True
        if n_tokens >= self.plan.min_batch:
            return False
        if self.on_cpu and not host_swiglu.usable([v.qtype for v in t.views], dev):
            return False  # the CPU's layers run as a host function in the stream
        return self.plan.way is SmallBatch.CPU or (self.gathers and n_tokens * n_expert_used < t.n_expert)

    def weights(self, p: ExpertPass, il: int, x: torch.Tensor, ids: torch.Tensor) -> StoredExperts:
        """Layer il's experts for x [T, D] routed to ids [T, K], brought where the math will read them."""
        t, tl = self.tensors[il], p.timeline
        layer, ubatch, layer_start = p.layer
        label = dict(layer=il, ubatch=ubatch) if layer == il else dict(layer=il)
        if layer == il:
            tl.add("compute", "attention", layer_start, tl.stamp(), **label)
        if il not in self.resident and x.shape[0] < self.plan.min_batch:
            return self._small_batch(p, il, t, x, ids, label)
        if il in self.resident:
            raws = self.resident[il]
        else:
            if self.counters.usage is not None:  # stays on the device: no sync
                self.counters.usage.append((expert_counts(ids.reshape(-1), t.n_expert) > 0).float().mean())
            raws = self.streamer.acquire(il)  # the compute stream now waits for the upload
        p.open_span("experts", label)
        return self._on_device(tl, il, t, raws, x, ids, kept=p.kept)

    def _on_device(self, tl: Timeline, il: int, t: ExpertTensors, raws, x, ids, first=None, kept=None) -> StoredExperts:
        """raws on x's device (or, gathered, page-locked host memory the GPU reads), ids indexing their rows;
        first: the picks' first_picks, where they are gathered; kept: the pass's whole dequantized stacks of
        layer il, to reuse and fill (None: each made anew)."""
        self.dev.compute()  # injected slowness on the CPU device; nothing on a GPU
        if isinstance(raws, ShardedLayer):  # --devices: each range of experts on its own device
            parts = tuple((lo, hi, t.stored(r, ids, self.dtype, tl, il, self.pick)) for lo, hi, r in raws.parts)
            return t.stored((), ids, self.dtype, tl, il, self.pick, parts=parts)
        if not raws[0].is_cuda and _matvec_serves(t, x.device, x.shape[0]):
            # page-locked host memory: bring the chosen experts over first (whole experts move at link speed;
            # a matvec reading the host in short runs does not)
            picks = ids.reshape(-1)
            first = first_picks(picks) if first is None else first
            raws = [self.pick(raw, picks, first=first) for raw in raws]
            ids = first.view_as(ids)  # a pick's row: its expert's first pick's
        return t.stored(raws, ids, self.dtype, tl, il, self.pick, kept=kept)

    def _small_batch(self, p: ExpertPass, il: int, t: ExpertTensors, x, ids, label: dict) -> StoredExperts:
        """A streamed layer for a few tokens, as the plan says: gather the experts they chose with a kernel
        reading host memory (no sync), upload only those (a sync to learn which), or leave them to the CPU
        straight from the map (moving a few rows of x instead of weights)."""
        tl = p.timeline
        whole = None if p.static else self.streamer.held(il)
        if whole is not None:
            p.open_span("experts", label)
            return self._on_device(tl, il, t, whole, x, ids)
        if il in self.on_cpu:
            p.open_span("experts-cpu", label)
            return t.stored(t.host_bytes(), ids, torch.float32, tl, il, self.pick, on_host=True)
        if self.gathers and ids.numel() < t.n_expert:
            p.open_span("experts-gather", label)  # no sync: ids stay on the device
            if self.prefetcher is not None and il in self.prefetcher.pending:  # misses counted on the device
                rows, at = self.prefetcher.take(il, ids, self.counters)
                return self._on_device(tl, il, t, rows, x, at)
            first = first_picks(ids.reshape(-1))  # each expert read once for all the rows that picked it
            self.counters.add_gathered(first, t.expert_bytes)
            return self._on_device(tl, il, t, t.host_bytes(), x, ids, first)
        used = torch.unique(ids.cpu())  # sync: the host must know which experts to move or read
        local = torch.full((t.n_expert,), -1, dtype=torch.long)
        local[used] = torch.arange(used.numel())  # expert id -> its row among the chosen ones
        views = self.streamer.upload_experts(il, used.tolist())
        if views is not None:
            stored = self._on_device(tl, il, t, views, x, local.to(x.device)[ids])
            p.open_span("experts", label)
            return stored
        p.open_span("experts-cpu", label)
        return t.stored(t.host_bytes(), ids, torch.float32, tl, il, self.pick, on_host=True)

    def forget(self) -> None:
        """A graph capture failed: the streamer's and the prefetcher's events recorded in it never ran."""
        if self.streamer is not None:
            self.streamer.forget()
        if self.prefetcher is not None:
            self.prefetcher.forget()

    def end_pass(self) -> None:
        """Compute has queued its last use of the current staging slot."""
        try:
            if self.prefetcher is not None:
                self.prefetcher.drop()  # a pass that stopped half-way leaves guesses nobody takes
                if self.prefetcher.cache is not None:
                    self.counters.read_bytes += self.prefetcher.cache.end_pass()
        finally:
            if self.streamer is not None:
                self.streamer.finish()


class ExpertPass:
    """One pass over the layers (a prefill, a decode step), made by the engine through LayerExperts.begin and
    handed to model.layer like the cache: the model's MoE asks it for each layer's routed experts.

    static: a pass whose device work must be the same every time (a decode step that may be captured in a
    CUDA graph): every streamed layer reads its experts the same way whatever the staging slots hold."""

    def __init__(
        self,
        source: LayerExperts,
        static: bool,
        timeline: Timeline,
        on_route: OnRoute | None = None,
        keep_dequantized: bool = False,
    ):
        self.source, self.static, self.timeline = source, static, timeline
        self.on_route = on_route  # sees each layer's input and routing (a counter, a test's probe)
        # the current layer's whole stacks dequantized, by stack index, while its micro-batches run
        self.kept: dict[int, torch.Tensor] | None = {} if keep_dequantized else None
        self.layer: tuple[int, int, object] = (-1, -1, None)  # (layer, micro-batch, stamp) the engine started
        self._span: tuple[str, object, dict] | None = None  # the experts span open until the next layer starts

    def start_layer(self, il: int, ubatch: int) -> None:
        """The engine begins layer il of a micro-batch: attention and router run from here to weights()."""
        self.layers_done()
        if self.kept and il != self.layer[0]:
            self.kept.clear()  # the layer before's stacks: no micro-batch needs them again
        if self.source.streamer is not None:
            self.source.streamer.release(il)
        self.layer = (il, ubatch, self.timeline.stamp())

    def weights(self, il: int, x: torch.Tensor, ids: torch.Tensor) -> StoredExperts:
        """Layer il's stored experts for x [T, D] routed to ids [T, K]: the ExpertSource models call. The
        model's MoE math that follows is timed as the layer's experts span, up to the next layer's start."""
        if self.on_route is not None:
            self.on_route(il, x, ids)
        return self.source.weights(self, il, x, ids)

    def open_span(self, name: str, label: dict) -> None:
        self._span = (name, self.timeline.stamp(), label)

    def layers_done(self) -> None:
        """The last layer's MoE is queued: its span ends here (start_layer ends the ones before)."""
        if self._span is not None:
            name, start, label = self._span
            self.timeline.add("compute", name, start, self.timeline.stamp(), **label)
            self._span = None

    def guess_plan(self, n_tokens: int) -> dict[int, list[int]]:
        return self.source.guess_plan(n_tokens, self.static)

    def prefetch(self, il: int, guess: torch.Tensor) -> None:
        self.source.prefetch(il, guess, self.timeline)

    def end(self) -> None:
        """Compute has queued its last use of the current staging slot."""
        self.layers_done()
        if self.kept:
            self.kept.clear()
        self.source.end_pass()
