"""Which kernels each tensor type lacks on a device: the fallbacks `info` names."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from moestream.errors import MoestreamError
from moestream.kernels import types
from moestream.kernels.launch import triton


def test_types_name_what_they_lack_on_the_cpu():
    assert types.missing(Q.Q4_K, "cpu") == [] and types.missing(Q.Q8_0, "cpu") == []
    assert types.missing(Q.Q5_K, "cpu") == ["CPU dot"]


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_types_name_what_they_lack_on_a_gpu():
    assert types.missing(Q.Q4_K, "cuda") == [] and types.missing(Q.Q6_K, "cuda:1") == []
    assert types.missing(Q.BF16, "cuda") == ["Triton dequant tile"]  # its float dot reads it
    assert set(types.missing(Q.Q2_K, "cuda")) <= set(types.FALLBACKS)


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4], ids=lambda t: t.name)
def test_finished_types_lack_nothing(qtype):
    assert types.missing(qtype, "cpu") == [] and types.missing(qtype, "cuda") == []


def test_an_unknown_type_is_a_clear_error():
    with pytest.raises(MoestreamError, match="tensor type Q8_K is not supported"):
        types.missing(Q.Q8_K, "cpu")
