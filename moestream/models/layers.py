"""What every layer of every architecture is told about its micro-batch, what it keeps between passes, and
what it reads its dense weights from.

Legend: T = tokens in the micro-batch, rot_dim = the channels RoPE turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moestream.ops.linear import Weight


class Weights(Protocol):
    """A model's dense weights on the compute device (offload/dense.py's DenseWeights): `weights[name]` is the
    tensor in the compute dtype, `stored(name)` the weight as the ops multiply it (quantized blocks stay so)."""

    device: torch.device

    def __getitem__(self, name: str) -> torch.Tensor: ...

    def stored(self, name: str) -> Weight: ...

    def __contains__(self, name: object) -> bool: ...  # whether the file has it (optional tensors)

    def join(self, names: list[str]) -> torch.Tensor: ...  # float tensors of the same rows as one [R, widths]


class Cache(Protocol):
    """A sequence's state between passes: `kv.update(il, pos0, k, v)` for attention layers and
    `recurrent[il]` for layers that carry a state (delta-net). A batch with `rows` comes with a list of
    caches instead, one per row."""

    kv: Any
    recurrent: dict[int, Any]


@dataclass(frozen=True)
class Batch:
    """What every layer needs to know about the micro-batch: where it starts and its rotary tables.

    A static batch (n_keys set) is one whose shapes and host values do not change from step to step, so a
    captured CUDA graph can replay it: the positions live only on the device, the KV cache is written at
    them and attention reads the first n_keys cache rows, masking those past each token's position.
    """

    pos0: int  # first position (dynamic batches; -1 in a static one, where the host does not know it)
    cos: torch.Tensor  # [T, rot_dim/2]
    sin: torch.Tensor
    positions: torch.Tensor  # [T] int64 on the compute device
    n_keys: int | None = None  # static batches: cache rows attention reads
    rows: tuple[Batch, ...] = ()  # one token of each of several sequences: each row's own static batch
