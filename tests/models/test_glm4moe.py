"""glm4moe against transformers' Glm4MoeForCausalLM on the same weights, plus its file conventions."""

from __future__ import annotations

import pytest
from reference import assert_matches_reference, glm4moe_reference

PRESETS = ("tiny-glm4moe", "tiny-glm4moe-odd")


@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
@pytest.mark.parametrize("preset", PRESETS)
def test_logits_and_greedy_match_transformers(model_file, preset, quant):
    """A dense first layer (two in the odd one), a shared expert, half of each head rotated, a NextN block the
    engine skips; the odd preset routes in groups and has no q/k norms."""
    path = model_file(preset, quant)
    assert_matches_reference(path, glm4moe_reference(path), f"{preset} {quant}")
