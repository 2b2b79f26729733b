"""flash-linear-attention's chunked gated delta rule against ours, on CUDA (run with -m gpu; -s shows timings).

`delta_rule_fla` hands fla float32 inputs. fla keeps its accumulators and the state in float32, but Triton runs
its matmuls on float32 inputs in TF32 (10-bit mantissa), so it agrees with `delta_rule_chunked` (float32, cuBLAS
without TF32) to TF32 precision, not to float32 rounding. The bound is fla's own: its test_gated_delta.py checks
chunk_gated_delta_rule's output and final state against a float32 torch reference at an RMS error ratio
(rms(a - b) / rms(ref), its `assert_close`) below 5e-3, with fp16 inputs; float32 inputs under TF32 have the
same mantissa width, so that bound applies here too. For scale, on the CPU at these shapes (T=777): rounding q,
k and v to a 10-bit mantissa moves our output by an RMS ratio of 3.2e-4, to bf16's 7-bit one by 2.6e-3; fla's own
kernels, run in Triton's CPU interpreter (IEEE float32, no TF32) at small shapes (up to H=2, Dk=Dv=128, T=130),
matched `delta_rule_chunked` to 1e-6.

The model bound: rounding q, k, v, the state and the output of every prefill call to a 10-bit mantissa changes
tiny-qwen35moe's logits by 2.1e-4 of their largest magnitude (measured on the CPU); 2e-3 leaves 10x for TF32
products inside the kernels. A routing near-tie could flip an expert and exceed it: see test_qwen3moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deltanet_reference import rel_err

import moestream
from moestream.ops import delta_rule
from moestream.ops.delta_rule import delta_rule_chunked, delta_rule_fla, prefill_rule
from moestream.ops.deltanet import l2_normalize
from moestream.options import DELTANET_ENV
from moestream.tools.presets import get_preset

pytestmark = pytest.mark.gpu

H, DK, DV = 32, 128, 128  # qwen3.6-35b-a3b's delta-net: 32 value heads (16 key heads tiled), head dims 128
FLA_RMS_RATIO = 5e-3  # fla's own bound for chunk_gated_delta_rule's o and final state (see the module docstring)


@pytest.fixture(scope="module", autouse=True)
def needs_fla():
    if delta_rule._fla_chunk_kernel() is None:
        pytest.skip(f"flash-linear-attention is not importable ({delta_rule.FLA_INSTALL})")


def rms_ratio(a: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's error measure: rms(a - ref) / rms(ref)."""
    a, ref = a.double(), ref.double()
    return float((a - ref).square().mean().sqrt() / ref.square().mean().sqrt())


def inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random inputs shaped as qwen3.6-35b's layer makes them: unit q/k (16 heads tiled to 32), g <= 0 from weak to
    strong decay (one head down to -20 per token), beta in (0, 1), and a non-zero initial state."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q = l2_normalize(randn(t, H // 2, DK), 1e-6).repeat(1, 2, 1)
    k = l2_normalize(randn(t, H // 2, DK), 1e-6).repeat(1, 2, 1)
    v = randn(t, H, DV)
    g = -F.softplus(randn(t, H) * 3) * torch.rand(H, generator=gen, device="cuda")
    g[:, 0] = -20 * torch.rand(t, generator=gen, device="cuda")
    beta = torch.sigmoid(randn(t, H))
    s0 = randn(H, DK, DV)
    return q, k, v, g, beta, s0


def cuda_ms(fn, reps: int = 10) -> float:
    """Mean milliseconds per call, by CUDA events, after warm-up calls (Triton compiles and autotunes there)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("t", [2048, 777, 63])
@torch.inference_mode()
def test_fla_matches_chunked(t: int) -> None:
    q, k, v, g, beta, s0 = inputs(t)
    s0_copy = s0.clone()
    out_ref, s_ref = delta_rule_chunked(q, k, v, g, beta, s0)
    out, s = delta_rule_fla(q, k, v, g, beta, s0)
    assert torch.equal(s0, s0_copy), "the incoming state must not be modified"
    assert out.shape == (t, H, DV) and out.dtype == torch.float32
    assert s.shape == (H, DK, DV) and s.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(s).all()
    e_out, e_state = rms_ratio(out, out_ref), rms_ratio(s, s_ref)
    print(
        f"T={t}: fla vs torch chunked: out rms ratio {e_out:.2e} (max {rel_err(out, out_ref):.2e}), "
        f"state rms ratio {e_state:.2e} (max {rel_err(s, s_ref):.2e})"
    )
    assert e_out < FLA_RMS_RATIO and e_state < FLA_RMS_RATIO, f"out {e_out:.2e}, state {e_state:.2e}"


@torch.inference_mode()
def test_fla_split_carries_state() -> None:
    """A prompt in micro-batches through fla (state carried between calls) equals one call, to TF32 precision."""
    q, k, v, g, beta, s0 = inputs(700, seed=1)
    out_whole, s_whole = delta_rule_chunked(q, k, v, g, beta, s0)
    state, parts = s0, []
    for sl in (slice(0, 100), slice(100, 107), slice(107, 700)):
        out, state = delta_rule_fla(q[sl], k[sl], v[sl], g[sl], beta[sl], state)
        parts.append(out)
    e_out, e_state = rms_ratio(torch.cat(parts), out_whole), rms_ratio(state, s_whole)
    assert e_out < FLA_RMS_RATIO and e_state < FLA_RMS_RATIO, f"split: out {e_out:.2e}, state {e_state:.2e}"


@torch.inference_mode()
def test_fla_timing() -> None:
    """A measurement, not a check: both rules' time for one qwen3.6-35b layer's prefill of 2048 tokens.

    Also fla fed bfloat16 q, k, v (its native path, which the engine does not use), with its error."""
    t = 2048
    q, k, v, g, beta, s0 = inputs(t)
    ms_torch = cuda_ms(lambda: delta_rule_chunked(q, k, v, g, beta, s0))
    ms_fla = cuda_ms(lambda: delta_rule_fla(q, k, v, g, beta, s0))
    kernel = delta_rule._fla_chunk_kernel()
    qb, kb, vb = (x.bfloat16()[None] for x in (q, k, v))

    def fla_bf16():
        return kernel(qb, kb, vb, g[None], beta[None], scale=DK**-0.5, initial_state=s0[None], output_final_state=True)

    ms_bf16 = cuda_ms(fla_bf16)
    out_ref, _ = delta_rule_chunked(q, k, v, g, beta, s0)
    e_bf16 = rms_ratio(fla_bf16()[0][0].float(), out_ref)
    print(
        f"\ndelta rule, T={t} H={H} Dk={DK} Dv={DV}: torch chunked {ms_torch:.3f} ms, fla float32 {ms_fla:.3f} ms "
        f"(x{ms_torch / ms_fla:.1f}), fla bf16 q/k/v {ms_bf16:.3f} ms (x{ms_torch / ms_bf16:.1f}, "
        f"out rms ratio {e_bf16:.2e})"
    )


def test_selector_picks_fla_on_cuda() -> None:
    assert prefill_rule("auto", torch.device("cuda")) is delta_rule_fla
    assert prefill_rule("auto", "cpu") is delta_rule_chunked
    assert prefill_rule("torch", "cuda") is delta_rule_chunked


@pytest.mark.parametrize("ubatch", [100, 7])
def test_model_logits_fla_vs_torch(model_file, monkeypatch, ubatch: int) -> None:
    """tiny-qwen35moe in float32 on CUDA: 100 tokens in one micro-batch (two fla chunks, ragged) or in
    micro-batches of 7 (state carried between fla calls), with the fla rule and the torch rule."""
    preset = "tiny-qwen35moe"
    path = model_file(preset, "F32")
    n_vocab = get_preset(preset).spec.n_vocab
    tokens = torch.randint(0, n_vocab, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {}
    for mode in ("torch", "fla"):
        monkeypatch.setenv(DELTANET_ENV, mode)  # read once, by the options load() makes
        engine = moestream.load(path, device="cuda", dtype="float32", ubatch=ubatch, progress=False)
        logits[mode] = engine.logits(tokens)
        engine.close()
    err = rel_err(logits["fla"], logits["torch"])
    print(f"ubatch {ubatch}: logits fla vs torch {err:.2e}")
    assert err < 2e-3, f"ubatch {ubatch}: logits with the fla rule differ from the torch rule by {err:.2e}"
