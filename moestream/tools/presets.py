"""Model presets for the generator: tiny shapes for tests, real shapes for benchmarks."""

from __future__ import annotations

from dataclasses import replace

from moestream.errors import MoestreamError
from moestream.models.spec import MAX_LAYERS, ModelSpec, Preset


def _spec(arch: str, n_ctx: int = 4096, rope_base: float = 1_000_000.0, rms_eps: float = 1e-6, **shape) -> ModelSpec:
    return ModelSpec(arch=arch, n_ctx_train=n_ctx, rope_base=rope_base, rms_eps=rms_eps, **shape)


def _qwen35_hybrid(k_heads: int, v_heads: int, head_dim: int, rope_sections: tuple[int, ...]) -> dict:
    """qwen35moe's extra keys: delta-net heads, conv kernel 4, attention every 4th layer, RoPE sections."""
    return {
        "rope.dimension_sections": list(rope_sections),
        "ssm.conv_kernel": 4,
        "ssm.state_size": head_dim,
        "ssm.group_count": k_heads,
        "ssm.time_step_rank": v_heads,
        "ssm.inner_size": head_dim * v_heads,
        "full_attention_interval": 4,
    }


def _gpt_oss(window: int) -> dict:
    """gpt-oss's extra keys: the sliding window and YaRN (factor 32 over the 4096 positions it trained at)."""
    scaling = {"rope.scaling.type": "yarn", "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096}
    return {"attention.sliding_window": window} | scaling


def _gpt_oss_spec(n_layer: int, n_expert: int) -> ModelSpec:
    """gpt-oss-20b and -120b differ only in depth and experts."""
    return _spec(
        "gpt-oss",
        n_layer=n_layer,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=n_expert,
        n_expert_used=4,
        n_ff_exp=2880,
        n_vocab=201088,
        n_ctx=131072,
        rope_base=150000.0,
        rms_eps=1e-5,
    )


def _glm(n_dense: int, scale: float, **shape) -> ModelSpec:
    """A glm4moe spec: NEOX RoPE over half of each head, one shared expert, one NextN block after the trunk."""
    extra = dict(n_ff=shape.pop("n_ff"), gating="sigmoid", weights_norm=True, weights_scale=scale)
    extra |= dict(n_group=shape.pop("n_group", 1), group_used=shape.pop("group_used", 1))
    n_ff_exp = shape["n_ff_exp"]
    return _spec(
        "glm4moe",
        n_rot=shape["head_dim"] // 2,
        n_ff_shexp=n_ff_exp,
        n_layer_dense_lead=n_dense,
        n_layer_nextn=1,
        rms_eps=1e-5,
        extra=extra,
        **shape,
    )


def _glm_preset(name: str, spec: ModelSpec, **how) -> Preset:
    return Preset(name, spec, n_ff=spec.extra["n_ff"], gguf_keys=_glm_keys(spec), **how)


def _glm_keys(spec: ModelSpec) -> dict:
    """glm4moe's router keys as llama.cpp's converter writes them (groups only where there are several)."""
    e = spec.extra
    keys = {"expert_weights_norm": e["weights_norm"], "expert_weights_scale": e["weights_scale"]}
    if e["n_group"] > 1:
        keys |= {"expert_group_count": e["n_group"], "expert_group_used_count": e["group_used"]}
    return keys


QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")  # GLM-4.5-Air has none (GLM-4.5 has them)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # K-quant friendly: every row a multiple of 256, so Q4_K_M really writes Q4_K / Q6_K blocks
        Preset(
            "tiny",
            _spec(
                "qwen3moe",
                n_layer=2,
                n_embd=256,
                n_head=4,
                n_head_kv=2,
                head_dim=64,
                n_expert=8,
                n_expert_used=2,
                n_ff_exp=256,
                n_vocab=1280,
            ),
        ),
        # odd sizes: 5 heads over 1 KV head, 6 experts choosing 3, a vocabulary that is no round number
        Preset(
            "tiny-odd",
            _spec(
                "qwen3moe",
                n_layer=3,
                n_embd=160,
                n_head=5,
                n_head_kv=1,
                head_dim=32,
                n_expert=6,
                n_expert_used=3,
                n_ff_exp=96,
                n_vocab=1291,
            ),
            tied_output=True,
        ),
        Preset(
            "qwen3-30b-a3b",
            _spec(
                "qwen3moe",
                n_layer=48,
                n_embd=2048,
                n_head=32,
                n_head_kv=4,
                head_dim=128,
                n_expert=128,
                n_expert_used=8,
                n_ff_exp=768,
                n_vocab=151936,
                n_ctx=40960,
            ),
            n_ff=6144,
        ),
        # 3 delta-net layers, then full attention; a quarter of each head rotates, as in the real model
        Preset(
            "tiny-qwen35moe",
            _spec(
                "qwen35moe",
                n_layer=4,
                n_embd=256,
                n_head=4,
                n_head_kv=2,
                head_dim=64,
                n_expert=8,
                n_expert_used=2,
                n_ff_exp=256,
                n_vocab=1280,
                rope_base=10_000_000.0,
                n_rot=16,
                n_ff_shexp=256,
            ),
            gguf_keys=_qwen35_hybrid(k_heads=2, v_heads=4, head_dim=64, rope_sections=(3, 3, 2, 0)),
        ),
        Preset(
            "qwen3.6-35b-a3b",
            _spec(
                "qwen35moe",
                n_layer=40,
                n_embd=2048,
                n_head=16,
                n_head_kv=2,
                head_dim=256,
                n_expert=256,
                n_expert_used=8,
                n_ff_exp=512,
                n_vocab=248320,
                n_ctx=262144,
                rope_base=10_000_000.0,
                n_rot=64,
                n_ff_shexp=512,
            ),
            gguf_keys=_qwen35_hybrid(k_heads=16, v_heads=32, head_dim=128, rope_sections=(11, 11, 10, 0)),
        ),
        # sliding, full, sliding; a window of 8 positions; 6 heads over 2 KV heads, 6 experts choosing 3, rows a
        # multiple of 32 (Q8_0 blocks) but of no power of two
        Preset(
            "tiny-gpt-oss",
            _spec(
                "gpt-oss",
                n_layer=3,
                n_embd=160,
                n_head=6,
                n_head_kv=2,
                head_dim=32,
                n_expert=6,
                n_expert_used=3,
                n_ff_exp=96,
                n_vocab=1291,
                rope_base=150000.0,
                rms_eps=1e-5,
            ),
            chat="harmony",
            gguf_keys=_gpt_oss(window=8),
        ),
        Preset("gpt-oss-20b", _gpt_oss_spec(24, 32), n_ff=2880, chat="harmony", gguf_keys=_gpt_oss(window=128)),
        Preset("gpt-oss-120b", _gpt_oss_spec(36, 128), n_ff=2880, chat="harmony", gguf_keys=_gpt_oss(window=128)),
        # GLM-4.5's layout: a dense first layer, biased q/k/v with q/k norms, half of each head rotated, routed
        # weights normalised and scaled, a shared expert, a NextN block; rows of 256 for real K-quant blocks
        _glm_preset(
            "tiny-glm4moe",
            _glm(
                n_dense=1,
                scale=2.5,
                n_layer=3,
                n_embd=256,
                n_head=4,
                n_head_kv=2,
                head_dim=64,
                n_expert=8,
                n_expert_used=2,
                n_ff_exp=256,
                n_ff=512,
                n_vocab=1280,
            ),
        ),
        # odd sizes, GLM-4.5-Air's way (no q/k norms) with grouped top-k: 5 heads over 1 KV head, two dense
        # layers, 12 experts in 4 groups of which 2 are searched for 3 picks, a tied head
        _glm_preset(
            "tiny-glm4moe-odd",
            _glm(
                n_dense=2,
                scale=1.0,
                n_layer=4,
                n_embd=160,
                n_head=5,
                n_head_kv=1,
                head_dim=32,
                n_expert=12,
                n_expert_used=3,
                n_group=4,
                group_used=2,
                n_ff_exp=96,
                n_ff=224,
                n_vocab=1291,
            ),
            tied_output=True,
            omitted=QK_NORMS,
        ),
        _glm_preset(
            "glm-4.5-air",
            _glm(
                n_dense=1,
                scale=1.0,
                n_layer=46,
                n_embd=4096,
                n_head=96,
                n_head_kv=8,
                head_dim=128,
                n_expert=128,
                n_expert_used=8,
                n_ff_exp=1408,
                n_ff=10944,
                n_vocab=151552,
                n_ctx=131072,
            ),
            omitted=QK_NORMS,
        ),
        _glm_preset(
            "glm-4.5",
            _glm(
                n_dense=3,
                scale=2.5,
                n_layer=92,
                n_embd=5120,
                n_head=96,
                n_head_kv=8,
                head_dim=128,
                n_expert=160,
                n_expert_used=8,
                n_ff_exp=1536,
                n_ff=12288,
                n_vocab=151552,
                n_ctx=131072,
            ),
        ),
    )
}


def get_preset(name: str, n_layer: int | None = None) -> Preset:
    if name not in PRESETS:
        raise MoestreamError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})")
    p = PRESETS[name]
    if n_layer is not None:
        if not 1 <= n_layer <= MAX_LAYERS:
            raise MoestreamError(f"--layers {n_layer}: give 1 to {MAX_LAYERS}")
        p = replace(p, spec=replace(p.spec, n_layer=n_layer))
    return p
