"""Choosing the next token: greedy, or temperature with top-k / top-p, reproducible with a seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise MoestreamError(f"-n {self.max_tokens}: the number of tokens to generate must be >= 0")
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise MoestreamError("--temp and --top-p must be finite numbers")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise MoestreamError(f"--seed {self.seed}: must fit in 64 bits")
        if self.temperature < 0:
            raise MoestreamError(f"--temp {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise MoestreamError(f"--top-k {self.top_k}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise MoestreamError(f"--top-p {self.top_p}: must be in (0, 1]")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token from logits [V] (on any device; sampled on the CPU for reproducibility)."""
        p = self.params
        logits = logits.float().cpu()  # sync: one token per step must reach the host anyway
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = (logits - logits.max()) / p.temperature  # from the top down: a tiny temperature gives -inf, not inf
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, idx = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
            keep[0] = True  # the most likely token, even for a top_p below float32's smallest number
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
