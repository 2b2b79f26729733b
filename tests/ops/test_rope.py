"""Rotary tables and the rotation: imrope's text pairs, and rotate-half against the complex-number form."""

from __future__ import annotations

import torch

from moestream.ops.norm import rms_norm
from moestream.ops.rope import imrope_text_cos_sin, rms_norm_rope, rope_cos_sin, rope_neox, yarn_angle_scale
from moestream.ops.yarn import YaRN


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


def test_yarn_matches_transformers_with_the_correction_range_rounded():
    """gpt-oss's YaRN (factor 32 over 4096 positions, beta 32 / 1): transformers' yarn angles and scale with
    truncate on, which rounds the range the way llama.cpp does (gpt-oss's shipped config turns it off)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}
    rope |= {"original_max_position_embeddings": 4096, "truncate": True}
    config = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256, rope_parameters=rope)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    yarn = YaRN(32.0, 4096, mscale=scale)
    plain = 150000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(plain * yarn_angle_scale(yarn, 64, 150000.0, "cpu"), inv_freq.double(), rtol=1e-6)
    positions = torch.tensor([0, 1, 7, 100])
    cos, sin = rope_cos_sin(positions, 64, 150000.0, torch.float64, yarn)
    angle = positions[:, None].double() * inv_freq.double()
    assert torch.allclose(cos, angle.cos() * scale, atol=1e-5) and torch.allclose(sin, angle.sin() * scale, atol=1e-5)
    assert yarn.corr_dims(64, 150000.0) == (8.0, 18.0)  # unrounded: 8.09 and 17.39
