"""Pick experts' stored bytes out of a host tensor on the GPU, reading page-locked memory directly.

For small batches (decode) the host normally has to learn which experts the router chose (a sync per
streamed layer) before it can queue their copies. On a system with unified addressing, memory registered
with cudaHostRegister is readable from kernels at its host address, so one kernel can read the chosen
experts over PCIe itself, with the ids still on the GPU: no sync, and the host keeps queuing ahead.
If the kernel cannot read the memory (not registered, or no Triton), the picks go through the host.
"""

from __future__ import annotations

import warnings

import torch

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:
    triton = None

WORDS_PER_PROGRAM = 2048

if triton is not None:

    @triton.jit
    def _gather_kernel(src, ids, dst, row_words, WORDS: tl.constexpr):
        r = tl.program_id(0)  # which pick
        w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        ok = w < row_words
        row = tl.load(ids + r).to(tl.int64)
        tl.store(dst + r.to(tl.int64) * row_words + w, tl.load(src + row * row_words + w, mask=ok), mask=ok)


def available() -> bool:
    """Whether the kernel exists here (Triton present); whether it can read this host memory shows on first use."""
    return triton is not None


class RowGather:
    """Picks rows of stored bytes onto the rows' device: by the kernel, until it fails once; from then on this
    picker goes through the host without trying again (its owner's state: other engines are not affected)."""

    def __init__(self) -> None:
        self.kernel_failed = False  # the kernel could not read host memory here: later calls skip it

    @property
    def kernel_ok(self) -> bool:
        """Whether the kernel may read host memory (Triton present, no failed attempt by this picker)."""
        return available() and not self.kernel_failed

    def __call__(self, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """src[rows] on rows' device. src [N, ...] holds stored bytes (uint8, any device); rows [n] int64."""
        if src.device == rows.device:
            return src[rows]
        flat = src.reshape(src.shape[0], -1) if src.is_contiguous() else None  # a view, never a copy
        usable = self.kernel_ok and rows.is_cuda and not src.is_cuda and src.dtype == torch.uint8 and flat is not None
        if usable and flat.shape[1] % 4 == 0 and flat.data_ptr() % 4 == 0:
            row_bytes = flat.shape[1]
            out = torch.empty((rows.numel(), row_bytes), dtype=torch.uint8, device=rows.device)
            words = row_bytes // 4
            try:
                with torch.cuda.device(rows.device):
                    _gather_kernel[(rows.numel(), triton.cdiv(words, WORDS_PER_PROGRAM))](
                        flat.view(torch.int32), rows, out.view(torch.int32), words, WORDS=WORDS_PER_PROGRAM
                    )
                return out.view(rows.numel(), *src.shape[1:])
            except Exception as e:  # say it once, then pick through the host
                self.kernel_failed = True
                warnings.warn(
                    f"reading host memory from the GPU failed ({e}); experts are picked on the host", stacklevel=2
                )
        return src[rows.cpu()].to(rows.device)  # through the host: a sync on the ids
