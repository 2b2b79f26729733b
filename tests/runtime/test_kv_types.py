"""Quantized KV caches against the f16 cache on every architecture's tiny model (issue 36: q8_0 / q4_0 logits
within 1e-2 / 3e-2 of the largest logit, the same 16 greedy tokens).

q8_0 meets that everywhere. q4_0 cannot on four of the six random models, and those cases are marked (strict:
they fail the day they pass). Measured (docs/benchmarks.md, "Why q4_0 misses 3e-2"; scripts/kv_q4_diag.py):
the blocks are gguf's bit for bit (tests/kernels/test_kv_quant.py), and the K and V rows of these models are
Gaussian, no outliers, so each row's rounding is Q4_0's floor, 8.6% of its RMS against Q8_0's 0.54%: 16 times.
A token's logit error is that rounding times the model's sensitivity to it, so on every token routed as with
f16 q4_0's error is q8_0's times 10-30 (median 16: test_q4_0_error_is_q8_0s_times_its_step), and the 3e-2
bound holds only where q8_0's error is under 2e-3; the issue's bounds are 3 times apart, the types' steps 16.
The largest misses are tokens whose experts change in some layer (tiny 0.114, gpt-oss 0.063) and the first
positions, where attention averages few value rows (glm4moe 0.036 at position 0, where K plays no part).
A model with a trained model's statistics would not help: trained keys have outlier channels (worse blocks),
and the trained-routing qwen3-30b-a3b slice, whose planted first attention is 1.5 times its stream, is off by
0.175.
"""

from __future__ import annotations

import pytest
import torch

import moestream

PRESETS = ["tiny", "tiny-odd", "tiny-qwen35moe", "tiny-gpt-oss", "tiny-glm4moe", "tiny-glm4moe-odd"]
PROMPT = [(11 * t) % 200 + 5 for t in range(40)]
MISSES_ERROR = {"tiny", "tiny-gpt-oss", "tiny-glm4moe", "tiny-glm4moe-odd"}  # q4_0 over 3e-2 (above)
MISSES_TOKENS = {"tiny-gpt-oss"}  # q4_0's greedy tokens part from f16's at the fourth
ISSUE_BOUND = {"q8_0": 1e-2, "q4_0": 3e-2}
STEP_RATIO = 127 / 8  # Q4_0's rounding step over Q8_0's (the largest value over 8, over 127)


def run(path: str, kv: str, n_gen: int = 16, **engine) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
    """The prompt's logits, n_gen greedy tokens after it, and each layer's expert picks over the prompt (engine:
    more options; the CPU device by default)."""
    engine = {"device": "cpu", "ubatch": 8, "cache_type_k": kv, "cache_type_v": kv} | engine
    e = moestream.load(path, progress=False, **engine)
    picks: dict[int, list[torch.Tensor]] = {}
    try:
        cache = e.new_cache()
        record = lambda il, x, ids: picks.setdefault(il, []).append(ids.sort(dim=-1).values)  # noqa: E731
        logits = e.forward(PROMPT, cache, all_logits=True, on_route=record)
        tokens, last = [], logits[-1:]
        for _ in range(n_gen):
            tokens.append(int(last[-1].argmax()))
            last = e.forward([tokens[-1]], cache)
    finally:
        e.close()
    return logits.float().cpu(), tokens, {il: torch.cat(p).cpu() for il, p in picks.items()}


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)


@pytest.fixture(scope="module")
def runs(model_file):
    cache: dict = {}

    def get(preset: str, kv: str):
        if (preset, kv) not in cache:
            cache[preset, kv] = run(model_file(preset, "Q8_0"), kv)
        return cache[preset, kv]

    return get


def case(preset: str, kv: str, misses: set[str], what: str):
    marks = ()
    if kv == "q4_0" and preset in misses:
        marks = pytest.mark.xfail(strict=True, reason=f"q4_0 {what} on this random model (module docstring)")
    return pytest.param(preset, kv, marks=marks)


@pytest.mark.parametrize("preset,kv", [case(p, kv, MISSES_ERROR, "misses 3e-2") for kv in ISSUE_BOUND for p in PRESETS])
def test_logits_within_the_issue_bound_of_the_f16_cache(runs, preset, kv):
    err = relative_errors(runs(preset, kv)[0], runs(preset, "f16")[0])
    assert err.max() < ISSUE_BOUND[kv], f"max {err.max():.4f}, median {err.median():.4f}"


@pytest.mark.parametrize("preset,kv", [case(p, kv, MISSES_TOKENS, "parts") for kv in ISSUE_BOUND for p in PRESETS])
def test_first_16_greedy_tokens_are_the_f16_caches(runs, preset, kv):
    assert runs(preset, kv)[1] == runs(preset, "f16")[1]


@pytest.mark.parametrize("preset", PRESETS)
def test_q4_0_error_is_its_rounding(runs, preset):
    """What does hold for q4_0: the median token within the issue's bound, and so is every token past the
    first 8 positions whose experts are f16's (most of them: at least 24 of 32)."""
    logits, _, picks = runs(preset, "q4_0")
    ref, _, ref_picks = runs(preset, "f16")
    err = relative_errors(logits, ref)
    same_route = torch.stack([(picks[il] == ref_picks[il]).all(dim=-1) for il in ref_picks]).all(dim=0)
    settled = err[8:][same_route[8:]]
    assert err.median() < 3e-2 and settled.numel() >= 24 and settled.max() < 3e-2, (
        f"median {err.median():.4f}, max past position 8 without a routing change {settled.max():.4f}"
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_q4_0_error_is_q8_0s_times_its_step(runs, preset):
    """Why q4_0 misses where it does: on every token routed as with f16 (q8_0 and q4_0), its error is q8_0's
    times Q4_0's coarser step (within a factor of 2 either way; the median within a quarter), the model's
    sensitivity cancelling out. A q4_0 path with an error of its own, or one that rounded finer, breaks it."""
    ref, _, ref_picks = runs(preset, "f16")
    (e8, _, picks8), (e4, _, picks4) = (
        (relative_errors(r[0], ref), *r[1:]) for r in (runs(preset, "q8_0"), runs(preset, "q4_0"))
    )
    same = torch.stack([((picks4[il] == p) & (picks8[il] == p)).all(dim=-1) for il, p in ref_picks.items()]).all(dim=0)
    ratio = (e4 / e8)[same] / STEP_RATIO
    assert same.sum() >= 32 and ratio.min() > 0.5 and ratio.max() < 2 and 0.75 < ratio.median() < 1.25, (
        f"q4_0 / q8_0 over {STEP_RATIO:.1f}: min {ratio.min():.2f}, median {ratio.median():.2f}, max {ratio.max():.2f}"
    )
