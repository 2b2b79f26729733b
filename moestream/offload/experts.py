"""Where the MoE layer gets its experts. The model asks for layer L's output; this module decides whether
the stored bytes are already on the device (resident), arrive through the streamer (streamed), or whether
the few experts a small batch needs are cheaper to compute on the CPU straight from the map.

Every path dequantizes the stored blocks where the math runs, then calls the same grouped SwiGLU, so
resident and streamed layers give the same bits for the same micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.formats import quants
from moestream.formats.gguf import TensorView, torch_bytes
from moestream.models.layers import moe_swiglu
from moestream.offload.streamer import Streamer


@dataclass(frozen=True)
class ExpertTensors:
    """One layer's gate, up and down stacks as stored in the file."""

    views: tuple[TensorView, TensorView, TensorView]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def host_bytes(self) -> list[torch.Tensor]:
        return [torch_bytes(v) for v in self.views]

    def dequantize(self, raws: list[torch.Tensor], dtype: torch.dtype, rows: torch.Tensor | None = None):
        """(gate, up, down) in dtype from stored bytes `raws` (anywhere); rows picks experts, in that order."""
        out = []
        for raw, v in zip(raws, self.views):
            shape = v.shape
            if rows is not None:
                raw, shape = raw[rows], (rows.numel(), *v.shape[1:])
            out.append(quants.dequantize(raw, v.qtype, shape, dtype))
        return tuple(out)


class LayerExperts:
    """The ExpertSource the model calls: resident layers, streamed layers and the CPU path for small batches."""

    def __init__(self, tensors: dict[int, ExpertTensors], resident: dict[int, list[torch.Tensor]],
                 streamer: Streamer | None, dtype: torch.dtype, min_batch: int):
        self.tensors = tensors
        self.resident = resident  # il -> stored bytes on the compute device
        self.streamer = streamer
        self.dtype = dtype
        self.min_batch = min_batch
        self._stacks: tuple[int, tuple] | None = None  # last whole-layer dequantization, reused by layer-major

    def streams(self, il: int, n_tokens: int) -> bool:
        """Whether a micro-batch of n_tokens makes the streamer upload layer il."""
        return il not in self.resident and n_tokens >= self.min_batch

    def ffn(self, il: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t = self.tensors[il]
        if il in self.resident:
            return self._on_device(il, t, self.resident[il], x, weights, ids)
        if x.shape[0] < self.min_batch:
            return self._on_cpu(t, x, weights, ids)
        return self._on_device(il, t, self.streamer.acquire(il), x, weights, ids)

    def _on_device(self, il, t: ExpertTensors, raws, x, weights, ids) -> torch.Tensor:
        T, K = ids.shape
        if T * K < t.views[0].shape[0]:  # few tokens: dequantize just the chosen experts, one per pair
            pairs = ids.reshape(-1)
            stacks = t.dequantize(raws, self.dtype, rows=pairs)
            return moe_swiglu(x, weights, torch.arange(T * K, device=x.device).view(T, K), *stacks)
        if self._stacks is None or self._stacks[0] != il:
            self._stacks = None  # free the previous layer's weights before making this one's
            self._stacks = (il, t.dequantize(raws, self.dtype))
        return moe_swiglu(x, weights, ids, *self._stacks[1])

    def _on_cpu(self, t: ExpertTensors, x, weights, ids) -> torch.Tensor:
        """Compute the chosen experts on the CPU from the map: moving a few rows of x beats moving weights."""
        ids_c = ids.cpu()  # sync: the host must know which experts to read
        used = torch.unique(ids_c)
        remap = torch.full((t.views[0].shape[0],), -1, dtype=torch.long)
        remap[used] = torch.arange(used.numel())
        stacks = t.dequantize(t.host_bytes(), torch.float32, rows=used)
        out = moe_swiglu(x.float().cpu(), weights.float().cpu(), remap[ids_c], *stacks)
        return out.to(device=x.device, dtype=x.dtype)

    def begin(self, visits: list[int]) -> None:
        """The streamed layers the coming pass will visit, in order (uploads start now)."""
        if self.streamer is not None:
            self.streamer.begin(visits)

    def end_pass(self) -> None:
        """Drop cached weights between forward passes so layer-major reuse never outlives its layer."""
        self._stacks = None
        if self.streamer is not None:
            self.streamer.finish()
