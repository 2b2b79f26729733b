"""Rotary tables and the rotation: imrope's text pairs, and rotate-half against the complex-number form."""

from __future__ import annotations

import torch

from moestream.ops.norm import rms_norm
from moestream.ops.rope import imrope_text_cos_sin, rms_norm_rope, rope_cos_sin, rope_neox


def test_imrope_pairs_outside_the_text_sections_stay_still():
    """Sections (1, 1, 1, 0) cover pairs 0-2 (time, height, width); pair 3 is the 4th section: position 0."""
    positions = torch.arange(5, 9)
    cos, sin = imrope_text_cos_sin(positions, 8, 10_000.0, (1, 1, 1, 0), torch.float32)
    plain_cos, plain_sin = rope_cos_sin(positions, 8, 10_000.0, torch.float32)
    assert torch.equal(cos[:, :3], plain_cos[:, :3]) and torch.equal(sin[:, :3], plain_sin[:, :3])
    assert bool((cos[:, 3] == 1).all() and (sin[:, 3] == 0).all())


def test_rope_neox_turns_each_pair_by_its_angle():
    """Channel i and i + half form a complex number turned by position * base^(-2i/rot_dim); channels past
    rot_dim pass through. The torch form of rms_norm_rope is the rotation of the norm."""
    T, H, Dh, rot = 5, 3, 16, 8
    positions = torch.arange(T) * 7
    x = torch.randn(T, H, Dh, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cos, sin = rope_cos_sin(positions, rot, 1e4, torch.float64)
    angle = positions[:, None].double() * 1e4 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    assert torch.allclose(cos, angle.cos(), atol=1e-5) and torch.allclose(sin, angle.sin(), atol=1e-5)
    got = rope_neox(x, cos, sin)
    half = rot // 2
    turned = (
        torch.complex(x[..., :half], x[..., half:rot])
        * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None]
    )
    assert torch.allclose(got[..., :half], turned.real) and torch.allclose(got[..., half:rot], turned.imag)
    assert torch.equal(got[..., rot:], x[..., rot:])
    w = torch.randn(Dh, dtype=torch.float64)
    assert torch.equal(rms_norm_rope(x, w, 1e-6, cos, sin), rope_neox(rms_norm(x, w, 1e-6), cos, sin))
