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
from moestream.kernels import matvec
from moestream.kernels.dequant import dequantize

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


class DenseWeights(Mapping[str, torch.Tensor]):
    """name -> tensor in the compute dtype, as a model reads it."""

    def __init__(self, views: dict[str, TensorView], device: torch.device, dtype: torch.dtype, progress: bool = False):
        self.device, self.dtype = torch.device(device), dtype
        self._floats: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, tuple[torch.Tensor, Q, tuple[int, ...]]] = {}  # stored bytes, type, shape
        for name, v in tqdm(views.items(), desc="load", unit="tensor", disable=not progress, leave=False):
            raw = torch_bytes(v).to(device)  # upload the stored bytes; any dequantization happens on the device
            if v.qtype in FLOAT_TYPES:
                self._floats[name] = quants.dequantize(raw, v.qtype, v.shape, dtype)
            else:
                self._blocks[name] = (raw, v.qtype, v.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._floats:
            return self._floats[name]
        raw, qtype, shape = self._blocks[name]
        return dequantize(raw, qtype, shape, self.dtype)

    def reads_directly(self, x: torch.Tensor, name: str) -> bool:
        """Whether linear(x, name) multiplies from the stored blocks (no dequantized copy is made)."""
        return name in self._blocks and matvec.usable(self._blocks[name][1], x.device, x.shape[0])

    def stored(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, Q, tuple[int, ...]] | None:
        """Weight `name`'s stored bytes, type and shape, when the matvec reads them for x (else None)."""
        return self._blocks[name] if self.reads_directly(x, name) else None

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W.T; for a few tokens straight from the stored blocks, without a dequantized copy."""
        if self.reads_directly(x, name):
            raw, qtype, shape = self._blocks[name]
            return matvec.matvec(raw, qtype, shape[0], x)
        return matvec.linear_each_row(x, self[name])

    def linears(self, x: torch.Tensor, names: list[str]) -> list[torch.Tensor]:
        """[linear(x, name) for name in names]; for a few tokens on a GPU, one launch for all (q, k, v)."""
        parts = [self._matvec_part(x, name) for name in names]
        if 2 <= len(names) <= 4 and all(parts):
            return matvec.matvecs(parts, x)
        return [self.linear(x, name) for name in names]

    def _matvec_part(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, Q, int] | None:
        """What matvec.matvecs needs of weight `name` for x, if the matvec reads it (stored blocks, or a float
        weight in x's dtype)."""
        if self.reads_directly(x, name):
            raw, qtype, shape = self._blocks[name]
            return raw, qtype, shape[0]
        w = self._floats.get(name)
        if w is not None and matvec.reads_float(x, w):
            return matvec.float_part(w)
        return None

    def row_chunks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The weight [R, C] in slices of `rows` rows, each dequantized only when reached.

        For the output head: a 248k-token vocabulary in bf16 is ~1 GiB, more than the rest of a micro-batch's
        temporaries; slices keep the peak at one slice (quantized rows are whole blocks, so they slice cleanly).
        """
        if name in self._floats:
            yield from self._floats[name].split(rows)
            return
        raw, qtype, shape = self._blocks[name]
        flat = raw.reshape(-1)  # the map gives one row of bytes per weight row
        per_row = flat.numel() // shape[0]
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            yield dequantize(flat[start * per_row : (start + n) * per_row], qtype, (n, *shape[1:]), self.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._floats or name in self._blocks  # without dequantizing anything

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
