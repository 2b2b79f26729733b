"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA attention with biases on q, k, v and o, no q/k norms, YaRN RoPE
and a learned sink logit per head; even layers see a sliding window of positions, odd layers all of them.
Each layer ends in a softmax top-k MoE (router with a bias) of experts with biases and a clamped SwiGLU.
Tensor names and the math are llama.cpp's reading of the file (src/models/openai-moe.cpp).

Legend: T = tokens in the micro-batch, D = hidden size, H / Hkv = query / KV heads, Dh = head dim,
E = experts, K = experts used per token, F = expert FFN size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moestream.errors import MoestreamError
from moestream.models import qwen3moe
from moestream.models.layers import Batch, Cache
from moestream.models.spec import ModelSpec, common_metadata, common_spec_fields, read_float, read_int, read_key
from moestream.ops.attention import causal_attention, masked_attention, rope_store
from moestream.ops.experts import ExpertSource, routed_swiglu
from moestream.ops.linear import linear, linears
from moestream.ops.moe_swiglu import ClampedGlu
from moestream.ops.norm import rms_norm
from moestream.ops.rope import YaRN, rope_cos_sin, rope_neox
from moestream.ops.router import route_softmax_topk

if TYPE_CHECKING:
    from moestream.models.spec import Preset

ARCH = "gpt-oss"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
QKV = ("attn_q", "attn_k", "attn_v")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's gpt-oss constants: it reads none from the file
SWA_PATTERN = 2  # llama.cpp's default for gpt-oss: of each 2 layers, the first slides


def read_spec(meta: dict[str, Any], n_vocab: int) -> ModelSpec:
    """Common MoE fields plus, in `extra`, the sliding window, which layers slide, and the RoPE scaling."""
    p = ARCH + "."
    fields = common_spec_fields(meta, ARCH, n_vocab)
    n_layer = fields["n_layer"]
    if read_int(meta, p + "attention.value_length", fields["head_dim"]) != fields["head_dim"]:
        raise MoestreamError("model metadata: attention key and value head sizes differ; moestream needs them equal")
    if read_float(meta, p + "rope.freq_base_swa", fields["rope_base"]) != fields["rope_base"]:
        raise MoestreamError(
            f"model metadata: {p}rope.freq_base_swa differs from {p}rope.freq_base; moestream turns both kinds "
            "of layer by one RoPE base"
        )
    pattern = read_key(meta, p + "attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, list):  # an explicit flag per layer
        if len(pattern) != n_layer or not all(isinstance(s, bool | int) for s in pattern):
            raise MoestreamError(f"model metadata: {p}attention.sliding_window_pattern must be {n_layer} flags")
        sliding = tuple(bool(s) for s in pattern)
    else:
        n = read_int(meta, p + "attention.sliding_window_pattern", SWA_PATTERN, lo=0)
        sliding = tuple(n == 0 or il % n < n - 1 for il in range(n_layer))
    extra = dict(
        sliding_window=read_int(meta, p + "attention.sliding_window", hi=1 << 24),
        sliding_layers=sliding,
        yarn=read_rope_scaling(meta, fields["n_ctx_train"]),
    )
    return ModelSpec(**fields, extra=extra)


def read_rope_scaling(meta: dict[str, Any], n_ctx_train: int) -> YaRN | None:
    """The file's `rope.scaling.*` keys as llama.cpp applies them: type (linear unless given), factor,
    original context and attention factor; its YaRN betas, extrapolation and attention factors are the
    defaults (32, 1, 1 and 1 + 0.1 ln factor), whatever keys the file carries. None: plain RoPE."""
    p = ARCH + ".rope.scaling."
    kind = read_key(meta, p + "type", "linear")
    if kind not in ("none", "linear", "yarn"):
        raise MoestreamError(f"model metadata: {p}type = {kind!r:.40}; moestream supports none, linear and yarn")
    factor = read_float(meta, p + "factor", 1.0) if kind != "none" else 1.0
    attn_factor = read_float(meta, p + "attn_factor", 1.0)
    if kind == "yarn":
        mscale = attn_factor * (1 + 0.1 * math.log(factor) if factor > 1 else 1.0)
        n_ctx_orig = read_int(meta, p + "original_context_length", n_ctx_train, hi=1 << 24)
        return YaRN(factor, n_ctx_orig, mscale=mscale)
    if factor == 1.0 and attn_factor == 1.0:
        return None
    return YaRN(factor, n_ctx_train, ext_factor=0.0, mscale=attn_factor)  # linear: every pair interpolated


def metadata(p: Preset) -> dict[str, Any]:
    """The `gpt-oss.*` keys of a generated file of preset p (read back by `read_spec`)."""
    a = ARCH + "."
    return (
        common_metadata(p.spec)
        | {a + "feed_forward_length": p.n_ff or p.spec.n_ff_exp}
        | {a + key: value for key, value in p.gguf_keys.items()}
    )


def tensor_shapes(spec: ModelSpec, tied_output: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a file of this architecture, numpy order. llama.cpp requires the output head (a file
    without it is refused), so tied_output changes nothing here."""
    D, Dh, H, Hkv = spec.n_embd, spec.head_dim, spec.n_head, spec.n_head_kv
    E, F_ = spec.n_expert, spec.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, D)}
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        shapes |= {
            b + "attn_norm.weight": (D,),
            b + "attn_q.weight": (H * Dh, D),
            b + "attn_q.bias": (H * Dh,),
            b + "attn_k.weight": (Hkv * Dh, D),
            b + "attn_k.bias": (Hkv * Dh,),
            b + "attn_v.weight": (Hkv * Dh, D),
            b + "attn_v.bias": (Hkv * Dh,),
            b + "attn_output.weight": (D, H * Dh),
            b + "attn_output.bias": (D,),
            b + "attn_sinks.weight": (H,),
            b + "post_attention_norm.weight": (D,),
            b + "ffn_gate_inp.weight": (E, D),
            b + "ffn_gate_inp.bias": (E,),
            b + "ffn_gate_exps.weight": (E, F_, D),
            b + "ffn_gate_exps.bias": (E, F_),
            b + "ffn_up_exps.weight": (E, F_, D),
            b + "ffn_up_exps.bias": (E, F_),
            b + "ffn_down_exps.weight": (E, D, F_),
            b + "ffn_down_exps.bias": (E, D),
        }
    shapes["output_norm.weight"] = (D,)
    shapes["output.weight"] = (spec.n_vocab, D)
    return shapes


def state_bytes(spec: ModelSpec) -> int:
    """One sequence's state besides the KV cache: none (attention only)."""
    return 0


def expert_tensor_names(il: int) -> tuple[str, str, str]:
    """The routed expert stacks (their biases are dense: small, and read by the router's ids)."""
    return tuple(f"blk.{il}.{t}.weight" for t in EXPERT_TENSORS)  # type: ignore[return-value]


class Model(qwen3moe.Model):
    """qwen3moe's layer order, embedding and head with gpt-oss's biases, YaRN RoPE, attention sinks, sliding windows
    and clamped-GLU experts."""

    MOE_NORM = "post_attention_norm"  # the norm in front of a layer's MoE block

    def b(self, il: int, name: str) -> torch.Tensor:
        return self.weights[f"blk.{il}.{name}.bias"]

    def window(self, il: int) -> int:
        """Positions layer il's queries see (0: all of them)."""
        return self.spec.extra["sliding_window"] if self.spec.extra["sliding_layers"][il] else 0

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables of the given positions (YaRN-scaled as the file says)."""
        return rope_cos_sin(positions, self.spec.rot_dim, self.spec.rope_base, dtype, self.spec.extra["yarn"])

    def guess_experts(self, il: int, x: torch.Tensor, n: int) -> torch.Tensor:
        """The n experts layer il's router would rank first for x, the residual stream before an earlier layer:
        a guess of what il will pick, to fetch its experts ahead (ids [T, n])."""
        normed = rms_norm(x, self.w(il, self.MOE_NORM), self.spec.rms_eps)
        logits = F.linear(normed, self.w(il, "ffn_gate_inp"), self.b(il, "ffn_gate_inp"))
        return torch.topk(logits, n, dim=-1).indices

    def attention(self, il: int, x: torch.Tensor, batch: Batch, cache: Cache) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        q, k, v = linears(x, [self.stored(il, n) for n in QKV])  # their biases are added in attend
        out = self.attend(il, q.view(T, s.n_head, s.head_dim), k, v, batch, cache)  # [T, H, Dh]
        return linear(out.reshape(T, -1), self.stored(il, "attn_output")) + self.b(il, "attn_output")

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, cache: Cache
    ) -> torch.Tensor:
        """Heads q [T, H, Dh] attend to keys and values k, v [T, Hkv * Dh] (biases, RoPE, KV cache, sinks,
        window)."""
        if batch.rows:  # tokens of different sequences: each attends within its own cache
            rows = enumerate(zip(batch.rows, cache, strict=True))
            return torch.cat([self.attend(il, q[i : i + 1], k[i : i + 1], v[i : i + 1], b, c) for i, (b, c) in rows])
        s, T = self.spec, q.shape[0]
        k, v = k.view(T, s.n_head_kv, s.head_dim), v.view(T, s.n_head_kv, s.head_dim)
        biases = tuple(self.b(il, n) for n in QKV)
        sinks, window = self.w(il, "attn_sinks"), self.window(il)
        if batch.n_keys is None:
            q, k, v = (t + b.view(t.shape[1:]) for t, b in zip((q, k, v), biases, strict=True))
            q, k = rope_neox(q, batch.cos, batch.sin), rope_neox(k, batch.cos, batch.sin)
            k_all, v_all = cache.kv.update(il, batch.pos0, k, v)
            return causal_attention(q, k_all, v_all, sinks, window)  # [T, H, Dh]
        caches = cache.kv.k[il], cache.kv.v[il]  # a static batch writes its rows at device positions
        q = rope_store(q, k, v, biases, (batch.cos, batch.sin), caches, batch.positions)
        keys = caches[0][: batch.n_keys], caches[1][: batch.n_keys]
        return masked_attention(q, *keys, batch.positions, sinks, window)

    def moe(
        self, il: int, x: torch.Tensor, experts: ExpertSource, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed experts' sum, plus residual if given."""
        router = self.w(il, "ffn_gate_inp"), self.b(il, "ffn_gate_inp")
        weights, ids = route_softmax_topk(x, router[0], self.spec.n_expert_used, bias=router[1])
        pairs = ids.reshape(-1)  # the experts' biases, per token-expert pair
        biases = (self.b(il, name)[pairs] for name in EXPERT_TENSORS)
        clamped = ClampedGlu(*biases, SWIGLU_ALPHA, SWIGLU_LIMIT)
        return routed_swiglu(x, weights, experts.weights(il, x, ids), residual, clamped=clamped)
