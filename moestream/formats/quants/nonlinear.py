"""The non-linear 4-bit types: each nibble names one of 16 fixed values (finer near zero), times a scale."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import f16, split_bits

# The 16 values a nibble names, in ggml's order
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _values(codes: torch.Tensor) -> torch.Tensor:
    """Nibbles -> IQ4_VALUES, as float32."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """IQ4_NL (18 B / 32): d f16, qs[16] nibbles (low: elements 0..15, high: 16..31); x = d * value."""
    codes = split_bits(b[:, 2:18], 4, 2).reshape(b.shape[0], 32)
    return _values(codes).mul_(f16(b, 0))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS (136 B / 256): d f16, scales_h u16 (2 bits a sub-block), scales_l[4] (4 bits a sub-block),
    qs[128]; 8 sub-blocks of 32 laid out as IQ4_NL's, each x = d * (6-bit scale - 32) * value."""
    n = b.shape[0]
    low = split_bits(b[:, 4:8], 4, 2).transpose(1, 2).reshape(n, 8)  # sub-block i: nibble i % 2 of byte i // 2
    high = split_bits(b[:, 2:4], 2, 4).transpose(1, 2).reshape(n, 8)  # bits 2 i of the u16
    dl = (f16(b, 0) * ((low | (high << 4)).to(torch.float32) - 32)).reshape(n, 8, 1)
    codes = split_bits(b[:, 8:136].reshape(n, 8, 16), 4, 2).reshape(n, 8, 32)
    return dl.mul(_values(codes)).reshape(n, 256)


REFERENCES = {
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
}
