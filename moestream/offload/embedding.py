"""The token embedding stays in the mapped file: a prompt needs only its own rows, dequantized on the CPU."""

from __future__ import annotations

import torch

from moestream.formats import quants
from moestream.formats.gguf import TensorView, torch_bytes


class HostEmbedding:
    """Rows of token_embd for given token ids, on the compute device (llama.cpp keeps it on the CPU too)."""

    def __init__(self, view: TensorView, device: torch.device, dtype: torch.dtype):
        self.view, self.device, self.dtype = view, device, dtype
        self.raw = torch_bytes(view)  # [n_vocab, row_bytes], a view of the map

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.raw[tokens.cpu()]
        x = quants.dequantize(rows, self.view.qtype, (rows.shape[0], self.view.shape[1]), self.dtype)
        return x.to(self.device, non_blocking=False)
