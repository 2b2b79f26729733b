"""moestream: run MoE GGUF models bigger than the GPU by streaming experts, overlapped with compute."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moestream.options import Options
    from moestream.runtime.engine import Engine, Generation
    from moestream.runtime.loader import load
    from moestream.runtime.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["load", "Options", "Engine", "Generation", "SamplingParams"]
_HOME = {
    "load": "runtime.loader",
    "Options": "options",
    "Engine": "runtime.engine",
    "Generation": "runtime.engine",
    "SamplingParams": "runtime.sampling",
}


def __getattr__(name: str) -> Any:
    """Import torch and the engine on first use, so `moestream --help` (and Ctrl-C at start-up) stays light."""
    if name in _HOME:
        return getattr(import_module(f"moestream.{_HOME[name]}"), name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
