"""Model presets for the generator: tiny shapes for tests, real shapes for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moestream.errors import MoestreamError


@dataclass(frozen=True)
class Preset:
    name: str
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
    n_ctx: int = 4096
    n_ff: int = 0  # the dense FFN size the real config declares (written as metadata, unused by MoE layers)
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied_output: bool = False


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # K-quant friendly: every row a multiple of 256, so Q4_K_M really writes Q4_K / Q6_K blocks
        Preset("tiny", "qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
               n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=1280),
        # odd sizes: 5 heads over 1 KV head, 6 experts choosing 3, a vocabulary that is no round number
        Preset("tiny-odd", "qwen3moe", n_layer=3, n_embd=160, n_head=5, n_head_kv=1, head_dim=32,
               n_expert=6, n_expert_used=3, n_ff_exp=96, n_vocab=1291, tied_output=True),
        Preset("qwen3-30b-a3b", "qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
               n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936, n_ctx=40960, n_ff=6144),
    )
}


def get_preset(name: str, n_layer: int | None = None) -> Preset:
    if name not in PRESETS:
        raise MoestreamError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})")
    p = PRESETS[name]
    if n_layer is not None:
        if n_layer < 1:
            raise MoestreamError(f"--layers {n_layer}: must be at least 1")
        p = replace(p, n_layer=n_layer)
    return p
