"""Which kernels each tensor type lacks on a device: the fallbacks `info` names."""

from __future__ import annotations

import dataclasses

import pytest
from gguf import GGMLQuantizationType as Q
from grid_patterns import GRID_TYPES

from moestream.errors import MoestreamError
from moestream.formats import quants
from moestream.kernels import dequant, dots, types
from moestream.kernels.launch import triton


def test_types_name_what_they_lack_on_the_cpu():
    assert all(types.missing(qtype, "cpu") == [] for qtype in GRID_TYPES)
    assert types.missing(Q.Q4_K, "cpu") == [] and types.missing(Q.Q8_0, "cpu") == []
    assert types.missing(Q.BF16, "cpu") == ["CPU dot"]  # a float weight: torch multiplies it


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_types_name_what_they_lack_on_a_gpu():
    assert types.missing(Q.Q4_K, "cuda") == [] and types.missing(Q.Q6_K, "cuda:1") == []
    assert types.missing(Q.BF16, "cuda") == ["Triton dequant tile"]  # its float dot reads it
    assert set(types.missing(Q.Q2_K, "cuda")) <= set(types.FALLBACKS)
    for qtype in GRID_TYPES:
        assert types.missing(qtype, "cuda") == [], qtype.name


def test_every_supported_type_has_its_kernels():
    """No tensor type of a supported file falls back to torch: each block type has its tile, dot and C block."""
    model = {q.name: q for q in quants.SUPPORTED}
    assert types.fallbacks(model, set(model), "cpu") == {}
    if triton is not None:
        assert types.fallbacks(model, set(model), "cuda") == {}


# Every supported type has its kernels (above), so the two tests below take one away to see it reported
def without_cpu_dot(monkeypatch, qtype: Q) -> None:
    monkeypatch.setitem(quants.TYPES, qtype, dataclasses.replace(quants.TYPES[qtype], cpu_dot=None))


def test_fallbacks_on_the_cpu_are_expert_stacks_without_a_cpu_dot(monkeypatch):
    without_cpu_dot(monkeypatch, Q.Q5_K)
    qtypes = {"a.weight": Q.Q5_K, "e.weight": Q.Q5_K, "f.weight": Q.Q4_K, "n.weight": Q.F32, "g.weight": Q.F32}
    assert types.fallbacks(qtypes, {"e.weight", "f.weight", "g.weight"}, "cpu") == {(Q.Q5_K, "CPU dot"): ["e.weight"]}


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_fallbacks_on_a_gpu_are_every_tensor_without_its_kernels(monkeypatch):
    without_cpu_dot(monkeypatch, Q.Q3_K)
    monkeypatch.setattr(dequant, "TILES", {q: t for q, t in dequant.TILES.items() if q != Q.Q3_K})
    monkeypatch.setattr(dots, "DOTS", {q: d for q, d in dots.DOTS.items() if q != Q.Q3_K})
    qtypes = {"q.weight": Q.Q3_K, "k.weight": Q.Q4_K, "exps.weight": Q.Q3_K, "b.weight": Q.BF16}
    assert types.fallbacks(qtypes, {"exps.weight"}, "cuda") == {
        (Q.Q3_K, "Triton dequant tile"): ["q.weight", "exps.weight"],
        (Q.Q3_K, "decode block dot"): ["q.weight", "exps.weight"],
        (Q.Q3_K, "CPU dot"): ["exps.weight"],
    }


def test_an_unknown_type_is_a_clear_error():
    with pytest.raises(MoestreamError, match="tensor type Q8_K is not supported"):
        types.missing(Q.Q8_K, "cpu")
