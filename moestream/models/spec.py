"""ModelSpec: the shapes and constants of a model, read from GGUF metadata and checked once; Preset: a generated
model's spec and what only its writer needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moestream.errors import MoestreamError

MAX_LAYERS = 4096  # a block_count past this is a damaged file (what make-model --layers may ask, too)


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
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN instead of experts (glm4moe's first ones)
    n_layer_nextn: int = 0  # NextN / MTP blocks the file carries after the n_layer trunk: read past, never run
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
                f"model metadata is inconsistent: {self.arch}.expert_used_count = {self.n_expert_used} but "
                f"{self.arch}.expert_count = {self.n_expert} (a token cannot use more experts than exist); convert "
                "the model again (or generate it again, for a make-model file)"
            )
        if not 0 <= self.n_layer_dense_lead < self.n_layer:
            raise MoestreamError(
                f"model metadata: {self.n_layer_dense_lead} leading dense layers leave none of the {self.n_layer} "
                "layers with experts (a slice needs more layers: make-model --layers)"
            )
        if not 0 <= self.n_rot <= self.head_dim or self.rot_dim % 2:
            raise MoestreamError(
                f"model metadata: the rotated size (rope.dimension_count {self.n_rot}, else the head size "
                f"{self.head_dim}) must be even and at most the head size"
            )

    @property
    def attention_layers(self) -> list[int]:
        """Layers with a KV cache: all of them, unless the architecture marks some recurrent."""
        recurrent = self.extra.get("recurrent_layers", (False,) * self.n_layer)
        return [il for il in range(self.n_layer) if not recurrent[il]]

    @property
    def expert_layers(self) -> list[int]:
        """Layers with routed experts (what placement streams or keeps resident): all but leading dense ones."""
        return list(range(self.n_layer_dense_lead, self.n_layer))

    @property
    def rot_dim(self) -> int:
        return self.n_rot or self.head_dim


@dataclass(frozen=True)
class Preset:
    """A generated model: its spec (the one ModelSpec a reader of the file gets back, extras aside) and what
    only the writer needs."""

    name: str
    spec: ModelSpec
    n_ff: int = 0  # the dense FFN size the real config declares (written as metadata, unused by MoE layers)
    tied_output: bool = False
    chat: str = "chatml"  # the test tokenizer's chat format (formats/tokenizer.tiny_tokenizer_metadata)
    gguf_keys: dict[str, Any] = field(default_factory=dict)  # architecture-specific metadata as stored, minus
    # the `{arch}.` prefix (a reader turns them into spec.extra)
    omitted: tuple[str, ...] = ()  # optional layer tensors (the architecture's OPTIONAL) the file leaves out


MISSING = object()
MAX_COUNT = 1 << 20  # layers, heads, experts, widths: far above any real model, far below what exhausts memory
MAX_CONTEXT = 1 << 24


def read_key(meta: dict[str, Any], key: str, default: Any = MISSING) -> Any:
    """A metadata value as stored, or one clear error naming the missing key."""
    if key in meta:
        return meta[key]
    if default is not MISSING:
        return default
    raise MoestreamError(f"model metadata key {key} is missing; the file is incomplete or from an unknown converter")


def read_int(meta: dict[str, Any], key: str, default: Any = MISSING, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """An integer key in [lo, hi]: a float, a string, a list or a number out of range is a clear error."""
    value = read_key(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoestreamError(f"model metadata: {key} = {value!r:.60} must be an integer; the file is damaged")
    if not lo <= value <= hi:
        raise MoestreamError(f"model metadata: {key} = {value} must be between {lo} and {hi}; the file is damaged")
    return value


def read_float(meta: dict[str, Any], key: str, default: Any = MISSING, lo: float = 0.0, hi: float = 1e12) -> float:
    """A finite number in (lo, hi]."""
    value = read_key(meta, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo < value <= hi:
        raise MoestreamError(f"model metadata: {key} = {value!r:.60} must be a number in ({lo:g}, {hi:g}]")
    return float(value)


def common_spec_fields(meta: dict[str, Any], arch: str, n_vocab: int) -> dict[str, Any]:
    """The fields every MoE architecture stores under `{arch}.*` keys; n_vocab comes from the embedding."""
    p = arch + "."
    n_head = read_int(meta, p + "attention.head_count")
    n_embd = read_int(meta, p + "embedding_length")
    return dict(
        arch=arch,
        n_layer=read_int(meta, p + "block_count", hi=MAX_LAYERS),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=read_int(meta, p + "attention.head_count_kv", n_head),
        head_dim=read_int(meta, p + "attention.key_length", max(n_embd // n_head, 1)),
        n_expert=read_int(meta, p + "expert_count", hi=4096),
        n_expert_used=read_int(meta, p + "expert_used_count", hi=4096),
        n_ff_exp=read_int(meta, p + "expert_feed_forward_length"),
        n_vocab=n_vocab,
        n_ctx_train=read_int(meta, p + "context_length", hi=MAX_CONTEXT),
        rope_base=read_float(meta, p + "rope.freq_base", 10000.0),
        rms_eps=read_float(meta, p + "attention.layer_norm_rms_epsilon", hi=1.0),
        n_rot=read_int(meta, p + "rope.dimension_count", 0, lo=0),
    )


def common_metadata(spec: ModelSpec) -> dict[str, Any]:
    """The `{arch}.*` keys common_spec_fields reads back into spec (a generated file's metadata)."""
    a = spec.arch + "."
    meta: dict[str, Any] = {
        a + "block_count": spec.n_layer,
        a + "context_length": spec.n_ctx_train,
        a + "embedding_length": spec.n_embd,
        a + "attention.head_count": spec.n_head,
        a + "attention.head_count_kv": spec.n_head_kv,
        a + "rope.freq_base": spec.rope_base,
        a + "attention.layer_norm_rms_epsilon": spec.rms_eps,
        a + "expert_used_count": spec.n_expert_used,
        a + "expert_count": spec.n_expert,
        a + "attention.key_length": spec.head_dim,
        a + "attention.value_length": spec.head_dim,
        a + "expert_feed_forward_length": spec.n_ff_exp,
    }
    if spec.n_rot:
        meta[a + "rope.dimension_count"] = spec.n_rot
    return meta
