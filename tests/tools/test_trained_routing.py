"""make-model --routing trained: a file routes like a trained model (the preset's targets, measured on the shipped
English text) and a slice like the same layers of a deeper file.

qwen3-30b-a3b's real shapes take minutes to generate and run on this CPU, so these files scale it down (hidden
256, 4 heads of its 128 channels, expert FFN 64, the test vocabulary) and keep what routing depends on: its 128
experts choosing 8, its head size and rope base, and its routing settings (looked up by the preset's name)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import moestream
from moestream.tools.presets import get_preset
from moestream.tools.routing_stats import layer_routing, routing_report, text_tokens
from moestream.tools.synthetic import make_model
from moestream.tools.trained_routing import ROUTING

PRESET = "qwen3-30b-a3b"
TARGETS = ROUTING[PRESET].targets
N_TOKENS = 800


def scaled(layers: int):
    p = get_preset(PRESET, layers)
    small = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=64, n_vocab=1280)
    return replace(p, spec=replace(p.spec, **small), n_ff=64)


def report(path):
    engine = moestream.load(str(path), device="cpu", progress=False)
    try:
        return routing_report(engine, text_tokens(engine, limit=N_TOKENS))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def slices(tmp_path_factory):
    """The routing of a 3-layer and of an 8-layer file of the same preset."""
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for layers in (3, 8):
        make_model(root / f"{layers}.gguf", scaled(layers), quant="F32", progress=False)  # trained: the default
        out[layers] = report(root / f"{layers}.gguf")
    return out


def test_a_slice_hits_the_presets_targets(slices):
    r = slices[8]
    later = [x for x in r.layers if x.layer >= 2]  # layer 1's guess reads the embedding alone (docs/routing.md)
    guess = sum(x.guess for x in later) / len(later)
    reuse = sum(x.reuse for x in r.layers) / len(r.layers)
    print(f"guess {guess:.3f} reuse {reuse:.3f} top shares {[round(x.top_share, 3) for x in r.layers]}")
    assert abs(guess - TARGETS.guess) <= 0.03
    assert abs(reuse - TARGETS.reuse) <= 0.07
    assert all(0.28 <= x.top_share <= 0.50 for x in r.layers[1:])
    first = r.layers[0]  # near uniform: as random weights route English text (its frequent tokens aside)
    assert first.top_share < 0.27 and first.entropy > 0.95 * math.log2(r.n_expert)
    assert all(x.guess_wide >= x.guess for x in r.layers[1:])


def test_a_slice_routes_like_the_same_layers_of_a_deeper_file(slices):
    assert slices[3].layers == slices[8].layers[:3]


def test_uniform_routing_is_far_from_the_targets(tmp_path):
    """The same shapes without the planted structures: what the statistics were before (a check that they
    measure something the generator changes)."""
    make_model(tmp_path / "u.gguf", scaled(3), quant="F32", progress=False, routing="uniform")
    r = report(tmp_path / "u.gguf")
    assert all(x.reuse < 0.12 and x.top_share < 0.27 for x in r.layers)
    assert all(x.guess > 0.93 for x in r.layers[1:])


def test_the_statistics_of_picks_worked_by_hand():
    # 3 tokens, 2 picks of 10 experts; the guess ranks 3 (1.5 x 2)
    ids = torch.tensor([[0, 1], [1, 2], [1, 2]])
    guess = torch.tensor([[0, 5, 1], [2, 5, 6], [9, 8, 7]])
    x = layer_routing(4, ids, 10, guess)
    assert x.guess == pytest.approx(2 / 6)  # token 0: 0 named; token 1: 2; token 2: none at width 2
    assert x.guess_wide == pytest.approx(3 / 6)  # width 3 adds token 0's expert 1
    assert x.reuse == pytest.approx(3 / 4)  # 1 of 2, then 2 of 2
    assert x.top_share == pytest.approx(3 / 6)  # top 10% of 10 experts: expert 1, picked 3 times of 6
    p = torch.tensor([1, 3, 2]) / 6
    assert x.entropy == pytest.approx(float(-(p * p.log2()).sum()))
