"""The gated delta rule: chunked == recurrent, state carry, agreement with transformers, and the choice of
prefill rule (fla's kernels themselves run in test_delta_rule_gpu.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from deltanet_reference import DK, DV, EPS, H, initial_state, inputs, rel_err, transformers_fns

import moestream
from moestream.errors import MoestreamError
from moestream.ops import delta_rule
from moestream.ops.delta_rule import (
    delta_rule_chunked,
    delta_rule_fla,
    delta_rule_recurrent,
    prefill_rule,
)
from moestream.ops.deltanet import l2_normalize
from moestream.options import DELTANET_ENV, Options

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: no thread contention


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


@pytest.fixture
def fake_fla(monkeypatch):
    """fake_fla(kernel): make `from fla.ops.gated_delta_rule import chunk_gated_delta_rule` give `kernel`, or
    raise ImportError for kernel=None (whether or not fla is installed here). The import cache is reset."""
    delta_rule._fla_chunk_kernel.cache_clear()

    def install(kernel):
        for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):  # all three: transformers may import fla
            monkeypatch.setitem(sys.modules, name, None if kernel is None else types.ModuleType(name))
        if kernel is not None:
            sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = kernel

    yield install
    delta_rule._fla_chunk_kernel.cache_clear()


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
    delta_rule._fla_chunk_kernel.cache_clear()
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
    opts = Options.make(device="cpu")
    assert opts.model.deltanet == "torch"
    monkeypatch.setenv(DELTANET_ENV, "fla")
    assert opts.model.deltanet == "torch" and Options.make(device="cpu", deltanet="auto").model.deltanet == "auto"
    monkeypatch.delenv(DELTANET_ENV)
    assert Options.make(device="cpu").model.deltanet == "auto"
    monkeypatch.setenv(DELTANET_ENV, "triton")
    with pytest.raises(MoestreamError, match=f"{DELTANET_ENV}=triton: expected torch, fla or auto"):
        Options.make(device="cpu")


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
