"""Copy and compute streams with events, for CUDA and for the CPU.

The streamer only speaks this interface. On CUDA it is a side stream plus CUDA events. On the CPU the
copy stream is a real worker thread and events are threading events, so the pipeline's ordering and slot
reuse run with true concurrency on machines without a GPU; delays can be injected into copies and
into compute to provoke races.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moestream.profiling.timeline import NULL, Timeline


def _nbytes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(src.numel() * src.element_size() for _, src in pairs)


class CudaDevice:
    """A dedicated copy stream beside the current (compute) stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def copy(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        after: torch.cuda.Event | None,
        on_copy_stream: bool = True,
        timeline: Timeline = NULL,
        **label,
    ) -> torch.cuda.Event:
        """Queue dst <- src for each pair, in order, once `after` has fired: one upload, one span, one event
        (the host cost per call matters in decode, which moves a few experts per layer per token)."""
        stream = self.copy_stream if on_copy_stream else torch.cuda.current_stream(self.device)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            start = timeline.stamp(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            timeline.add("copy", "upload", start, timeline.stamp(stream), nbytes=_nbytes(pairs), **label)
            done.record(stream)
        return done

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the compute stream wait for event (no host sync)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def compute(self) -> None:
        """Nothing injected on a real GPU."""

    def record(self) -> torch.cuda.Event:
        """An event on the compute stream: fires when everything queued so far has run."""
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def side(self) -> CudaSide:
        """A stream of its own for kernels queued beside compute (decode's guessed gathers)."""
        return CudaSide(self.device)

    def close(self) -> None:
        self.synchronize()


class CudaSide:
    """A stream beside compute: its work starts after what compute queued before it, and compute waits for
    it only where it records an event (CudaDevice.wait)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        """Queue the block's launches here, after everything compute queued so far (the current stream while
        in the block: timeline stamps land here too)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    @staticmethod
    def event() -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event) -> None:
        """event fires when the work queued here so far has run."""
        event.record(self.stream)


class CpuEvent:
    def __init__(self, fired: bool = False):
        self._flag = threading.Event()
        self.error: BaseException | None = None  # the failure of the copy this event ends
        if fired:
            self._flag.set()

    def set(self) -> None:
        self._flag.set()

    def synchronize(self) -> None:
        self._flag.wait()


class CpuDevice:
    """Copies run in order on a worker thread (the copy stream); compute is the calling thread.

    copy_delay_s / compute_delay_s inject slowness: each copied tensor sleeps before writing (a slow link), and each
    expert computation sleeps while it holds its slot (slow kernels).
    """

    def __init__(self, copy_delay_s: float = 0.0, compute_delay_s: float = 0.0):
        self.device = torch.device("cpu")
        self.copy_delay_s = copy_delay_s
        self.compute_delay_s = compute_delay_s
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="moestream-copy", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def copy(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        after: CpuEvent | None,
        on_copy_stream: bool = True,
        timeline: Timeline = NULL,
        **label,
    ) -> CpuEvent:
        done = CpuEvent()

        def job() -> None:
            try:
                if after is not None:
                    after.synchronize()
                    if after.error is not None:
                        raise after.error
                start = timeline.stamp()
                for dst, src in pairs:
                    if self.copy_delay_s:  # a slow link
                        time.sleep(self.copy_delay_s)
                    # numpy, not torch: a torch op here would start a second OpenMP team whose spinning
                    # threads steal the cores from compute on the main thread
                    np.copyto(dst.numpy(), src.numpy())
                timeline.add("copy", "upload", start, timeline.stamp(), nbytes=_nbytes(pairs), **label)
            except BaseException as e:  # handed to whoever waits on this copy (and to copies chained on it)
                done.error = e
            finally:
                done.set()

        if on_copy_stream:
            self._jobs.put(job)
        else:
            job()
        return done

    def wait(self, event: CpuEvent) -> None:
        event.synchronize()
        if event.error is not None:
            raise event.error

    def compute(self) -> None:
        """Injected compute time, spent where the kernels of a layer's experts run."""
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)

    def record(self) -> CpuEvent:
        return CpuEvent(fired=True)  # compute is synchronous: everything queued so far has run

    def side(self) -> CpuSide:
        return CpuSide()

    def synchronize(self) -> None:
        done = CpuEvent()
        self._jobs.put(done.set)
        done.synchronize()

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join()


class CpuSide:
    """Work "beside" compute on the CPU device runs in order on the calling thread: done when queued."""

    @contextlib.contextmanager
    def after_compute(self) -> Iterator[None]:
        yield

    @staticmethod
    def event() -> CpuEvent:
        return CpuEvent(fired=True)

    def record(self, event: CpuEvent) -> None:
        """Nothing to wait for: the work already ran."""


Device = CudaDevice | CpuDevice


class CpuMemory(TorchDispatchMode):
    """The CPU device's torch.cuda.max_memory_allocated: while active (`with CpuMemory() as m:`), every tensor
    storage an operation makes on this thread is counted until it is freed; `peak` is the most held at once.

    Storages made before, and views of them, are not counted (an output that shares an input's storage is a
    view), so `peak` is what a pass allocates on top of what was there: the placement's workspace.
    """

    def __init__(self):
        super().__init__()
        self.held = 0  # bytes of counted storages alive now
        self.peak = 0
        self._live: set[int] = set()  # data pointers of counted storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, n = storage.data_ptr(), storage.nbytes()
        if not n or ptr in inputs or ptr in self._live:
            return
        self._live.add(ptr)
        self.held += n
        self.peak = max(self.peak, self.held)
        weakref.finalize(storage, self._freed, ptr, n)

    def _freed(self, ptr: int, n: int) -> None:
        self._live.discard(ptr)
        self.held -= n


def cap_vram(device: torch.device, budget: int | None, expandable: bool = False) -> None:
    """Make a VRAM budget a real limit: the caching allocator refuses to grow past it (None lifts it).

    Under a cap, memory stranded in half-used fixed-size segments is memory lost. Expandable segments grow in
    place and leave none, at no measured cost (docs/benchmarks.md), so a cap turns them on (the placement
    options' expandable_segments: unless the user configured the allocator).
    """
    if device.type != "cuda":
        return
    if budget and expandable:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total) if budget else 1.0, index)


def make_device(device: torch.device) -> Device:
    return CudaDevice(device) if device.type == "cuda" else CpuDevice()
