"""Where a quantized KV cache's logit error comes from on a generated model: per attention layer, K and V's
block error and outliers, the attention scores' size and spread, the attention output's error with K or V
quantized, that branch's share of the residual stream, and the logit error with only that layer's K or V
quantized. The cache is emulated: an f32 cache whose rows are written as their dequantized blocks (checked
against the engine's own q4_0 cache first). The setting of tests/runtime/test_kv_types.py.

    python scripts/kv_q4_diag.py PATH.gguf [TYPE]
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from moestream.kernels import kv_quant
from moestream.models import glm4moe, gpt_oss, qwen3moe, qwen35moe
from moestream.ops.attention import causal_attention
from moestream.runtime.kv_cache import KVCache
from tests.runtime.test_kv_types import relative_errors, run

MODELS = (qwen3moe, gpt_oss, glm4moe, qwen35moe)
KEEP: dict[int, dict] = {}  # layer -> what the recording pass saw


def fake(rows: torch.Tensor, name: str) -> torch.Tensor:
    """rows as a cache of type name gives them back."""
    if name in kv_quant.FLOATS:
        return rows.to(kv_quant.FLOATS[name]).float()
    blocks = kv_quant.quantize(rows.reshape(rows.shape[0], -1), name)
    return kv_quant.dequantize(blocks, name, torch.float32).view(rows.shape)


@contextmanager
def emulated(types: dict[tuple[int, str], str], default: str = "f16", record: bool = False):
    """Layer il's K ("k") or V ("v") rows stored as types[il, which] (default otherwise); record: keep each
    layer's raw rows, its attention call and the residual stream around it."""
    saved = KVCache.update, qwen3moe.causal_attention, gpt_oss.causal_attention
    methods = [
        (m.Model, f, m.Model.__dict__[f]) for m in MODELS for f in ("layer", "attention") if f in m.Model.__dict__
    ]
    current = []

    def update(self, il, pos0, k, v):
        current[:] = [il]
        if record:
            KEEP.setdefault(il, {})["kv"] = (k.clone(), v.clone())
        k, v = (fake(x, types.get((il, w), default)) for x, w in ((k, "k"), (v, "v")))
        return saved[0](self, il, pos0, k, v)

    def attention(q, k, v, *rest):
        out = saved[1](q, k, v, *rest)
        if record:
            KEEP[current[0]]["attn"] = (q.clone(), rest, out.clone())
        return out

    def keep(what, f):
        def wrapped(self, il, x, *rest):
            y = f(self, il, x, *rest)
            if record:
                KEEP.setdefault(il, {})[what] = (x.clone(), y.clone())
            return y

        return wrapped

    KVCache.update, qwen3moe.causal_attention, gpt_oss.causal_attention = update, attention, attention
    for cls, f, original in methods:
        setattr(cls, f, keep("stream" if f == "layer" else "mixed", original))
    try:
        yield
    finally:
        KVCache.update, qwen3moe.causal_attention, gpt_oss.causal_attention = saved
        for cls, f, original in methods:
            setattr(cls, f, original)


def logits(path: str, types: dict | None = None, default: str = "f16", **engine) -> torch.Tensor:
    with emulated(types or {}, default, record=engine.pop("record", False)):
        return run(path, "f32", n_gen=0, **engine)[0]


def block_stats(x: torch.Tensor, name: str) -> tuple[float, float, float]:
    """Relative RMS error of x stored as name, the blocks' mean crest (max |x| over RMS), and the largest
    channel RMS of a head over the median channel's (outlier channels)."""
    err = (fake(x, name) - x).norm() / x.norm()
    b = x.reshape(-1, 32)
    crest = (b.abs().amax(dim=1) / b.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)).mean()
    ch = x.reshape(-1, x.shape[-1]).pow(2).mean(dim=0).sqrt()
    return float(err), float(crest), float(ch.max() / ch.median())


def score_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """The largest |q.k| / sqrt(Dh) over visible keys and the median effective number of keys a query averages
    (1 / sum p^2; sinks and windows left out)."""
    T, H, Dh = q.shape
    S, Hkv, _ = k.shape
    kk = k.repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kk.float()) / Dh**0.5
    visible = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    p = s.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return float(s[:, visible].abs().max()), float((1 / p.pow(2).sum(dim=-1)).median())


def output_error(il: int, name: str, which: str) -> float:
    """The attention output's largest relative error over tokens with only this layer's K or V as name."""
    q, rest, out = KEEP[il]["attn"]
    k, v = KEEP[il]["kv"]
    k, v = fake(k, name if which == "k" else "f16"), fake(v, name if which == "v" else "f16")
    got = causal_attention(q, k, v, *rest)
    return float(((got - out).norm(dim=(1, 2)) / out.norm(dim=(1, 2))).max())


def main(path: str, name: str = "q4_0") -> None:
    ref = logits(path)
    f16 = run(path, "f16", n_gen=0)[0]
    emu = logits(path, default=name)
    real = run(path, name, n_gen=0)[0]
    err = relative_errors(emu, ref)
    off = relative_errors(ref, f16).max(), relative_errors(emu, real).max()
    print(f"emulation off the engine's caches: f16 {off[0]:.1e}, {name} {off[1]:.1e}")
    print(f"{name} logit error: max {err.max():.4f} (position {int(err.argmax())}), median {err.median():.4f}")
    print("per position:", " ".join(f"{e:.3f}" for e in err.tolist()))
    spread = ref.std(dim=-1) / ref.abs().amax(dim=-1)
    print(f"logit std over the largest |logit|: median {spread.median():.3f}")
    logits(path, record=True, ubatch=64)  # one call a layer: every query over every key
    print(
        "| layer | K err | K crest | K channel max/median | V err | V crest | max |score| | n_eff | out err K | "
        "out err V | attention / stream | logits K alone | logits V alone |"
    )
    print("|---|" + "---:|" * 12)
    for il in sorted(KEEP):
        if "kv" not in KEEP[il]:
            continue
        k, v = KEEP[il]["kv"]
        ke, kc, kch = block_stats(k, name)
        ve, vc, _ = block_stats(v, name)
        smax, neff = score_stats(KEEP[il]["attn"][0], fake(k, "f16"))
        ok, ov = output_error(il, name, "k"), output_error(il, name, "v")
        x = KEEP[il]["stream"][0]
        share = f"{float(KEEP[il]['mixed'][1].norm() / x.norm()):.3f}"
        lk, lv = (float(relative_errors(logits(path, {(il, w): name}), ref).max()) for w in "kv")
        print(
            f"| {il} | {ke:.3f} | {kc:.2f} | {kch:.1f} | {ve:.3f} | {vc:.2f} | {smax:.1f} | {neff:.1f} | {ok:.3f} | "
            f"{ov:.3f} | {share} | {lk:.4f} | {lv:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
