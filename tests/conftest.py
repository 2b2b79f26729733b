"""Shared fixtures: generated models, written once per test session; `gpu` tests skipped where no GPU is seen."""

from __future__ import annotations

import itertools
import mmap

import numpy as np
import pytest
import torch

from moestream.kernels.launch import INTERPRETED
from moestream.runtime import way_memory
from moestream.tools.presets import get_preset
from moestream.tools.synthetic import make_model


def pytest_collection_modifyitems(config, items):
    """`-m gpu` on a machine without CUDA: each such test says it was skipped, not a failure of its own. Under
    Triton's interpreter a test with a skipif of its own (gpu_or_interpreter) lets that decide; the rest need
    CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not (INTERPRETED and item.get_closest_marker("skipif")):
            item.add_marker(skip)


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


_WAYS = itertools.count()


@pytest.fixture(autouse=True)
def own_way_memory(monkeypatch, tmp_path_factory):
    """--small-batch auto's remembered choices (runtime/way_memory.py) are each test's own: none read from the
    user's cache or left by another test (its injected delays would choose for this one)."""
    path = tmp_path_factory.getbasetemp() / "way-memory" / f"{next(_WAYS)}.json"
    monkeypatch.setattr(way_memory, "memory_file", lambda: path)


@pytest.fixture
def one_thread():
    """Tiny tensors and timing tests: intra-op threads only add spin-wait contention on a busy 2-core box."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def own_pages():
    """copy(array) -> the array in pages of its own (an anonymous mapping). Page-locking rounds out to whole
    pages: a heap array's neighbours would be locked with it, and CUDA refuses ("invalid argument") a later
    copy from a neighbour that starts inside the locked range and runs past it. The model file's tensors are
    pages of a mapping already."""

    def copy(a: np.ndarray) -> np.ndarray:
        out = np.frombuffer(mmap.mmap(-1, max(a.nbytes, 1)), dtype=a.dtype, count=a.size).reshape(a.shape)
        out[...] = a
        return out

    return copy
