"""Shared by the delta-net op tests: random delta-rule inputs shaped like the model makes them, and
transformers' torch forms of the same math."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from moestream.ops.deltanet import l2_normalize

H, DK, DV = 4, 32, 16
EPS = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def inputs(t: int, dtype: torch.dtype = torch.float32, seed: int = 0, n_k_heads: int = H) -> tuple[torch.Tensor, ...]:
    """Random delta-rule inputs shaped like the model makes them (unit q/k, g <= 0, beta in (0, 1)).

    g spans weak to very strong decay (down to about -20 per token) so masked exponents are exercised.
    """
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, n_k_heads, DK, generator=gen, dtype=dtype), EPS)
    k = l2_normalize(torch.randn(t, n_k_heads, DK, generator=gen, dtype=dtype), EPS)
    v = torch.randn(t, H, DV, generator=gen, dtype=dtype)
    per_head = torch.rand(H, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(t, H, generator=gen, dtype=dtype) * 3) * per_head
    g[:, 0] = -20 * torch.rand(t, generator=gen, dtype=dtype)
    beta = torch.sigmoid(torch.randn(t, H, generator=gen, dtype=dtype))
    return q, k, v, g, beta


def initial_state(dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, DK, DV, generator=gen, dtype=dtype)


def transformers_fns():
    """transformers' pure-torch functions, unwrapped from the hub/fla kernel dispatch."""
    m = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    return {name: inspect.unwrap(getattr(m, name)) for name in names}
