"""moestream: run MoE GGUF models bigger than the GPU by streaming experts, overlapped with compute."""

from moestream.runtime.engine import Engine, Generation
from moestream.runtime.loader import load
from moestream.runtime.sampling import SamplingParams

__all__ = ["load", "Engine", "Generation", "SamplingParams"]
