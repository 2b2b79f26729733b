"""Which inputs the Triton KV row quantizer gets wrong on CUDA (inside the engine every (8, 128) float32 call
had one byte in each block wrong): shapes whose block count is or is not a multiple of 16, random and
tests/kernels' rows, and the same kernel with its block count left unspecialised; where in a block bytes differ.

    PYTHONPATH=. python scripts/kv_quant_gpu_diag.py      (on the GPU machine)
"""

from __future__ import annotations

import torch
import triton

from moestream.kernels import kv_quant
from moestream.kernels.launch import on_device

LOOSE = triton.jit(do_not_specialize=["n_blocks"])(kv_quant._quantize_kernel.fn)


def loose(x: torch.Tensor, name: str) -> torch.Tensor:
    n_blocks = x.numel() // kv_quant.BLOCK
    out = torch.empty((x.shape[0], x.shape[1] // 32 * kv_quant.BLOCK_BYTES[name]), dtype=torch.uint8, device=x.device)
    with on_device(x):
        LOOSE[(triton.cdiv(n_blocks, 16),)](
            x, out, n_blocks, KIND=kv_quant.KIND[name], BYTES=kv_quant.BLOCK_BYTES[name], BLOCKS=16
        )
    return out


def report(label: str, got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    bad = (got != want).reshape(-1, kv_quant.BLOCK_BYTES[name])
    where = bad.nonzero()[:, 1].unique().tolist()
    first = bad.any(1).nonzero()[:2].view(-1).tolist()
    blocks = [(got.view(-1, bad.shape[1])[b].tolist()[:6], want.view(-1, bad.shape[1])[b].tolist()[:6]) for b in first]
    print(
        f"{label}: {int(bad.sum())} bytes in {int(bad.any(1).sum())}/{bad.shape[0]} blocks; offsets {where[:8]}; "
        f"first blocks (got, want) {blocks}"
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    for name in ("q8_0", "q4_0"):
        for n, c, scale in ((8, 128, 1.0), (9, 128, 1.0), (8, 128, 30.0), (16, 256, 1.0), (1, 512, 1.0), (3, 64, 0.01)):
            x = (torch.randn(n, c) * scale).cuda()
            want = kv_quant.quantize_torch(x, name)
            report(f"{name} {n}x{c} x{scale} kernel", kv_quant.quantize_kernel(x, name), want, name)
            report(f"{name} {n}x{c} x{scale} unspecialised", loose(x, name), want, name)
