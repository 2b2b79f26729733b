"""Weights uploaded from the mapped file page-locked in place for the copy, then unlocked."""

from __future__ import annotations

import pytest
import torch

from moestream.formats.gguf import GGUFFile, torch_bytes
from moestream.offload.host import PinnedRanges, locked_for_upload

pytestmark = pytest.mark.gpu


def test_an_upload_under_the_lock_gives_the_file_bytes_and_leaves_the_pages_unlocked(model_file):
    with GGUFFile(model_file("tiny", "Q4_K_M")) as f:
        views = list(f.tensors.values())
        with locked_for_upload([v.data for v in views], torch.device("cuda")) as fast:
            assert fast, "page-locking the mapped file was refused"
            up = [torch_bytes(v).to("cuda", non_blocking=True) for v in views]
        assert all(torch.equal(u.cpu(), torch_bytes(v)) for u, v in zip(up, views, strict=True))
        again = PinnedRanges()  # CUDA refuses to register pages that are still registered
        assert again.register([v.data for v in views], warn=False)
        again.unregister()
