"""Placement budgets for the context: the KV cache of -c, a -ub micro-batch's temporaries and the staging ring,
checked against what the CPU device measures (offload/device.CpuMemory); -ncmoe auto fits -c, -ub and the budget;
an explicit -ncmoe that does not fit names the largest -c and -ub that would, and auto's choice (on the real
qwen3-30b-a3b shapes, without writing its 17 GB file)."""

from __future__ import annotations

import math
import re

import gguf
import pytest
import torch

import moestream
from moestream.errors import MoestreamError
from moestream.models.registry import architecture, layout
from moestream.offload import placement as P
from moestream.offload.device import CpuMemory
from moestream.offload.streamer import ALIGN
from moestream.options import Schedule
from moestream.tools.presets import get_preset
from moestream.tools.recipes import recipe
from moestream.tools.synthetic import tensor_plans

GIB = 2**30
FLOATS = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}


def load(path: str, **opts):
    return moestream.load(path, device="cpu", n_ctx=256, stream_min_batch=8, progress=False, **opts)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("ubatch", [16, 200])
@pytest.mark.parametrize("keep", [False, True])
def test_footprint_bounds_what_the_cpu_device_allocates(model_file, preset, ubatch, keep):
    """The KV cache (and recurrent state) and the staging ring are what the footprint says (to the byte, and
    to the alignment of the slots' stacks); a
    200-token prompt's pass allocates at most the temporaries it budgets, and not a small fraction of them,
    also where each layer's dequantized stacks are kept across micro-batches."""
    engine = load(model_file(preset, "Q4_K_M"), ubatch=ubatch, n_cpu_moe=2, keep_dequantized=keep)
    try:
        fp, placement = engine.offload.footprint, engine.offload.placement
        with CpuMemory() as kv:
            cache = engine.new_cache()
        assert kv.peak == fp.kv_cache
        tokens = torch.randint(0, engine.spec.n_vocab, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        with CpuMemory() as run:
            engine.forward(tokens, cache)
        budgeted = fp.workspace - P.ALLOCATOR_SLACK
        print(f"{preset} -ub {ubatch}: measured {run.peak} bytes of temporaries, budgeted {budgeted}")
        assert budgeted / 3 <= run.peak <= budgeted
        with CpuMemory() as staging:
            engine.setup.reconfigure(n_cpu_moe=2)
        # each slot holds a layer's three stacks, each rounded up to ALIGN (gpt-oss's rows do not fill it)
        extra = staging.peak - placement.staging_bytes
        assert placement.staging_bytes > 0 and 0 <= extra < 3 * ALIGN * placement.n_slots
    finally:
        engine.close()


def test_a_long_prompt_at_a_budget_that_holds_one_micro_batch(model_file):
    """A budget sized for -ub 16 refuses -ub 200, naming the largest -ub that fits; under it a 200-token prompt
    runs as micro-batches of 16, allocates no more than the budget's workspace, and gives the logits of the
    prompt as one micro-batch."""
    path = model_file("tiny", "Q4_K_M")
    tokens = torch.randint(0, 1280, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = load(path, ubatch=200)
    try:
        expected = whole.logits(tokens)
    finally:
        whole.close()
    sized = load(path, ubatch=16, n_cpu_moe=2)
    budget = sized.offload.placement.gpu_bytes(sized.offload.footprint)
    sized.close()
    with pytest.warns(UserWarning, match="only decides which layers stream"):
        with pytest.raises(MoestreamError) as refused:
            load(path, ubatch=200, n_cpu_moe=2, vram_budget=budget)
    largest = int(re.search(r"-ub (\d+)", str(refused.value)).group(1))
    assert 16 <= largest < 200, str(refused.value)
    with pytest.warns(UserWarning, match="only decides which layers stream"):
        engine = load(path, ubatch=16, n_cpu_moe=2, vram_budget=budget)
    try:
        assert engine.offload.placement.gpu_bytes(engine.offload.footprint) <= budget
        with CpuMemory() as run:
            got = engine.logits(tokens)
        assert run.peak <= engine.offload.footprint.workspace
    finally:
        engine.close()
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-4, f"relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def preset_sizing(name: str, quant: str, ubatch: int, n_ctx: int) -> tuple[list[int], P.Sizing]:
    """Each layer's stored expert bytes and the footprint of a GPU run (bf16, decode gathering with a full
    prefetch ring, one sequence) from a preset's shapes and a recipe's types, as the loader would count the file."""
    preset = get_preset(name)
    spec = preset.spec
    state_bytes = architecture(spec.arch).state_bytes(spec)  # as the loader hands it to the builder
    plans = {p.name: p for p in tensor_plans(preset, recipe(quant))}

    def stored(name: str) -> int:
        block, size = gguf.GGML_QUANT_SIZES[plans[name].qtype]
        return math.prod(plans[name].shape) // block * size

    names = {il: layout(spec.arch).expert_tensor_names(il) for il in spec.expert_layers}
    host = {n for ns in names.values() for n in ns} | {"token_embd.weight"}
    dense = sum(math.prod(p.shape) * 2 if p.qtype in FLOATS else stored(n) for n, p in plans.items() if n not in host)
    experts = [sum(map(stored, names[il])) if il in names else 0 for il in range(spec.n_layer)]
    one_expert = sum(max(stored(names[il][s]) // spec.n_expert for il in names) for s in range(3))
    ring = 2 * 2 * spec.n_expert_used * one_expert  # 2 slots (--prefetch-ahead 1) of K guessed and K picked

    def at(c: int, u: int) -> P.Footprint:
        kv = P.kv_cache_bytes(spec, c, torch.bfloat16) + state_bytes
        return P.Footprint(dense, kv, P.workspace_bytes(spec, u, c, torch.bfloat16), ring)

    return experts, P.Sizing(n_ctx, ubatch, at)


def fits(experts: list[int], n: int, budget: int, sizing: P.Sizing, n_ctx: int, ubatch: int) -> bool:
    p = P.Placement(n, experts, Schedule.OVERLAP.staging_slots(3))
    return p.gpu_bytes(sizing.at(n_ctx, ubatch)) <= budget


def test_the_issues_case_is_refused_with_what_would_fit():
    """`bench -p 16384 -ub 2048 -ncmoe 26 --vram-budget 12GiB` on qwen3-30b-a3b Q4_K_M (a context of 16385):
    refused, naming the largest -c and -ub that fit at 26 layers streamed and the smallest N that fits as asked,
    each exactly the edge (one more does not fit)."""
    budget, n_ctx, ubatch = 12 * GIB, 16385, 2048
    experts, sizing = preset_sizing("qwen3-30b-a3b", "Q4_K_M", ubatch, n_ctx)
    with pytest.raises(MoestreamError) as refused:
        P.plan(experts, 26, Schedule.OVERLAP, 3, budget, sizing.footprint, sizing=sizing)
    said = str(refused.value)
    print(said)
    ctx = int(re.search(r"-c (\d+)", said).group(1))
    ub = int(re.search(r"-ub (\d+)", said).group(1))
    auto = int(re.search(r"auto picks (\d+)", said).group(1))
    assert fits(experts, 26, budget, sizing, ctx, ubatch) and not fits(experts, 26, budget, sizing, ctx + 1, ubatch)
    assert fits(experts, 26, budget, sizing, n_ctx, ub) and not fits(experts, 26, budget, sizing, n_ctx, ub + 1)
    assert fits(experts, auto, budget, sizing, n_ctx, ubatch)
    assert not fits(experts, auto - 1, budget, sizing, n_ctx, ubatch)
    chosen = P.plan(experts, "auto", Schedule.OVERLAP, 3, budget, sizing.footprint, sizing=sizing)
    assert chosen.n_cpu_moe == auto


def test_auto_streams_more_layers_for_longer_contexts_and_micro_batches():
    budget = 12 * GIB
    picked = {}
    for n_ctx in (4096, 16385, 32769, 65537):
        for ubatch in (512, 2048, 4096):
            experts, sizing = preset_sizing("qwen3-30b-a3b", "Q4_K_M", ubatch, n_ctx)
            p = P.plan(experts, "auto", Schedule.OVERLAP, 3, budget, sizing.footprint, sizing=sizing)
            assert p.gpu_bytes(sizing.footprint) <= budget
            picked[n_ctx, ubatch] = p.n_cpu_moe
    for (n_ctx, ubatch), n in picked.items():
        assert all(m >= n for (c, u), m in picked.items() if c >= n_ctx and u >= ubatch), picked


def test_the_workspace_stops_growing_past_a_chunk_of_prefix():
    """Prefill attention reads the prefix in chunks: from 32k to 128k positions a micro-batch's temporaries grow
    by the longer prompt's residual stream (n_embd a token) alone."""
    spec = get_preset("qwen3-30b-a3b").spec
    deep = [P.temporaries_bytes(spec, 2048, n, torch.bfloat16) for n in (32768, 131072)]
    assert deep[1] - deep[0] == (131072 - 32768) * spec.n_embd * 2
    assert P.temporaries_bytes(spec, 2048, 4096, torch.bfloat16) < deep[0]


def test_refusal_without_any_fitting_n_says_so():
    experts, sizing = preset_sizing("qwen3-30b-a3b", "Q4_K_M", 2048, 262144)
    with pytest.raises(MoestreamError, match="no --n-cpu-moe fits"):
        P.plan(experts, 26, Schedule.OVERLAP, 3, 4 * GIB, sizing.footprint, sizing=sizing)


@pytest.mark.gpu
@pytest.mark.parametrize("ubatch", [16, 200])
def test_footprint_bounds_what_the_gpu_allocates(model_file, ubatch):
    """On CUDA the allocator's own high-water mark: a 200-token prompt's pass stays within the workspace (allocator
    slack included: cuBLAS and Triton take theirs from it)."""
    engine = moestream.load(
        model_file("tiny", "Q4_K_M"), device="cuda", n_ctx=256, ubatch=ubatch, n_cpu_moe=2, progress=False
    )
    try:
        cache = engine.new_cache()
        tokens = torch.randint(0, engine.spec.n_vocab, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.forward(tokens, cache)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= engine.offload.footprint.workspace, (peak, engine.offload.footprint)
    finally:
        engine.close()
