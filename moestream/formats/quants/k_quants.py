"""K-quants: super-blocks of 256 values in sub-blocks of 16 or 32, each with its own scale (and min)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from moestream.formats.quants.fields import f16, split_bits


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K (84 B / 256): scales[16] (4-bit scale | 4-bit min << 4), qs[64] 2-bit, d f16, dmin f16."""
    n = b.shape[0]
    scales = b[:, :16]
    dl = (f16(b, 80) * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (f16(b, 82) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = split_bits(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K (110 B / 256): hmask[32] third bits, qs[64] 2-bit, scales[12] 6-bit signed, d f16."""
    n = b.shape[0]
    low = split_bits(b[:, 96:104], 4, 2).reshape(n, 16)
    high = split_bits(b[:, 104:108], 2, 4).reshape(n, 16)
    scales = ((low | (high << 4)).view(torch.int8) - 32).to(torch.float32)
    dl = (f16(b, 108) * scales).reshape(n, 16, 1)
    ql = split_bits(b[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    # A clear mask bit subtracts 4; a set one leaves the 2-bit value as is.
    qh = split_bits(b[:, :32], 1, 8).reshape(n, 16, 16) ^ 1
    q = (ql.view(torch.int8) - (qh << 2).view(torch.int8)).to(torch.float32)
    return q.mul_(dl).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte field of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = (d * scale) * q - (dmin * min) over 8 sub-blocks of 32, shared by Q4_K and Q5_K."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (f16(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (f16(b, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    return q.to(torch.float32).mul_(d).sub_(dm).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K (144 B / 256): d f16, dmin f16, scales[12] 6-bit, qs[128] nibbles."""
    n = b.shape[0]
    return _k_affine(b, split_bits(b[:, 16:144].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q5_K (176 B / 256): d f16, dmin f16, scales[12] 6-bit, qh[32] fifth bits, qs[128] nibbles."""
    n = b.shape[0]
    ql = split_bits(b[:, 48:176].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    qh = split_bits(b[:, 16:48], 1, 8)
    return _k_affine(b, ql | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K (210 B / 256): ql[128] nibbles, qh[64] 2-bit, scales[16] int8, d f16; x = d * scale * (q - 32)."""
    n = b.shape[0]
    d = (f16(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    ql = split_bits(b[:, :128].reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    qh = split_bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(d).reshape(n, 256)


REFERENCES = {
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
