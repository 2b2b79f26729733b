"""Dense weights on the compute device, kept the way the file stores them.

Plain float tensors (norms, routers) are dequantized once at load. Quantized ones (attention projections,
the output head) stay as their stored blocks and are dequantized each time a layer reads them: in VRAM they
take what llama.cpp's take (a Q4_K_M Qwen3-30B-A3B's dense part: ~0.8 GiB instead of ~2.3 GiB in bf16), at
the cost of one small dequantization per projection per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from moestream.formats import quants
from moestream.formats.gguf import TensorView, torch_bytes
from moestream.offload.host import locked_for_upload
from moestream.ops.linear import Stored, Weight

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


class DenseWeights(Mapping[str, torch.Tensor]):
    """name -> tensor in the compute dtype (float32 for the names in `float32`), as a model reads it."""

    def __init__(
        self,
        views: dict[str, TensorView],
        device: torch.device,
        dtype: torch.dtype,
        progress: bool = False,
        float32: frozenset[str] = frozenset(),
    ):
        self.device, self.dtype = torch.device(device), dtype
        self._floats: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, Stored] = {}
        for name, v in tqdm(views.items(), desc="load", unit="tensor", disable=not progress, leave=False):
            with locked_for_upload([v.data], self.device) as fast:
                raw = torch_bytes(v).to(device, non_blocking=fast)  # the stored bytes; dequantized on the device
            if v.qtype in FLOAT_TYPES:
                out = torch.float32 if name in float32 else dtype
                self._floats[name] = quants.dequantize(raw, v.qtype, v.shape, out)
            else:
                self._blocks[name] = Stored(raw, v.qtype, v.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._floats:
            return self._floats[name]
        return self._blocks[name].dequantize(self.dtype)

    def stored(self, name: str) -> Weight:
        """Weight `name` as the ops multiply it: a float tensor, or its stored blocks (not dequantized)."""
        return self._floats[name] if name in self._floats else self._blocks[name]

    def __contains__(self, name: object) -> bool:
        return name in self._floats or name in self._blocks  # without dequantizing anything

    def join(self, names: list[str]) -> torch.Tensor:
        """Float tensors of the same rows side by side [R, sum of widths], replacing them: each name then reads
        its columns of the one tensor (so one gather of rows serves all; the bytes held stay the same)."""
        joined = torch.cat([self._floats[name] for name in names], dim=1)
        widths = [self._floats[name].shape[1] for name in names]
        self._floats.update(zip(names, joined.split(widths, dim=1), strict=True))
        return joined

    def __iter__(self) -> Iterator[str]:
        yield from self._floats
        yield from self._blocks

    def __len__(self) -> int:
        return len(self._floats) + len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Device bytes held: what the VRAM budget counts."""
        floats = sum(t.numel() * t.element_size() for t in self._floats.values())
        return floats + sum(raw.numel() for raw, _, _ in self._blocks.values())
