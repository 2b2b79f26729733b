"""Microscaling (OCP MX) types: blocks of 32 4-bit floats sharing one power-of-two scale."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import split_bits

# The E2M1 values doubled, by code (bit 3 the sign): the scale is halved to match, as ggml stores them
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Half of the E8M0 scale 2**(e - 127), as float32: 2**(e - 128), a subnormal for e 0 and 1."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """MXFP4 (17 B / 32): e E8M0, qs[16] E2M1 codes (low nibbles elements 0..15, high 16..31)."""
    codes = split_bits(b[:, 1:17], 4, 2).reshape(b.shape[0], 32)
    values = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=b.device)[codes.long()]
    return values.mul_(e8m0_half(b[:, 0:1]))


REFERENCES = {
    Q.MXFP4: _mxfp4,
}
