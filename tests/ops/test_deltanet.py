"""The delta-net layer's token mix: the short convolution (against F.conv1d and transformers, split or whole),
unit q and k, and the state before the first token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deltanet_reference import DK, DV, EPS, H, inputs, rel_err, transformers_fns

from moestream.ops.delta_rule import delta_rule_recurrent
from moestream.ops.deltanet import (
    DeltaNetState,
    MixWeights,
    Projected,
    causal_conv1d,
    gated_delta_mix,
    gated_delta_net,
    l2_normalize,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no thread contention

C, K = 24, 4


def conv_inputs(t: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(t, C, generator=gen, dtype=dtype), torch.randn(C, K, generator=gen, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_matches_conv1d(dtype: torch.dtype) -> None:
    x, w = conv_inputs(37, dtype)
    y, state = causal_conv1d(x, w, torch.zeros(K - 1, C, dtype=dtype))
    ref = F.silu(F.conv1d(x.T[None], w[:, None, :], padding=K - 1, groups=C)[0, :, : x.shape[0]].T)
    err = rel_err(y, ref)
    assert err < (1e-6 if dtype == torch.float32 else 1e-14), f"conv vs F.conv1d: {err:.2e}"
    assert torch.equal(state, x[-(K - 1) :]), "new conv state must be the last K-1 inputs"


@pytest.mark.parametrize("splits", [[1, 36], [2, 35], [20, 1, 1, 15], [1] * 37])
def test_conv_split_equals_whole(splits: list[int]) -> None:
    x, w = conv_inputs(37)
    y_whole, s_whole = causal_conv1d(x, w, torch.zeros(K - 1, C))
    state, parts = torch.zeros(K - 1, C), []
    for piece in x.split(splits):
        y, state = causal_conv1d(piece, w, state)
        parts.append(y)
    err = rel_err(torch.cat(parts), y_whole)
    assert err < 1e-6 and torch.equal(state, s_whole), f"conv split {splits}: {err:.2e}"


def test_conv_matches_transformers() -> None:
    """transformers keeps K columns of [B, C, K] conv state (the oldest is never read); ours K-1 rows."""
    ref = transformers_fns()
    x, w = conv_inputs(37)
    y_hf = ref["causal_conv1d_fn"](x.T[None], w, activation="silu")[0].T
    y, state = causal_conv1d(x, w, torch.zeros(K - 1, C))
    err_prefill = rel_err(y, y_hf)

    x_next, _ = conv_inputs(3)
    hf_state = torch.cat([torch.zeros(C, 1), state.T], dim=1)[None]  # [1, C, K]
    y_hf_next = ref["causal_conv1d_update"](x_next.T[None], hf_state, w, activation="silu")[0].T
    y_next, state = causal_conv1d(x_next, w, state)
    err_decode = rel_err(y_next, y_hf_next)
    assert err_prefill < 1e-6 and err_decode < 1e-6, f"conv vs hf: fn {err_prefill:.2e}, update {err_decode:.2e}"
    assert torch.equal(state, hf_state[0, :, 1:].T), "conv state differs from transformers' last K-1 columns"


def test_l2_normalize() -> None:
    x = torch.randn(5, 3, DK, dtype=torch.bfloat16)
    y = l2_normalize(x, EPS)
    xf = x.float()
    ref = xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + EPS)
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-6, f"l2 norm: {rel_err(y, ref):.2e}"


def test_state_zeros_runs_a_layer_step() -> None:
    st = DeltaNetState.zeros(C, K, H, DK, DV, conv_dtype=torch.bfloat16)
    assert st.conv_state.shape == (K - 1, C) and st.conv_state.dtype == torch.bfloat16
    assert st.recurrent_state.shape == (H, DK, DV) and st.recurrent_state.dtype == torch.float32
    q, k, v, g, beta = inputs(1)
    out, st.recurrent_state = delta_rule_recurrent(q, k, v, g, beta, st.recurrent_state)
    assert out.shape == (1, H, DV) and st.recurrent_state.abs().sum() > 0


@pytest.mark.parametrize("T", [1, 3])
def test_the_op_runs_one_token_by_the_recurrent_rule_and_more_by_the_prefill_rule(T: int) -> None:
    """On the CPU (no decode kernel) the op is gated_delta_mix with the rule for its token count."""
    k_heads, conv = 2, 4
    channels = 2 * k_heads * DK + H * DV
    g = torch.Generator().manual_seed(7)
    projected = Projected(*(torch.randn(T, n, generator=g) for n in (channels, H, H, H * DV)))
    weights = MixWeights(torch.randn(channels, conv, generator=g), torch.randn(H), -torch.rand(H), torch.randn(DV))
    called = []

    def prefill(*args):
        called.append(args[0].shape[0])
        return delta_rule_recurrent(*args)

    states = [DeltaNetState.zeros(channels, conv, H, DK, DV) for _ in range(2)]
    got = gated_delta_net(projected, weights, states[0], k_heads, EPS, prefill)
    want = gated_delta_mix(projected, weights, states[1], k_heads, EPS, delta_rule_recurrent)
    assert called == ([] if T == 1 else [T]) and torch.equal(got, want)
    assert torch.equal(states[0].recurrent_state, states[1].recurrent_state) and states[0].recurrent_state.any()
