"""A layer's expert stacks as the file stores them: sizes, host bytes, and how to hand them to a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.formats.gguf import TensorView, torch_bytes
from moestream.kernels.dequant import dequantize
from moestream.kernels.gather import RowGather
from moestream.ops.experts import Dequantize, StoredExperts
from moestream.profiling.timeline import NULL, Timeline


@dataclass(frozen=True)
class ExpertTensors:
    """One layer's gate, up and down stacks as stored in the file."""

    views: tuple[TensorView, TensorView, TensorView]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    @property
    def n_expert(self) -> int:
        return self.views[0].shape[0]

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one expert (its gate, up and down rows)."""
        return self.nbytes // self.n_expert

    def host_bytes(self) -> list[torch.Tensor]:
        return [torch_bytes(v) for v in self.views]

    def dequantizer(
        self,
        raws: list[torch.Tensor],
        dtype: torch.dtype,
        timeline: Timeline = NULL,
        layer: int | None = None,
        pick: RowGather | None = None,
        kept: dict[int, torch.Tensor] | None = None,
    ) -> Dequantize:
        """How the model's MoE makes stack s of stored bytes `raws` (on any device) dense, all of it or the rows
        it names (picked by `pick`, the owner's picker: needed with rows), as a "dequant" span. Whole stacks
        are taken from and left in kept, where given."""

        def dequantized(s: int, rows: torch.Tensor | None) -> torch.Tensor:
            keep = kept is not None and rows is None
            if keep and s in kept:
                return kept[s]
            start = timeline.stamp()
            raw, v = raws[s], self.views[s]
            picked = raw if rows is None else pick(raw, rows)  # raw may hold just some experts
            out = dequantize(picked, v.qtype, (picked.shape[0], *v.shape[1:]), dtype)
            timeline.add("compute", "dequant", start, timeline.stamp(), layer=layer)
            if keep:
                kept[s] = out
            return out

        return dequantized

    def stored(
        self,
        raws,
        ids: torch.Tensor,
        dtype: torch.dtype,
        timeline: Timeline,
        layer: int,
        pick: RowGather,
        kept: dict[int, torch.Tensor] | None = None,
        **how,
    ) -> StoredExperts:
        """What the model's MoE gets: raws (gate, up, down bytes) with ids [T, K] indexing their rows; kept: see
        dequantizer."""
        raws = list(raws)
        return StoredExperts(
            tuple(raws),
            tuple(v.qtype for v in self.views),
            tuple(v.shape for v in self.views),
            ids,
            self.dequantizer(raws, dtype, timeline, layer, pick, kept),
            **how,
        )
