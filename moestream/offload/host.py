"""Host memory for streamed experts: page-lock the mapped file's byte ranges in place, no second copy.

cudaHostRegister with the read-only flag works on a read-only file mapping (the mapped flag alone is
refused); DMA from a registered range runs at the pinned link rate instead of the pageable one.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap as _mmap
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED, CUDA_HOST_REGISTER_READ_ONLY = 0x01, 0x02, 0x08
# Mapped: kernels may read the pages at their host address (kernels/gather.py); if a driver refuses that
# for file pages, the read-only flag alone still gives page-locked DMA.
REGISTER_FLAGS = (
    CUDA_HOST_REGISTER_READ_ONLY | CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_PORTABLE,
    CUDA_HOST_REGISTER_READ_ONLY,
)
PAGE = _mmap.PAGESIZE


class PinnedRanges:
    """Registers page-aligned ranges of a mapped file with CUDA; unregister() before the map closes."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # (address, size) registered

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.ranges)

    def register(self, arrays: list[np.ndarray], warn: bool = True) -> bool:
        """Page-lock the pages under each array (merged into runs). False, with one warning (if warn), if refused.

        Whole pages: memory sharing them is locked too, and CUDA refuses a copy that starts inside a locked
        range and runs past it. The model's tensors are pages of the file's own mapping; other memory given
        here should have pages of its own."""
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
        merged: list[list[int]] = []
        for start, end in spans:
            start, end = start - start % PAGE, -(-end // PAGE) * PAGE
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        cudart = torch.cuda.cudart()
        for start, end in merged:
            for flags in REGISTER_FLAGS:
                err = cudart.cudaHostRegister(start, end - start, flags)
                if int(err) == 0:
                    break
                _clear_cuda_error()
            if int(err) != 0:
                if warn:
                    warnings.warn(
                        f"page-locking {end - start} bytes of the model file was refused (CUDA error {int(err)}); "
                        "falling back to pinned bounce buffers (slower). Raise the locked-memory limit "
                        "(ulimit -l) or free RAM to restore full link speed.",
                        stacklevel=2,
                    )
                self.unregister()
                return False
            self.ranges.append((start, end - start))
        return True

    def unregister(self) -> None:
        cudart = torch.cuda.cudart() if self.ranges else None
        for start, _ in self.ranges:
            cudart.cudaHostUnregister(ctypes.c_void_p(start).value)
        self.ranges.clear()


LOCK_AT_LEAST = 1 << 20  # bytes below which a pageable copy costs less than locking and unlocking the pages


@contextlib.contextmanager
def locked_for_upload(arrays: list[np.ndarray], device: torch.device) -> Iterator[bool]:
    """The pages under arrays page-locked in place while the block uploads them: DMA at the pinned link rate, ~7x
    the pageable one (docs/benchmarks.md), unlocked once the device has read them (callers lock a layer or a
    tensor at a time: RAM need not hold the whole file locked). Yields whether they are locked (copies may then be
    non-blocking); where CUDA refuses, they upload pageable, as before, without a word."""
    pins = PinnedRanges()
    big = sum(a.nbytes for a in arrays) >= LOCK_AT_LEAST
    locked = device.type == "cuda" and big and pins.register(arrays, warn=False)
    try:
        yield locked
    finally:
        if locked:
            torch.cuda.synchronize(device)  # the copies read those pages until they end
            pins.unregister()


def _clear_cuda_error() -> None:
    """A refused cudaHostRegister leaves a sticky 'last error' that torch would report at its next launch;
    read it off through the CUDA runtime torch itself loaded."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()


class BounceRing:
    """Fallback when registration is refused: one pinned buffer per staging slot, filled by CPU threads.

    Staging runs on its own thread (in upload order), so compute keeps queuing kernels meanwhile; each copy is
    split over a few threads, since one memcpy thread moves far less than the link."""

    def __init__(self, n_buffers: int, nbytes: int, copy_threads: int = 8):
        pin = torch.cuda.is_available()  # the CPU device (tests) has nothing to pin to
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(n_buffers)]
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="moestream-stage")
        self.copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="moestream-stage-copy")

    def fill(self, views: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
        """views[i] <- parts[i], in chunks on the copy threads (numpy: no torch thread pools off the main thread)."""
        jobs = []
        for view, part in zip(views, parts, strict=True):
            dst, src = view.numpy().reshape(-1), part.numpy().reshape(-1)
            step = max(1 << 22, -(-src.size // 8))
            jobs += [(dst[a : a + step], src[a : a + step]) for a in range(0, src.size, step)]
        list(self.copiers.map(lambda job: np.copyto(*job), jobs))

    def close(self) -> None:
        self.stager.shutdown(wait=True)
        self.copiers.shutdown(wait=True)
