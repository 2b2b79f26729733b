"""The first GGML quants: blocks of 32 with one fp16 scale (and an fp16 offset in the _1 types)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import f16, split_bits


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return split_bits(qs, 4, 2).reshape(qs.shape[0], 32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> 32 bits, bit j belonging to element j."""
    return split_bits(qh, 1, 8).transpose(1, 2).reshape(qh.shape[0], 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """Q8_0 (34 B / 32): d f16, qs int8[32]; x = q * d."""
    q = b[:, 2:].view(torch.int8).to(torch.float32)
    return q.mul_(f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """Q4_0 (18 B / 32): d f16, qs[16] nibbles; x = d * (q - 8)."""
    q = (_nibbles32(b[:, 2:18]).view(torch.int8) - 8).to(torch.float32)
    return q.mul_(f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """Q4_1 (20 B / 32): d f16, m f16, qs[16] nibbles; x = d * q + m."""
    q = _nibbles32(b[:, 4:20]).to(torch.float32)
    return q.mul_(f16(b, 0)).add_(f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """Q5_0 (22 B / 32): d f16, qh[4] fifth bits, qs[16] nibbles; x = d * (q - 16)."""
    q = _nibbles32(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)
    return (q.view(torch.int8) - 16).to(torch.float32).mul_(f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """Q5_1 (24 B / 32): d f16, m f16, qh[4] fifth bits, qs[16] nibbles; x = d * q + m."""
    q = (_nibbles32(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4)).to(torch.float32)
    return q.mul_(f16(b, 0)).add_(f16(b, 2))


REFERENCES = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
}
