"""The streamer: a ring of K staging slots on the device, filled on the copy stream ahead of compute.

Protocol per slot: the copy stream waits on the slot's `free` event before overwriting it and records
`ready` when the upload is done; compute waits on `ready` and records `free` once its last kernel that reads
the slot is queued. The engine hands over the order in which streamed layers will be visited, so uploads run
up to K-1 visits ahead.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError
from moestream.offload.device import Device
from moestream.offload.host import BounceRing
from moestream.options import Schedule
from moestream.profiling.timeline import NULL

ALIGN = 256  # bytes between tensors inside a slot


@dataclass
class HostLayer:
    """A streamed layer's expert tensors as CPU byte tensors (views of the map) and their stored shapes."""

    parts: list[torch.Tensor]  # uint8, each [..., row_bytes]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(p.numel()) for p in self.parts)


def _resolved(ready):
    """A slot's `ready`: an event, or (bounce staging) a future that yields the event once the DMA is queued."""
    return ready.result() if isinstance(ready, Future) else ready


def _failed(ready) -> bool:
    """A staging future that raised: nothing of that upload is in flight."""
    return isinstance(ready, Future) and ready.done() and ready.exception() is not None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Slot:
    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.layer: int | None = None
        self.ready = None  # event: upload done
        self.free = None  # event: compute done reading


class Streamer:
    """Uploads streamed layers' expert bytes into staging slots, overlapped (or not) with compute.

    Serial and pinned schedules queue each copy on the compute stream, into one slot.
    """

    def __init__(self, dev: Device, layers: dict[int, HostLayer], schedule: Schedule, slots: int, bounce: bool = False):
        """slots: --slots, of which the schedule allocates `schedule.staging_slots(slots)` (as placement budgets);
        bounce: the host bytes are not page-locked; stage each upload through a pinned buffer per slot."""
        self.dev = dev
        self.layers = layers
        self.overlap = schedule.overlaps
        slot_bytes = max((layer.nbytes for layer in layers.values()), default=0)
        n_slots = max(1, min(schedule.staging_slots(slots), len(layers)))  # more slots than layers hold nothing
        self.slots = [_Slot(slot_bytes, dev.device) for _ in range(n_slots)]
        self.bounce = BounceRing(n_slots, slot_bytes) if bounce else None
        self.next_slot = 0
        self.visits: deque[int] = deque()
        self.current: _Slot | None = None
        self.bytes_uploaded = 0
        self.uploads = 0
        self.timeline = NULL

    def begin(self, visits: list[int]) -> None:
        """The streamed layers compute will ask for, in order; uploads start right away."""
        self.finish()
        self.visits = deque(visits)
        self.prefetch()

    def acquire(self, il: int) -> list[torch.Tensor]:
        """The layer's expert bytes on the device; compute may use them until the next acquire or finish."""
        if self.current is not None and self.current.layer == il:
            return self._views(self.current)
        self.finish()
        if not self.visits or self.visits[0] != il:
            raise MoestreamError(f"internal: layer {il} was not the next streamed visit ({list(self.visits)[:3]})")
        slot = next((s for s in self.slots if s.layer == il and s.ready is not None), None) or self._upload(il)
        if slot is None:
            raise MoestreamError("internal: no free staging slot")
        self.visits.popleft()
        self._wait_ready(slot)
        self.current = slot
        self.prefetch()  # nothing to do when release() already queued this window
        return self._views(slot)

    def held(self, il: int) -> list[torch.Tensor] | None:
        """Layer il's bytes if a slot already holds all of them (say a layer-major tail chunk), else None."""
        if self.current is not None and self.current.layer == il:
            return self._views(self.current)
        slot = next((s for s in self.slots if s.layer == il and s.ready is not None), None)
        if slot is None:
            return None
        self.finish()
        self._wait_ready(slot)
        self.current = slot
        return self._views(slot)

    def upload_experts(self, il: int, experts: list[int]) -> list[torch.Tensor] | None:
        """Just the given experts (sorted ids) of layer il, for a small batch outside the visit plan.

        Runs of consecutive ids go up as one copy each. Uses a slot no planned visit needs; None if there is
        none (the caller computes elsewhere). The slot stays in use until the next acquire or finish."""
        self.finish()
        slot = self._free_slot(len(self.visits))
        if slot is None:
            return None
        runs, start = [], 0
        for k in range(1, len(experts) + 1):
            if k == len(experts) or experts[k] != experts[k - 1] + 1:
                runs.append((start, experts[start], experts[k - 1] + 1))
                start = k
        if slot.ready is not None and not _failed(slot.ready):
            _resolved(slot.ready)  # a staged upload into this slot is queued before ours (streams run in order)
        slot.layer = slot.ready = None
        pairs, views, off = [], [], 0
        for part in self.layers[il].parts:
            size = len(experts) * part[0].numel()
            view = slot.buf[off : off + size].view(len(experts), *part.shape[1:])
            pairs += [(view[at : at + b - a], part[a:b]) for at, a, b in runs]
            views.append(view)
            off += _aligned(size)
        ready = self.dev.copy(pairs, slot.free, self.overlap, self.timeline, layer=il)
        self.bytes_uploaded += sum(src.numel() for _, src in pairs)
        slot.ready, slot.layer = ready, None  # partial contents: never matched by a visit
        self.dev.wait(ready)
        self.current = slot
        return views

    def finish(self) -> None:
        """Compute is done queuing work on the current slot: the copy stream may overwrite it after that."""
        if self.current is not None:
            self.current.free = self.dev.record()
            if not self.overlap:
                self.current.layer = None
            self.current = None

    def forget(self) -> None:
        """Drop every slot's events and contents: a failed CUDA graph capture recorded events that never ran
        (waiting on one is an error), so the slots are taken as empty after the device has drained."""
        self.dev.synchronize()
        for s in self.slots:
            s.layer = s.ready = s.free = None
        self.current = None

    def release(self, il: int) -> None:
        """Compute has moved on to layer il: a slot holding another layer is read no more, so free it now
        rather than at the next streamed layer, and queue the next upload behind it (with resident layers
        between streamed ones, that is a layer's compute earlier)."""
        if self.current is not None and self.current.layer != il:
            self.finish()
            self.prefetch()

    def prefetch(self) -> None:
        """Start uploads for the next visits, as many as there are slots besides the one in use."""
        if not self.overlap:
            return
        for ahead, il in enumerate(list(self.visits)[: len(self.slots) - (self.current is not None)]):
            if not any(s.layer == il for s in self.slots) and self._upload(il, ahead) is None:
                break

    def _free_slot(self, ahead: int) -> _Slot | None:
        """The next slot in ring order that compute is not using and that no visit before `ahead` still needs.

        A layer wanted only later may be evicted: the nearer visit's upload matters more."""
        needed = set(list(self.visits)[:ahead])
        for k in range(len(self.slots)):
            s = self.slots[(self.next_slot + k) % len(self.slots)]
            if s is not self.current and (s.layer is None or s.layer not in needed):
                self.next_slot = (self.next_slot + k + 1) % len(self.slots)
                return s
        return None

    def _upload(self, il: int, ahead: int = 0) -> _Slot | None:
        """Queue layer il's bytes into a free slot (None if every slot is still needed)."""
        slot = self._free_slot(ahead)
        if slot is None:
            return None
        layer = self.layers[il]
        index, previous, after = self.slots.index(slot), slot.ready, slot.free
        slot.layer = slot.ready = None  # until every copy is queued, the slot holds nothing usable

        def upload(src: list[torch.Tensor], dst: list[torch.Tensor]):
            pairs = list(zip(dst, src, strict=True))
            return self.dev.copy(pairs, after, self.overlap, self.timeline, layer=il, slot=index)

        if self.bounce is None:
            slot.ready = upload(layer.parts, self._views_for_buf(slot.buf, layer))
        else:  # stage into this slot's pinned buffer on the CPU threads, then one DMA; compute goes on meanwhile
            staged, tl = self.bounce.buffers[index], self.timeline

            def stage():
                with torch.inference_mode():  # thread-local: slot buffers may be inference tensors
                    if previous is not None and not _failed(previous):
                        _resolved(previous).synchronize()  # the last DMA out of this bounce buffer is done
                    start = tl.host_stamp()
                    self.bounce.fill(self._views_for_buf(staged, layer), layer.parts)
                    tl.add("cpu-copy-0", "stage", start, tl.host_stamp(), layer=il, nbytes=layer.nbytes)
                    return upload([staged[: layer.nbytes]], [slot.buf[: layer.nbytes]])

            slot.ready = self.bounce.stager.submit(stage)
        slot.layer = il
        self.bytes_uploaded += sum(p.numel() for p in layer.parts)
        self.uploads += 1
        return slot

    def _wait_ready(self, slot: _Slot) -> None:
        """Compute waits for the slot's upload; a failed upload empties the slot before the error goes up."""
        try:
            ready = _resolved(slot.ready)
        except BaseException:
            slot.layer = slot.ready = None
            raise
        self.dev.wait(ready)

    def close(self) -> None:
        self.finish()
        if self.bounce is not None:
            self.bounce.close()

    def _views(self, slot: _Slot) -> list[torch.Tensor]:
        return self._views_for_buf(slot.buf, self.layers[slot.layer])

    @staticmethod
    def _views_for_buf(buf: torch.Tensor, layer: HostLayer) -> list[torch.Tensor]:
        """Each expert tensor's place in a slot-sized buffer: one after another, 256-byte aligned."""
        out, off = [], 0
        for p in layer.parts:
            out.append(buf[off : off + p.numel()].view(p.shape))
            off += _aligned(p.numel())
        return out
