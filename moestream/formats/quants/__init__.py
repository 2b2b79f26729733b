"""GGUF tensor types: one entry per type (registry.py) holding its block layout, the family module of its torch
reference and the names of its kernels; the families' references in floats.py, legacy.py, k_quants.py,
microscaling.py, grids.py, nonlinear.py and ternary.py. Importing this package imports no torch: `dequantize`
(reference.py) loads it on first use."""

from moestream.formats.quants.registry import SUPPORTED, TYPES, get
from moestream.formats.quants.tensor_type import TensorType, row_bytes

__all__ = ["SUPPORTED", "TYPES", "TensorType", "dequantize", "get", "row_bytes"]


def __getattr__(name: str):
    if name == "dequantize":
        from moestream.formats.quants.reference import dequantize

        return dequantize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
