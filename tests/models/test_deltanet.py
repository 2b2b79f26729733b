"""Gated delta-net primitives: chunked == recurrent, state carry, agreement with transformers, and the choice
of prefill rule (fla's kernels themselves run in test_deltanet_gpu.py)."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import moestream
from moestream.errors import MoestreamError
from moestream.models import deltanet
from moestream.models.deltanet import (
    DELTANET_ENV,
    DeltaNetState,
    causal_conv1d,
    delta_rule_chunked,
    delta_rule_fla,
    delta_rule_recurrent,
    l2_normalize,
    prefill_rule,
)
from moestream.offload.options import EngineOptions

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no thread contention

H, DK, DV = 4, 32, 16
C, K = 24, 4
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


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("t", [1, 7, 64, 100, 257])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_chunked_matches_recurrent(t: int, chunk: int, dtype: torch.dtype, tol: float) -> None:
    q, k, v, g, beta = inputs(t, dtype)
    s0 = initial_state(dtype)
    s0_copy = s0.clone()
    out_r, s_r = delta_rule_recurrent(q, k, v, g, beta, s0)
    out_c, s_c = delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert torch.equal(s0, s0_copy), "the incoming state must not be modified"
    assert out_c.shape == (t, H, DV) and out_c.dtype == dtype and s_c.dtype == dtype
    e_out, e_state = rel_err(out_c, out_r), rel_err(s_c, s_r)
    assert e_out < tol and e_state < tol, f"chunked vs recurrent: out {e_out:.2e}, state {e_state:.2e}"


@pytest.mark.parametrize("split", [1, 30, 64, 150])
@pytest.mark.parametrize("fn", [delta_rule_chunked, delta_rule_recurrent])
def test_split_sequence_carries_state(fn, split: int) -> None:
    t = 200
    q, k, v, g, beta = inputs(t)
    s0 = initial_state()
    out_whole, s_whole = fn(q, k, v, g, beta, s0)
    out_a, s_a = fn(q[:split], k[:split], v[:split], g[:split], beta[:split], s0)
    out_b, s_b = fn(q[split:], k[split:], v[split:], g[split:], beta[split:], s_a)
    e_out = rel_err(torch.cat([out_a, out_b]), out_whole)
    e_state = rel_err(s_b, s_whole)
    assert e_out < 1e-5 and e_state < 1e-5, f"split at {split}: out {e_out:.2e}, state {e_state:.2e}"


def test_strong_decay_is_finite() -> None:
    q, k, v, g, beta = inputs(128)
    g = torch.full_like(g, -80.0)  # cumulative -5000 over a chunk: exp(+5000) must never be formed
    out, s = delta_rule_chunked(q, k, v, g, beta, initial_state())
    ref, s_ref = delta_rule_recurrent(q, k, v, g, beta, initial_state())
    assert torch.isfinite(out).all() and torch.isfinite(s).all()
    assert rel_err(out, ref) < 1e-5, f"strong decay: out {rel_err(out, ref):.2e}"


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


@pytest.mark.parametrize("t, chunk", [(1, 64), (100, 64), (257, 64), (100, 16)])
def test_matches_transformers(t: int, chunk: int) -> None:
    """Same inputs through transformers' torch fallbacks ([B, T, H, D] layout, q/k at n_k_heads, GQA by
    repeat_interleave, L2 norm in the kernel with eps 1e-6); ours gets q/k normalised and tiled by the
    caller."""
    ref = transformers_fns()
    n_k_heads = 2
    gen = torch.Generator().manual_seed(3)
    q_raw = torch.randn(t, n_k_heads, DK, generator=gen)
    k_raw = torch.randn(t, n_k_heads, DK, generator=gen)
    _, _, v, g, beta = inputs(t, seed=4)
    s0 = initial_state()

    rep = H // n_k_heads
    q = l2_normalize(q_raw, EPS).repeat_interleave(rep, dim=1)  # HF's head order; GGUF's is tiled instead
    k = l2_normalize(k_raw, EPS).repeat_interleave(rep, dim=1)
    hf_args = (q_raw[None], k_raw[None], v[None], g[None], beta[None])
    hf_kw = dict(initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)

    out_hf_c, s_hf_c = ref["torch_chunk_gated_delta_rule"](*hf_args, chunk_size=chunk, **hf_kw)
    out_hf_r, s_hf_r = ref["torch_recurrent_gated_delta_rule"](*hf_args, **hf_kw)
    out_c, s_c = delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    out_r, s_r = delta_rule_recurrent(q, k, v, g, beta, s0)

    errs = {
        "chunked vs hf chunked": (rel_err(out_c, out_hf_c[0]), rel_err(s_c, s_hf_c[0])),
        "recurrent vs hf recurrent": (rel_err(out_r, out_hf_r[0]), rel_err(s_r, s_hf_r[0])),
        "chunked vs hf recurrent": (rel_err(out_c, out_hf_r[0]), rel_err(s_c, s_hf_r[0])),
    }
    msg = "; ".join(f"{name}: out {eo:.2e} state {es:.2e}" for name, (eo, es) in errs.items())
    assert all(eo < 1e-5 and es < 1e-5 for eo, es in errs.values()), msg


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


@pytest.fixture
def fake_fla(monkeypatch):
    """fake_fla(kernel): make `from fla.ops.gated_delta_rule import chunk_gated_delta_rule` give `kernel`, or
    raise ImportError for kernel=None (whether or not fla is installed here). The import cache is reset."""
    deltanet._fla_chunk_kernel.cache_clear()

    def install(kernel):
        for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):  # all three: transformers may import fla
            monkeypatch.setitem(sys.modules, name, None if kernel is None else types.ModuleType(name))
        if kernel is not None:
            sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = kernel

    yield install
    deltanet._fla_chunk_kernel.cache_clear()


def fla_convention(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """fla's calling convention (q, k, v [B, T, H, D]; g, beta [B, T, H]; state [N, H, Dk, Dv]; explicit scale)
    over transformers' torch form of the same layout, which applies the Dk^-0.5 scale itself."""
    assert q.shape[0] == 1 and q.dim() == 4 and g.shape == beta.shape == q.shape[:3]
    assert initial_state.shape == (1, q.shape[2], q.shape[3], v.shape[3]) and output_final_state
    assert all(t.dtype == torch.float32 for t in (q, k, v, g, beta, initial_state))
    assert scale == q.shape[-1] ** -0.5
    fn = transformers_fns()["torch_chunk_gated_delta_rule"]
    return fn(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, output_final_state=True)


def unreachable(*args, **kwargs):
    raise AssertionError("fla must not be called here")


@pytest.mark.parametrize("t", [7, 100, 257])
def test_fla_rule_passes_fla_its_layout(fake_fla, t: int) -> None:
    """delta_rule_fla's transposes, scale and state layout, checked on the CPU against a stand-in kernel."""
    fake_fla(fla_convention)
    q, k, v, g, beta = inputs(t)
    s0 = initial_state()
    s0_copy = s0.clone()
    out_ref, s_ref = delta_rule_chunked(q, k, v, g, beta, s0)
    out, s = delta_rule_fla(q, k, v, g, beta, s0)
    assert torch.equal(s0, s0_copy), "the incoming state must not be modified"
    assert out.shape == (t, H, DV) and out.dtype == torch.float32
    assert s.shape == (H, DK, DV) and s.dtype == torch.float32
    e_out, e_state = rel_err(out, out_ref), rel_err(s, s_ref)
    assert e_out < 1e-5 and e_state < 1e-5, f"fla layout: out {e_out:.2e}, state {e_state:.2e}"
    assert delta_rule_fla(q, k, v.bfloat16(), g, beta, s0)[0].dtype == torch.bfloat16, "out comes in v's dtype"


def test_fla_rule_float64_state_runs_torch(fake_fla) -> None:
    fake_fla(unreachable)
    q, k, v, g, beta = inputs(30, torch.float64)
    out, s = delta_rule_fla(q, k, v, g, beta, initial_state(torch.float64))
    out_ref, s_ref = delta_rule_chunked(q, k, v, g, beta, initial_state(torch.float64))
    assert torch.equal(out, out_ref) and torch.equal(s, s_ref)


def test_fla_rule_without_fla_names_the_fix(fake_fla) -> None:
    fake_fla(None)
    q, k, v, g, beta = inputs(5)
    with pytest.raises(MoestreamError, match="pip install flash-linear-attention"):
        delta_rule_fla(q, k, v, g, beta, initial_state())


@pytest.mark.parametrize("mode", [None, "", "auto", " AUTO "])
def test_auto_picks_fla_on_cuda_only(fake_fla, mode) -> None:
    fake_fla(unreachable)
    assert prefill_rule(mode, torch.device("cpu")) is delta_rule_chunked
    assert prefill_rule(mode, "cuda") is delta_rule_fla
    assert prefill_rule(mode, torch.device("cuda", 0)) is delta_rule_fla


def test_auto_without_fla_is_torch(fake_fla) -> None:
    fake_fla(None)
    assert prefill_rule("auto", "cuda") is delta_rule_chunked
    assert prefill_rule("auto", "cpu") is delta_rule_chunked


def test_torch_forced(fake_fla) -> None:
    fake_fla(unreachable)
    assert prefill_rule("torch", "cuda") is delta_rule_chunked
    assert prefill_rule("torch", "cpu") is delta_rule_chunked


def test_fla_forced(fake_fla) -> None:
    fake_fla(None)
    with pytest.raises(MoestreamError, match="not installed: pip install flash-linear-attention"):
        prefill_rule("fla", "cuda")
    with pytest.raises(MoestreamError, match="CUDA only"):
        prefill_rule("fla", "cpu")
    deltanet._fla_chunk_kernel.cache_clear()
    fake_fla(unreachable)
    assert prefill_rule("fla", "cuda") is delta_rule_fla
    with pytest.raises(MoestreamError, match="CUDA only"):
        prefill_rule("fla", "cpu")


def test_bad_mode() -> None:
    with pytest.raises(MoestreamError, match=f"{DELTANET_ENV}=triton: expected torch, fla or auto"):
        prefill_rule("triton", "cpu")


def test_env_is_read_with_the_options(monkeypatch) -> None:
    """$MOESTREAM_DELTANET is read once, when the options are made: normalised there, a bad value fails there."""
    monkeypatch.setenv(DELTANET_ENV, " Torch ")
    opts = EngineOptions(device="cpu")
    assert opts.deltanet == "torch"
    monkeypatch.setenv(DELTANET_ENV, "fla")
    assert opts.deltanet == "torch" and EngineOptions(device="cpu", deltanet="auto").deltanet == "auto"
    monkeypatch.delenv(DELTANET_ENV)
    assert EngineOptions(device="cpu").deltanet == "auto"
    monkeypatch.setenv(DELTANET_ENV, "triton")
    with pytest.raises(MoestreamError, match=f"{DELTANET_ENV}=triton: expected torch, fla or auto"):
        EngineOptions(device="cpu")


def test_model_prefill_uses_the_rule_chosen_at_load(model_file, monkeypatch) -> None:
    """qwen35moe's delta-net layers run the rule picked at load: forcing fla on the CPU fails at load with the
    selector's error, and the environment changed after load changes nothing."""
    path = model_file("tiny-qwen35moe", "F32")
    monkeypatch.setenv(DELTANET_ENV, "fla")
    with pytest.raises(MoestreamError, match="CUDA only"):
        moestream.load(path, device="cpu", ubatch=8, progress=False)
    monkeypatch.delenv(DELTANET_ENV)
    engine = moestream.load(path, device="cpu", ubatch=8, progress=False)
    assert engine.model.prefill_rule is delta_rule_chunked
    monkeypatch.setenv(DELTANET_ENV, "fla")
    assert engine.logits([1, 2, 3]).shape[0] == 3
    engine.close()
