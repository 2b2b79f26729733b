"""gpt-oss against transformers' GptOssForCausalLM on the same weights, in float64, configured as llama.cpp
reads the file (tests/models/reference.py); and every streaming schedule against the all-resident run."""

from __future__ import annotations

import pytest
import torch
from reference import gpt_oss_reference, greedy, prompt_tokens, rel_err

import moestream
from moestream.errors import MoestreamError
from moestream.models.layouts.gpt_oss import read_spec
from moestream.offload.device import CpuDevice
from moestream.runtime.sampling import SamplingParams
from moestream.tools.presets import get_preset
from moestream.tools.recipes import recipe
from moestream.tools.synthetic import preset_metadata

PRESET = "tiny-gpt-oss"  # 3 layers (sliding, full, sliding) with a window of 8 positions
N_VOCAB = get_preset(PRESET).spec.n_vocab


@pytest.mark.parametrize("quant,tol", [("F32", 1e-4), ("Q8_0", 1e-3), ("MXFP4_MOE", 1e-3)])
def test_logits_match_transformers(model_file, quant, tol):
    """A 23-token prompt in micro-batches of 7: every position's logits, and its top token."""
    path = model_file(PRESET, quant)
    engine = moestream.load(path, device="cpu", ubatch=7, progress=False)
    tokens = prompt_tokens(23, N_VOCAB)
    ours = engine.logits(tokens)
    with torch.inference_mode():
        theirs = gpt_oss_reference(path)(torch.tensor([tokens])).logits[0]
    engine.close()
    err = rel_err(ours, theirs)
    print(f"{PRESET} {quant}: max relative logit error vs transformers {err:.2e}")
    assert err < tol, f"logits differ from transformers by {err:.2e} (relative)"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_past_the_window_matches_transformers(model_file):
    """20 greedy tokens after a 6-token prompt: decode steps at positions well past the window of 8."""
    path = model_file(PRESET, "F32")
    tokens = prompt_tokens(6, N_VOCAB, seed=4)
    engine = moestream.load(path, device="cpu", progress=False)
    got = engine.generate(tokens, SamplingParams(max_tokens=20, temperature=0.0, stop_at_eos=False)).tokens
    engine.close()
    assert got == greedy(gpt_oss_reference(path), tokens, 20)


@pytest.fixture(scope="module")
def resident(model_file):
    engine = moestream.load(model_file(PRESET, "MXFP4_MOE"), device="cpu", ubatch=16, progress=False)
    tokens = prompt_tokens(40, N_VOCAB, seed=5)
    yield tokens, engine.logits(tokens), engine.generate(tokens[:12], GREEDY).tokens
    engine.close()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False)


@pytest.mark.parametrize("stream", ["serial", "pinned", "overlap", "layer-major"])
@pytest.mark.parametrize("n_cpu_moe,slots", [(2, 2), ("all", 3)])
def test_every_schedule_is_bit_identical_to_resident(model_file, resident, stream, n_cpu_moe, slots):
    tokens, logits, _ = resident
    engine = moestream.load(
        model_file(PRESET, "MXFP4_MOE"),
        device="cpu",
        ubatch=16,
        stream_min_batch=8,
        n_cpu_moe=n_cpu_moe,
        stream=stream,
        slots=slots,
        progress=False,
        device_impl=CpuDevice(copy_delay_s=0.002, compute_delay_s=0.001),
    )
    got = engine.logits(tokens)
    engine.close()
    assert torch.equal(got, logits), f"max diff {(got - logits).abs().max():.3e}"


@pytest.mark.parametrize("small_batch", ["cpu", "upload", "gather"])
def test_small_batch_ways_give_the_resident_tokens(model_file, resident, small_batch):
    """Streamed experts under --stream-min-batch: computed on the host, uploaded or gathered (the biases
    follow the router's ids whatever rows the experts' bytes are)."""
    tokens, _, want = resident
    engine = moestream.load(
        model_file(PRESET, "MXFP4_MOE"),
        device="cpu",
        ubatch=3,
        stream_min_batch=32,
        n_cpu_moe="all",
        small_batch=small_batch,
        progress=False,
        device_impl=CpuDevice(copy_delay_s=0.001),
    )
    got = engine.generate(tokens[:12], GREEDY).tokens
    engine.close()
    assert got == want


def test_reads_the_window_pattern_and_yarn_as_llama_cpp():
    meta = preset_metadata(get_preset("gpt-oss-20b"), recipe("F32"))
    spec = read_spec(meta, N_VOCAB)
    assert spec.extra["sliding_layers"][:4] == (True, False, True, False) and spec.extra["sliding_window"] == 128
    yarn = spec.extra["yarn"]
    assert yarn.factor == 32 and yarn.n_ctx_orig == 4096 and abs(yarn.mscale - 1.3465736) < 1e-6
    flags = [il % 3 == 0 for il in range(24)]
    assert read_spec(meta | {"gpt-oss.attention.sliding_window_pattern": flags}, N_VOCAB).extra["sliding_layers"] == (
        tuple(flags)
    )
    assert read_spec(meta | {"gpt-oss.rope.scaling.type": "none"}, N_VOCAB).extra["yarn"] is None
    with pytest.raises(MoestreamError, match="longrope"):
        read_spec(meta | {"gpt-oss.rope.scaling.type": "longrope"}, N_VOCAB)
    with pytest.raises(MoestreamError, match="freq_base_swa"):
        read_spec(meta | {"gpt-oss.rope.freq_base_swa": 10000.0}, N_VOCAB)
