"""The token embedding stays in the mapped file: a prompt needs only its own rows, dequantized on the device."""

from __future__ import annotations

import torch

from moestream.formats.gguf import TensorView, torch_bytes
from moestream.kernels.dequant import dequantize


class HostEmbedding:
    """Rows of token_embd for given token ids, on the compute device (llama.cpp keeps it on the CPU too)."""

    def __init__(self, view: TensorView, device: torch.device, dtype: torch.dtype):
        self.view, self.device, self.dtype = view, device, dtype
        self.raw = torch_bytes(view)  # [n_vocab, row_bytes], a view of the map

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.raw[tokens.cpu()].to(self.device)  # the stored rows only: ~1 KiB a token
        return dequantize(rows, self.view.qtype, (rows.shape[0], self.view.shape[1]), self.dtype)
