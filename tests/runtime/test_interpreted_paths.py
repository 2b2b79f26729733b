"""The GPU-only decode branches on a machine without a GPU: Triton's interpreter runs the quantized matvecs
(dense projections, ops/experts.py's matvec branch, the host gather before it) and the delta-net decode kernels
(qwen35moe) on the CPU device, and each placement's greedy tokens must equal the plain CPU path's. Slow
(minutes a placement): a check after changing those branches, before device time is spent:

    TRITON_INTERPRET=1 pytest -m gpu tests/runtime/test_interpreted_paths.py
"""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.kernels import deltanet_step, dots, matvec, tuning
from moestream.kernels.launch import INTERPRETED, triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (INTERPRETED and triton is not None), reason="runs in Triton's interpreter"),
]

PROMPT = [(11 * t) % 1000 + 5 for t in range(12)]
PLACEMENTS = {
    "resident": {},
    "gather": dict(n_cpu_moe="all", small_batch="gather", prefetch=0),
    "gather+cache": dict(n_cpu_moe="all", small_batch="gather", expert_cache=3),
    "upload": dict(n_cpu_moe="all", small_batch="upload"),
}


def greedy(e, n: int = 4) -> tuple[list[int], torch.Tensor]:
    cache = e.new_cache()
    logits = e.forward(PROMPT, cache)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = e.forward([out[-1]], cache)
    return out, logits


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_the_kernels_branches_give_the_cpu_paths_tokens(model_file, monkeypatch, preset, placement):
    path = model_file(preset, "Q4_K_M")
    ref = moestream.load(path, device="cpu", progress=False)
    want, want_logits = greedy(ref)
    ref.close()
    # the kernels' branches taken on the CPU device too (float32: the calls, not the bf16 reads)
    most = tuning.current().max_tokens
    monkeypatch.setattr(matvec, "usable", lambda qtype, device, n: qtype in dots.DOTS and n <= most)
    monkeypatch.setattr(
        deltanet_step,
        "usable",
        lambda qkv, *states: qkv.shape[0] == 1 and all(t.dtype == torch.float32 for t in states),
    )
    e = moestream.load(path, device="cpu", progress=False, **PLACEMENTS[placement])
    got, logits = greedy(e)
    e.close()
    assert got == want
    assert float((logits - want_logits).abs().max() / want_logits.abs().max()) < 1e-4


@pytest.mark.parametrize("placement", ["resident", "gather"])
def test_gpt_oss_through_the_kernels_gives_the_cpu_paths_tokens(model_file, monkeypatch, placement):
    """gpt-oss's GPU branches: the attention kernel with sinks and the window (the prompt's too), the decode
    prologue's biases and RoPE in one launch (and the other fused row kernels), the clamped experts in the
    three decode launches, its MXFP4 and Q8_0 matvecs."""
    from moestream.kernels import decode_attention, fused

    path = model_file("tiny-gpt-oss", "MXFP4_MOE")
    ref = moestream.load(path, device="cpu", progress=False)
    want, want_logits = greedy(ref)
    ref.close()
    most = tuning.current().max_tokens
    monkeypatch.setattr(matvec, "usable", lambda qtype, device, n: qtype in dots.DOTS and n <= most)
    monkeypatch.setattr(decode_attention, "usable", lambda q: q.dtype == torch.float32)
    monkeypatch.setattr(fused, "usable", lambda x: x.dtype == torch.float32)
    e = moestream.load(path, device="cpu", progress=False, **PLACEMENTS[placement])
    got, logits = greedy(e)
    e.close()
    assert got == want
    assert float((logits - want_logits).abs().max() / want_logits.abs().max()) < 1e-4


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss", "tiny-qwen35moe"])
def test_kv_types_through_the_kernels_give_the_cpu_paths_tokens(model_file, monkeypatch, preset, kv):
    """-ctk/-ctv: the decode prologue's fused launch into scratch rows, then encoded; the attention kernel reading
    Q8_0/Q4_0 blocks (or f16 rows under float32 queries), prompt and decode, against ops/kv_rows.row_attention."""
    from moestream.kernels import decode_attention, fused, kv_quant

    path = model_file(preset, "Q8_0")
    ref = moestream.load(path, device="cpu", progress=False, cache_type_k=kv, cache_type_v=kv)
    want, want_logits = greedy(ref)
    ref.close()
    monkeypatch.setattr(decode_attention, "usable", lambda q: q.dtype == torch.float32)
    monkeypatch.setattr(fused, "usable", lambda x: x.dtype == torch.float32)
    monkeypatch.setattr(kv_quant, "quantize", kv_quant.quantize_kernel)  # the rows' encoding too
    e = moestream.load(path, device="cpu", progress=False, cache_type_k=kv, cache_type_v=kv)
    got, logits = greedy(e)
    e.close()
    assert got == want
    assert float((logits - want_logits).abs().max() / want_logits.abs().max()) < 1e-4


@pytest.mark.parametrize("placement", ["gather", "gather+cache"])
def test_batched_rows_through_the_gather_read_shared_experts_once_and_answer_as_alone(
    model_file, monkeypatch, placement
):
    """A pass of one token for each of several sequences, streamed experts gathered (rows that pick the same
    expert read it once, and index its one row), or guessed ahead for every row (the union of their guesses)
    and read from the prefetched rows and the expert cache: each row's greedy tokens are those of its sequence
    alone."""
    most = tuning.current().max_tokens
    monkeypatch.setattr(matvec, "usable", lambda qtype, device, n: qtype in dots.DOTS and n <= most)
    e = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_seqs=3, **PLACEMENTS[placement])
    prompts = [PROMPT[:5], PROMPT[3:10], PROMPT[6:9]]
    alone = []
    for prompt in prompts:
        cache = e.new_cache()
        tokens = [int(e.forward(prompt, cache)[-1].argmax())]
        for _ in range(3):
            tokens.append(int(e.forward([tokens[-1]], cache)[-1].argmax()))
        alone.append(tokens)
    caches = [e.new_cache() for _ in prompts]
    last = [int(e.forward(p, c)[-1].argmax()) for p, c in zip(prompts, caches, strict=True)]
    together = [last]
    counted = e.experts.counters.stats()
    for _ in range(3):
        last = e.forward_each(last, caches).argmax(-1).tolist()
        together.append(last)
    if counted is not None:  # guessed ahead: every row's picks counted, some taken from the guess
        picks, misses, *_ = (b - a for a, b in zip(counted, e.experts.counters.stats(), strict=True))
        assert picks == 3 * e.spec.n_layer * 3 * e.spec.n_expert_used and misses < picks
    e.close()
    assert [list(t) for t in zip(*together, strict=True)] == alone
