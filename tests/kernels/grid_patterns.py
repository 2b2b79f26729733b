"""Blocks of the IQ grid types over every grid row, every sign pattern (IQ1: both delta signs) and every scale
field, with d of both signs and mixed magnitudes (and one 0): the kernels' tests read them."""

from __future__ import annotations

import gguf
import numpy as np

from moestream.formats.grid_quantize import SPECS, Fields, pack
from moestream.formats.quants.grids import grid_values

Q = gguf.GGMLQuantizationType
GRID_TYPES = list(SPECS)
_KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
_DELTAS = {Q.IQ1_S: 8, Q.IQ1_M: 32}  # delta sign fields a block


def grid_blocks(qtype: Q, n_blocks: int, seed: int = 0) -> np.ndarray:
    """n_blocks blocks [n_blocks, type_size]; every row, pattern and scale appears once n_blocks reaches 64."""
    rng = np.random.default_rng(seed)
    spec = SPECS[qtype]
    rows, width = grid_values(qtype).shape
    d = (rng.standard_normal(n_blocks) * rng.choice([0.01, 1.0], n_blocks)).astype(np.float16).astype(np.float32)
    d[0] = 0
    scales = np.resize(np.arange(spec.scale_max + 1, dtype=np.uint8), (n_blocks, 256 // spec.per_scale))
    index = np.resize(np.arange(rows), (n_blocks, 256 // width))
    if qtype in _DELTAS:
        signs = rng.integers(0, 2, (n_blocks, _DELTAS[qtype]), dtype=np.uint8)
    else:
        signs = np.resize(_KSIGNS if spec.parity else np.arange(256, dtype=np.uint8), (n_blocks, 32))
    return pack(qtype, Fields(d, scales, index, signs))
