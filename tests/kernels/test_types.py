"""Which kernels each tensor type lacks on a device: the fallbacks `info` names."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from grid_patterns import GRID_TYPES

from moestream.errors import MoestreamError
from moestream.formats import quants
from moestream.kernels import types
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


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.MXFP4], ids=lambda t: t.name
)
def test_finished_types_lack_nothing(qtype):
    assert types.missing(qtype, "cpu") == [] and types.missing(qtype, "cuda") == []


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED - types.FLOATS), ids=lambda t: t.name)
def test_fallbacks_are_what_each_tensor_lacks_of_the_kernels_it_wants(qtype):
    """On the CPU an expert stack wants the CPU dot and a dense weight nothing; on a GPU both want the tile and
    the dot (the experts also the CPU dot, for experts computed on the host)."""
    qtypes = {"dense.weight": qtype, "exps.weight": qtype}
    on_cpu = {(qtype, k): ["exps.weight"] for k in types.missing(qtype, "cpu")}
    assert types.fallbacks(qtypes, {"exps.weight"}, "cpu") == on_cpu
    if triton is not None:
        on_gpu = {(qtype, k): ["dense.weight", "exps.weight"] for k in types.missing(qtype, "cuda")}
        assert types.fallbacks(qtypes, {"exps.weight"}, "cuda") == on_gpu | on_cpu


def test_float_weights_lack_nothing():
    qtypes = {"a.weight": Q.F32, "b.weight": Q.BF16, "c.weight": Q.F16}
    assert types.fallbacks(qtypes, set(qtypes), "cpu") == types.fallbacks(qtypes, set(qtypes), "cuda") == {}


def test_an_unknown_type_is_a_clear_error():
    with pytest.raises(MoestreamError, match="tensor type Q8_K is not supported"):
        types.missing(Q.Q8_K, "cpu")
