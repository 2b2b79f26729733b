"""RMSNorm's torch form against float64 arithmetic, and the residual add before it."""

from __future__ import annotations

import pytest
import torch

from moestream.ops.norm import add_rms_norm, rms_norm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_float64(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    xd = x.double()
    ref = w.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and float((got.double() - ref).abs().max() / ref.abs().max()) < tol


def test_add_rms_norm_is_the_add_then_the_norm():
    g = torch.Generator().manual_seed(1)
    x, r, w = (torch.randn(*s, generator=g) for s in ((3, 32), (3, 32), (32,)))
    h, normed = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and torch.equal(normed, rms_norm(x + r, w, 1e-6))
