"""The prompt cache on a GPU: KV rows and delta-net states copied on the device and back from host RAM, with the
decode steps captured against the caches still replaying, give a cold prefill's logits and tokens."""

from __future__ import annotations

import pytest
from test_prompt_cache import GREEDY, PRESETS, UB, ask, check_warm_logits, serving

import moestream

pytestmark = pytest.mark.gpu


def load(model_file, preset: str, **kw):
    return moestream.load(model_file(preset, "Q4_K_M"), device="cuda", progress=False, ubatch=UB, n_ctx=256, **kw)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("n_cpu_moe", [0, "all"])
def test_follow_ups_answer_as_cold_with_captured_steps(model_file, preset, n_cpu_moe):
    """In place (its captured decode steps replay over the restored rows and state), from host RAM, and from
    a running sequence: each answer is the cold one."""
    engine = load(model_file, preset, n_cpu_moe=n_cpu_moe)
    first = list(range(50, 69))
    follow = first + [3, 4, 5, 6, 7, 8]
    other = list(range(90, 101))
    want = {tuple(p): engine.generate(p, GREEDY).text for p in (first, follow, other)}
    with serving(engine, max_seqs=2) as s:
        assert ask(s, first).text == want[tuple(first)]
        b = ask(s, follow)
        assert (b.text, b.cached_tokens) == (want[tuple(follow)], 16)
        ask(s, other)
        ask(s, list(range(120, 131)))  # overwrites the least recently used cache: follow's prefix to host RAM
        c = ask(s, follow)
        assert (c.text, c.cached_tokens) == (want[tuple(follow)], 24)
        assert s.prompts.stats.host_saves >= 1


@pytest.mark.parametrize("kv", ["auto", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35moe"])
def test_warm_prompt_logits_equal_cold_bit_for_bit(model_file, preset, kv):
    """In each -ctk/-ctv type (auto: bf16, the compute dtype; f16 kept as another float dtype)."""
    engine = load(model_file, preset, cache_type_k=kv, cache_type_v=kv)
    check_warm_logits(engine, list(range(200, 219)), list(range(200, 219)) + [3, 4, 5, 6, 7])
    engine.close()
