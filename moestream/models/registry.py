"""Architectures moestream runs, keyed by GGUF `general.architecture`: each one's file layout (torch-free: tensor
names and shapes, what `info`, the loader and placement read) and its model module (the math: Model, state_bytes;
imports torch)."""

from __future__ import annotations

import importlib
from types import ModuleType

from moestream.errors import MoestreamError
from moestream.models.layouts import glm4moe, gpt_oss, qwen3moe, qwen35moe

LAYOUTS: dict[str, ModuleType] = {m.ARCH: m for m in (qwen3moe, qwen35moe, gpt_oss, glm4moe)}


def layout(name: str, path: object = "") -> ModuleType:
    """What a file of architecture `name` holds (models/layouts/), or a clear error naming those supported."""
    try:
        return LAYOUTS[name]
    except KeyError:
        where = f"{path}: " if path else ""
        raise MoestreamError(
            f"{where}architecture {name!r} is not supported (supported: {', '.join(sorted(LAYOUTS))})"
        ) from None


def architecture(name: str, path: object = "") -> ModuleType:
    """The model module of architecture `name` (models/<module>.py, named as its layout's): Model and
    state_bytes; names and shapes are its layout's."""
    module = layout(name, path).__name__.rsplit(".", 1)[1]
    return importlib.import_module(f"moestream.models.{module}")
