"""make-model --routing trained: a file routes like a trained model (the preset's targets, measured on the shipped
English text) and a slice like the same layers of a deeper file.

The presets' real shapes take minutes to generate and run on this CPU, so these files scale them down
(trained_routing.calibration_preset: hidden 256, 4 heads, expert FFN 64, the test vocabulary, fewer delta-net
heads) and keep what routing depends on: the experts and how many a token uses, head sizes, rope and the routing
settings (looked up by the preset's name). qwen3.6-35b-a3b's slice of 5 layers holds its first attention layer."""

from __future__ import annotations

import math

import pytest
import torch

import moestream
from moestream.tools.routing_stats import layer_routing, routing_report
from moestream.tools.synthetic import make_model
from moestream.tools.tokens import text_tokens
from moestream.tools.trained_routing import ROUTING, calibration_preset

N_TOKENS = 800
SLICES = {"qwen3-30b-a3b": 3, "qwen3.6-35b-a3b": 5}  # a slice's layers, against a file of 8
UNIFORM_GUESS = {"qwen3-30b-a3b": 0.93, "qwen3.6-35b-a3b": 0.83}  # uniform routing's guess is above (its
# updates are damped by the depth: a 3-layer file's less)


def report(path):
    engine = moestream.load(str(path), device="cpu", progress=False)
    try:
        return routing_report(engine, text_tokens(engine, limit=N_TOKENS))
    finally:
        engine.close()


@pytest.fixture(scope="module", params=list(SLICES))
def preset(request):
    return request.param


@pytest.fixture(scope="module")
def slices(preset, tmp_path_factory):
    """The routing of a slice and of an 8-layer file of the same preset."""
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for layers in (SLICES[preset], 8):
        path = root / f"{layers}.gguf"
        make_model(path, calibration_preset(preset, layers), quant="F32", progress=False)  # trained: the default
        out[layers] = report(path)
    return out


def test_a_slice_hits_the_presets_targets(preset, slices):
    targets = ROUTING[preset].targets
    r = slices[8]
    later = [x for x in r.layers if x.layer >= 2]  # layer 1's guess reads the embedding alone (docs/routing.md)
    guess = sum(x.guess for x in later) / len(later)
    reuse = sum(x.reuse for x in r.layers) / len(r.layers)
    print(f"guess {guess:.3f} reuse {reuse:.3f} top shares {[round(x.top_share, 3) for x in r.layers]}")
    assert abs(guess - targets.guess) <= 0.03
    assert abs(reuse - targets.reuse) <= 0.07
    assert all(0.28 <= x.top_share <= 0.50 for x in r.layers[1:])
    first = r.layers[0]  # near uniform: as random weights route English text (its frequent tokens aside)
    assert first.top_share < 0.27 and first.entropy > 0.95 * math.log2(r.n_expert)
    assert all(x.guess_wide >= x.guess for x in r.layers[1:])


def test_a_slice_routes_like_the_same_layers_of_a_deeper_file(preset, slices):
    n = SLICES[preset]
    assert slices[n].layers == slices[8].layers[:n]


def test_uniform_routing_is_far_from_the_targets(preset, tmp_path):
    """The same shapes without the planted structures: what the statistics were before (a check that they
    measure something the generator changes)."""
    make_model(tmp_path / "u.gguf", calibration_preset(preset, 3), quant="F32", progress=False, routing="uniform")
    r = report(tmp_path / "u.gguf")
    assert all(x.reuse < 0.12 and x.top_share < 0.27 for x in r.layers)
    assert all(x.guess > UNIFORM_GUESS[preset] for x in r.layers[1:])


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
