"""Engine options: one dataclass the CLI, the Python API and the server all fill, checked once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineOptions:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    ubatch: int = 512  # tokens per prefill micro-batch
    n_ctx: int = 4096  # context size (clipped to the model's training context)
    progress: bool = True  # progress bars for load and long prefill

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise MoestreamError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise MoestreamError(f"--device {self.device}: expected cpu, cuda or cuda:N")
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPES:
            raise MoestreamError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        if self.ubatch < 1:
            raise MoestreamError(f"--ubatch {self.ubatch}: must be at least 1")
        if self.n_ctx < 1:
            raise MoestreamError(f"--ctx {self.n_ctx}: must be at least 1")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
