"""ModelSpec: the shapes and constants of a model, read from GGUF metadata and checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moestream.errors import MoestreamError


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    n_rot: int = 0  # rotated channels per head; 0 means all of head_dim
    n_ff_shexp: int = 0  # shared expert FFN size; 0 when the architecture has none
    extra: dict[str, Any] = field(default_factory=dict)  # architecture-specific constants

    def __post_init__(self) -> None:
        for name in (
            "n_layer",
            "n_embd",
            "n_head",
            "n_head_kv",
            "head_dim",
            "n_expert",
            "n_expert_used",
            "n_ff_exp",
            "n_vocab",
        ):
            if getattr(self, name) <= 0:
                raise MoestreamError(f"model metadata: {name} = {getattr(self, name)} must be positive")
        if self.n_head % self.n_head_kv:
            raise MoestreamError(f"model metadata: {self.n_head} heads do not divide into {self.n_head_kv} KV heads")
        if self.n_expert_used > self.n_expert:
            raise MoestreamError(
                f"model metadata: {self.n_expert_used} experts used per token but only {self.n_expert} exist"
            )
        if not 0 <= self.n_rot <= self.head_dim or self.n_rot % 2:
            raise MoestreamError(
                f"model metadata: rope.dimension_count = {self.n_rot} must be even and at most the head size "
                f"{self.head_dim}"
            )

    @property
    def attention_layers(self) -> list[int]:
        """Layers with a KV cache: all of them, unless the architecture marks some recurrent."""
        recurrent = self.extra.get("recurrent_layers", (False,) * self.n_layer)
        return [il for il in range(self.n_layer) if not recurrent[il]]

    @property
    def rot_dim(self) -> int:
        return self.n_rot or self.head_dim


def read_key(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A required metadata value, or one clear error naming the key."""
    if key in meta:
        return meta[key]
    if default is not None:
        return default
    raise MoestreamError(f"model metadata key {key} is missing; the file is incomplete or from an unknown converter")


def common_spec_fields(meta: dict[str, Any], arch: str, n_vocab: int) -> dict[str, Any]:
    """The fields every MoE architecture stores under `{arch}.*` keys; n_vocab comes from the embedding."""
    p = arch + "."
    n_head = int(read_key(meta, p + "attention.head_count"))
    n_embd = int(read_key(meta, p + "embedding_length"))
    return dict(
        arch=arch,
        n_layer=int(read_key(meta, p + "block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(read_key(meta, p + "attention.head_count_kv", n_head)),
        head_dim=int(read_key(meta, p + "attention.key_length", n_embd // n_head if n_head > 0 else 0)),
        n_expert=int(read_key(meta, p + "expert_count")),
        n_expert_used=int(read_key(meta, p + "expert_used_count")),
        n_ff_exp=int(read_key(meta, p + "expert_feed_forward_length")),
        n_vocab=n_vocab,
        n_ctx_train=int(read_key(meta, p + "context_length")),
        rope_base=float(read_key(meta, p + "rope.freq_base", 10000.0)),
        rms_eps=float(read_key(meta, p + "attention.layer_norm_rms_epsilon")),
        n_rot=int(meta.get(p + "rope.dimension_count", 0)),
    )
