"""Shared fixtures: generated models, written once per test session."""

from __future__ import annotations

import pytest
import torch

from moestream.models.presets import get_preset
from moestream.models.synthetic import make_model


@pytest.fixture(scope="session")
def model_file(tmp_path_factory):
    """model_file(preset, quant) -> path of a generated GGUF, cached for the session."""
    made: dict[tuple[str, str, int | None], str] = {}
    root = tmp_path_factory.mktemp("models")

    def get(preset: str = "tiny", quant: str = "F32", layers: int | None = None) -> str:
        key = (preset, quant, layers)
        if key not in made:
            path = root / f"{preset}-{quant}-{layers}.gguf"
            make_model(path, get_preset(preset, layers), quant=quant, seed=1, progress=False)
            made[key] = str(path)
        return made[key]

    return get


@pytest.fixture
def one_thread():
    """Tiny tensors and timing tests: intra-op threads only add spin-wait contention on a busy 2-core box."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
