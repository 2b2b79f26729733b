"""Stored blocks over every bit pattern of a type, for the kernel tests: random bytes, blocks with every bit set
and none set, and scale fields that decode to finite values."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# Byte offsets of each type's scale fields: fp16 ones (random bytes there would be NaN or inf), E8M0 ones (kept
# near 127: random ones reach 2**127 and overflow)
F16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q5_K: (0, 2),
    Q.MXFP4: (),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,),
    Q.TQ2_0: (64,),
}
E8M0_FIELDS = {Q.MXFP4: (0,)}
K_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # the types with kernel tests of their own, for the tests that cover all


def bit_patterns(rng: np.random.Generator, qtype: Q, rows: tuple[int, ...], n_in: int) -> np.ndarray:
    """Rows of qtype over all its bit patterns: uint8 [*rows, row bytes]."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(*rows, n_in // block, size), dtype=np.uint8)
    flat = b.reshape(-1, size)
    flat[0::5], flat[1::5] = 0xFF, 0x00
    for at in {**F16_FIELDS, **K_FIELDS}[qtype]:
        d = (rng.standard_normal(len(flat)) * rng.choice([0.01, 1.0], len(flat))).astype(np.float16)
        flat[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    for at in E8M0_FIELDS.get(qtype, ()):
        flat[:, at] = rng.integers(127 - 8, 127 + 8, len(flat))
    return b.reshape(*rows, -1)
