"""Every supported tensor type, by GGML type: adding one is an entry here, its reference in its family's module
(REFERENCES) and its kernels. Nothing here imports torch (`info` reads a file's types without it)."""

from __future__ import annotations

from gguf import GGMLQuantizationType
from gguf import GGMLQuantizationType as Q

from moestream.errors import MoestreamError
from moestream.formats.quants.tensor_type import TensorType

ENTRIES = (
    # floats.py: the decode matvec reads a float weight (the router, a shared-expert gate) in blocks of its own
    TensorType(Q.F32, "floats", dot="f32_dot"),
    TensorType(Q.F16, "floats", dot="f16_dot"),
    TensorType(Q.BF16, "floats", dot="bf16_dot"),
    # legacy.py
    TensorType(Q.Q8_0, "legacy", tile="q8_0_tile", dot="q8_0_dot", cpu_dot="q8_0_block"),
    TensorType(Q.Q4_0, "legacy", tile="q4_0_tile", dot="q4_0_dot", cpu_dot="q4_0_block"),
    TensorType(Q.Q4_1, "legacy", tile="q4_1_tile", dot="q4_1_dot", cpu_dot="q4_1_block"),
    TensorType(Q.Q5_0, "legacy", tile="q5_0_tile", dot="q5_0_dot", cpu_dot="q5_0_block"),
    TensorType(Q.Q5_1, "legacy", tile="q5_1_tile", dot="q5_1_dot", cpu_dot="q5_1_block"),
    # k_quants.py
    TensorType(Q.Q2_K, "k_quants", tile="q2_k_tile", dot="q2_k_dot", cpu_dot="q2_k_block"),
    TensorType(Q.Q3_K, "k_quants", tile="q3_k_tile", dot="q3_k_dot", cpu_dot="q3_k_block"),
    TensorType(Q.Q4_K, "k_quants", tile="q4_k_tile", dot="q4_k_dot", cpu_dot="q4_k_block"),
    TensorType(Q.Q5_K, "k_quants", tile="q5_k_tile", dot="q5_k_dot", cpu_dot="q5_k_block"),
    TensorType(Q.Q6_K, "k_quants", tile="q6_k_tile", dot="q6_k_dot", cpu_dot="q6_k_block"),
    # microscaling.py
    TensorType(Q.MXFP4, "microscaling", tile="mxfp4_tile", dot="mxfp4_dot", cpu_dot="mxfp4_block"),
    # grids.py: the IQ grid types (their tile and dot read the family's kernel_table)
    TensorType(Q.IQ2_XXS, "grids", tile="iq2_xxs_tile", dot="iq2_xxs_dot", cpu_dot="iq2_xxs_block"),
    TensorType(Q.IQ2_XS, "grids", tile="iq2_xs_tile", dot="iq2_xs_dot", cpu_dot="iq2_xs_block"),
    TensorType(Q.IQ2_S, "grids", tile="iq2_s_tile", dot="iq2_s_dot", cpu_dot="iq2_s_block"),
    TensorType(Q.IQ3_XXS, "grids", tile="iq3_xxs_tile", dot="iq3_xxs_dot", cpu_dot="iq3_xxs_block"),
    TensorType(Q.IQ3_S, "grids", tile="iq3_s_tile", dot="iq3_s_dot", cpu_dot="iq3_s_block"),
    TensorType(Q.IQ1_S, "grids", tile="iq1_s_tile", dot="iq1_s_dot", cpu_dot="iq1_s_block"),
    TensorType(Q.IQ1_M, "grids", tile="iq1_m_tile", dot="iq1_m_dot", cpu_dot="iq1_m_block"),
    # nonlinear.py
    TensorType(Q.IQ4_NL, "nonlinear", tile="iq4_nl_tile", dot="iq4_nl_dot", cpu_dot="iq4_nl_block"),
    TensorType(Q.IQ4_XS, "nonlinear", tile="iq4_xs_tile", dot="iq4_xs_dot", cpu_dot="iq4_xs_block"),
    # ternary.py
    TensorType(Q.TQ1_0, "ternary", tile="tq1_0_tile", dot="tq1_0_dot", cpu_dot="tq1_0_block"),
    TensorType(Q.TQ2_0, "ternary", tile="tq2_0_tile", dot="tq2_0_dot", cpu_dot="tq2_0_block"),
)
TYPES: dict[GGMLQuantizationType, TensorType] = {t.qtype: t for t in ENTRIES}
SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(TYPES)


def get(qtype: GGMLQuantizationType) -> TensorType:
    """The entry of qtype, or a clear error naming the supported types."""
    entry = TYPES.get(qtype)
    if entry is None:
        name, names = getattr(qtype, "name", qtype), ", ".join(t.name for t in sorted(SUPPORTED))
        raise MoestreamError(f"tensor type {name} is not supported (supported: {names})")
    return entry
