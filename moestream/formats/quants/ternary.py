"""The ternary types (BitNet-style): every value is -1, 0 or 1 times one fp16 scale a block of 256."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import f16, split_bits


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    """TQ1_0 (54 B / 256): qs[48] 5 trits a byte, qh[4] 4 trits a byte, d f16. Trit k of byte v is the top
    of (v * 3**k mod 256) * 3 / 256: values 32 k + l (qs[l], l < 32), 160 + 16 k + l (qs[32 + l]) and
    240 + 4 k + l (qh[l])."""
    n = b.shape[0]
    pow5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=b.device)
    parts = (
        (b[:, 0:32, None] * pow5).transpose(1, 2).reshape(n, 160),
        (b[:, 32:48, None] * pow5).transpose(1, 2).reshape(n, 80),
        (b[:, 48:52, None] * pow5[:4]).transpose(1, 2).reshape(n, 16),
    )
    q = (torch.cat(parts, dim=1).to(torch.int32) * 3 >> 8) - 1
    return q.to(torch.float32).mul_(f16(b, 52))


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    """TQ2_0 (66 B / 256): qs[64] 2-bit fields (value 128 h + 32 j + l: field j of qs[32 h + l]), d f16;
    x = d * (q - 1)."""
    n = b.shape[0]
    q = split_bits(b[:, 0:64].reshape(n, 2, 32), 2, 4).reshape(n, 256).to(torch.int32) - 1
    return q.to(torch.float32).mul_(f16(b, 64))


REFERENCES = {
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
}
