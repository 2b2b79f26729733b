"""Every supported tensor type, by GGML type: adding one is a family module's TYPES entry (and its kernels)."""

from __future__ import annotations

from gguf import GGMLQuantizationType

from moestream.errors import MoestreamError
from moestream.formats.quants import floats, grids, k_quants, legacy, microscaling, nonlinear, ternary
from moestream.formats.quants.tensor_type import TensorType

FAMILIES = (
    floats,
    legacy,
    k_quants,
    microscaling,
    grids,
    nonlinear,
    ternary,
)
TYPES: dict[GGMLQuantizationType, TensorType] = {t.qtype: t for f in FAMILIES for t in f.TYPES}
SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(TYPES)


def get(qtype: GGMLQuantizationType) -> TensorType:
    """The entry of qtype, or a clear error naming the supported types."""
    entry = TYPES.get(qtype)
    if entry is None:
        name, names = getattr(qtype, "name", qtype), ", ".join(t.name for t in sorted(SUPPORTED))
        raise MoestreamError(f"tensor type {name} is not supported (supported: {names})")
    return entry
