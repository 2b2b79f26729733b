"""GGUF tensor types: one entry per type (registry.py) holding its block layout, its torch reference dequant
and the names of its kernels; the families' references in floats.py, legacy.py, k_quants.py, microscaling.py,
grids.py, nonlinear.py and ternary.py."""

from moestream.formats.quants.reference import dequantize
from moestream.formats.quants.registry import SUPPORTED, TYPES, get
from moestream.formats.quants.tensor_type import TensorType, row_bytes

__all__ = ["SUPPORTED", "TYPES", "TensorType", "dequantize", "get", "row_bytes"]
