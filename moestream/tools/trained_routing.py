"""Weights planted so a generated file routes like a trained model (make-model --routing trained).

Random weights route almost uniformly, neighbouring tokens share experts only by chance and the next-layer guess
is nearly always right. Three structures give a file a trained model's statistics (targets in ROUTING, sources
in docs/routing.md):
- popularity: every token embedding carries a shared direction u, and each layer's router rows are tilted
  along u by a per-expert amount, so some experts of a layer win far more often (not layer 0's, which trained
  models route near uniformly);
- reuse: layer 0's token mix averages the last few tokens and adds that to the residual stream, so neighbours
  share a part of every later router's input: attention whose q and k read only u (the same for every token)
  on rotary pairs chosen so the score falls with distance, or, in every delta-net layer (qwen35moe's first is
  one), a fading average of the tokens before (q and k read only u, the convolution's mean of the tokens
  before as v, no decay, a fixed beta);
- next-layer predictability: each layer's residual update (attention and expert outputs) is a fixed fraction of
  the stream it adds to, whatever the file's depth, so a slice routes like the same layers of the whole model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np

from moestream.errors import MoestreamError
from moestream.models.spec import ModelSpec, Preset
from moestream.tools.presets import get_preset

MIN_THETA, MAX_THETA = 0.02, 0.3  # rotary frequencies (radians a position) layer 0's q and k use: a window of
# a few tokens, no revival of far ones (the faster pairs alias, the slower ones never decay)


BLIND = ("attn_v", "ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp", "ffn_up_shexp")  # projections that ignore u
MIXES = ("attn_q", "attn_k")  # and these past layer 0 (layer 0's read only u)
FADING = ("attn_qkv", "ssm_conv1d", "ssm_beta", "ssm_a", "attn_gate")  # a delta-net layer's, a fading average
VALUE_SCALE = 0.1  # the delta-net values, small enough that the convolution's silu is about linear (a
# mean it added to every token would add the same vector to every router's input)
GATE = 1.0  # the delta-net output gate z, the same for every token


@dataclass(frozen=True)
class RoutingTargets:
    """A trained model's routing, as public measurements give it (docs/routing.md)."""

    guess: float  # fraction of a layer's picks the previous layer's input names (one layer of look-ahead)
    reuse: float  # fraction of a token's picks the previous token also made
    top_share: tuple[float, float]  # picks carried by a layer's top 10% of experts, on mixed text


@dataclass(frozen=True)
class RoutingSettings:
    """The planted structures' strengths, calibrated on moestream/tools/data/english.txt for the targets."""

    targets: RoutingTargets
    shared: float  # the shared direction's size in an embedding row, against the row's random part (RMS 1)
    popularity: float  # std of the router's per-expert bias, in logits (the random part's std is about 1)
    context: float  # layer 0's token mix output std per unit of input, against a random projection's 1
    lag: float  # how far back (tokens) the window sits, leaving the token out: where layer 0's attention
    # peaks, or the mean distance of a delta-net's fading average
    update: float  # each later residual update's std (a later delta-net's fading average too), against the
    # stream's RMS
    lift: float  # the stream's RMS after layer 0 (its context added) over before
    growth: float  # the stream's RMS growth a later layer (what the update scale and router tilt follow)
    focus: float | None = None  # layer 0's attention score at its peak over its far floor: higher, a narrower
    # window (attention only)

    def rms(self, il: int) -> float:
        """The residual stream's expected RMS entering layer il, in units of an embedding row's."""
        return 1.0 if il == 0 else self.lift * self.growth ** (il - 1)


ROUTING: dict[str, RoutingSettings] = {
    "qwen3-30b-a3b": RoutingSettings(
        RoutingTargets(guess=0.88, reuse=0.41, top_share=(0.26, 0.45)),
        shared=0.5,
        popularity=0.32,
        context=4.4,
        focus=12.0,
        lag=3.0,
        update=0.23,
        lift=1.7,
        growth=1.008,
    ),
    "qwen3.6-35b-a3b": RoutingSettings(
        RoutingTargets(guess=0.81, reuse=0.35, top_share=(0.26, 0.45)),
        shared=0.5,
        popularity=0.32,
        context=3.4,
        lag=3.0,
        update=0.27,
        lift=2.18,
        growth=1.013,
    ),
}


def routing_settings(p: Preset, routing: str | None) -> RoutingSettings | None:
    """The settings make-model plants (None: uniform routing, today's weights). routing None: the preset's
    default, trained where the table has its settings."""
    if routing not in (None, "trained", "uniform"):
        raise MoestreamError(f"--routing {routing}: choose trained or uniform")
    settings = ROUTING.get(p.name)
    if routing == "trained" and settings is None:
        raise MoestreamError(
            f"--routing trained: preset {p.name} has no trained routing settings (presets with them: "
            f"{', '.join(ROUTING)}); use --routing uniform"
        )
    return None if routing == "uniform" else settings


def calibration_preset(name: str, layers: int) -> Preset:
    """The preset scaled down to calibrate on a CPU in seconds (hidden 256, 4 heads over 2 KV heads, expert
    FFN 64, the test vocabulary, 2 delta-net key heads over 4 value heads); what routing depends on is kept:
    the experts and how many a token uses, the head sizes, rope and the routing settings (looked up by name)."""
    p = get_preset(name, layers)
    small = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=64, n_vocab=1280)
    if p.spec.n_ff_shexp:
        small["n_ff_shexp"] = 64
    keys = p.gguf_keys
    if "ssm.group_count" in keys:
        keys = keys | {"ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 4 * keys["ssm.state_size"]}
    return replace(p, spec=replace(p.spec, **small), n_ff=64, gguf_keys=keys)


def shared_direction(n_embd: int, seed: int) -> np.ndarray:
    """The unit vector u every embedding row carries."""
    u = np.random.default_rng([seed, zlib.crc32(b"shared direction")]).standard_normal(n_embd)
    return (u / np.linalg.norm(u)).astype(np.float32)


def window_pairs(rot_dim: int, rope_base: float) -> np.ndarray:
    """Rotary pair indices (0 .. rot_dim/2) whose frequency lies in [MIN_THETA, MAX_THETA]."""
    theta = rope_base ** (-np.arange(rot_dim // 2) * 2.0 / rot_dim)
    pairs = np.flatnonzero((theta >= MIN_THETA) & (theta <= MAX_THETA))
    if not len(pairs):
        raise MoestreamError(f"rope base {rope_base:g} over {rot_dim} channels has no pair for a token window")
    return pairs


def planted(name: str, rows: np.ndarray, first: int, p: Preset, s: RoutingSettings, seed: int) -> np.ndarray:
    """Rows [first, first + len(rows)) of tensor name (flattened to [rows, last dim]) with the structures
    planted; the random rows come in as make-model draws them for uniform routing."""
    spec = p.spec
    D = spec.n_embd
    if name == "token_embd.weight":
        return rows + (s.shared * D**0.5) * shared_direction(D, seed)
    if not name.startswith("blk."):
        return rows
    il, kind = int(name.split(".")[1]), name.split(".")[2]
    u = shared_direction(D, seed)
    if kind == "ffn_gate_inp":  # router rows tilted along u by a per-expert bias only (none at layer 0)
        rows = _without(rows, u)
        if il == 0:
            return rows
        bias = np.random.default_rng([seed, zlib.crc32(name.encode()), 1]).standard_normal(rows.shape[0])
        tilt = s.popularity * reads_one(s, il, D)
        return rows + (tilt * bias[:, None] * u[None, :]).astype(np.float32)
    if kind in FADING:
        return fading_rows(kind, rows, first, p, s, u, il)
    if il == 0 and kind in ("attn_q", "attn_k"):
        lag = s.lag if kind == "attn_q" else 0.0
        return window_rows(rows, first, spec, lag, u)
    if kind in BLIND or kind in MIXES:  # only the routers read u: an update that did would add the same vector
        # to every token, a popularity that grows with depth
        return _without(rows, u)
    if il == 0 and kind in ("attn_q_norm", "attn_k_norm"):
        # q . k / sqrt(Dh) at distance 0 is focus once q and k are rms-normed over Dh channels
        return np.full_like(rows, (s.focus / spec.head_dim**0.5) ** 0.5)
    return rows


def reads_one(s: RoutingSettings, il: int, n_embd: int) -> float:
    """The size along u of a row that reads 1 from every token's input to layer il: u . rms_norm(x) is
    shared * sqrt(D) / rms(x)."""
    return s.rms(il) * (1 + s.shared**2) ** 0.5 / (s.shared * n_embd**0.5)


def _without(rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rows with their component along the unit vector u taken out."""
    return (rows - np.outer(rows @ u, u)).astype(np.float32)


def trained_std(name: str, fan_in: int, s: RoutingSettings) -> float | None:
    """The std of a residual update's weights (None: make-model's usual one): layer 0's attention adds the
    window's context, each later update a fixed fraction of the stream, so no layer's depends on the depth."""
    if not name.startswith("blk.") or not any(k in name for k in ("attn_output", "ffn_down", "ssm_out")):
        return None
    il = int(name.split(".")[1])
    if il == 0 and ("attn_output" in name or "ssm_out" in name):
        return s.context / fan_in**0.5
    return s.update * s.rms(il) / fan_in**0.5


def window_rows(rows: np.ndarray, first: int, spec: ModelSpec, lag: float, u: np.ndarray) -> np.ndarray:
    """q or k projection rows that read only u, on the window's rotary pairs: the same vector for every token,
    so the score depends on distance alone. Each pair (channels i, i + rot_dim/2, NEOX order) is a unit
    complex number; q's turned back by lag positions of its frequency, so the score peaks lag tokens back."""
    half = spec.rot_dim // 2
    pairs = window_pairs(spec.rot_dim, spec.rope_base)
    theta = spec.rope_base ** (-pairs * 2.0 / spec.rot_dim)
    angle = np.pi / 4 - theta * lag
    scale = np.zeros(spec.head_dim, dtype=np.float64)
    scale[pairs], scale[pairs + half] = np.cos(angle), np.sin(angle)
    channel = (first + np.arange(rows.shape[0])) % spec.head_dim
    return (scale[channel][:, None] * u[None, :] / len(u) ** 0.5).astype(np.float32)


def fading_rows(
    kind: str, rows: np.ndarray, first: int, p: Preset, s: RoutingSettings, u: np.ndarray, il: int
) -> np.ndarray:
    """Layer il's delta-net as a fading average of the tokens before (every delta-net layer: random ones add
    token-specific updates only, so the stream's shared part, and reuse, would fade with depth). q and k read
    only u (the same unit vector every token, so the state holds a single running value) and pass the
    convolution; v is the mean of the K - 1 tokens before (K the convolution's taps); the state does not decay
    and beta = 1 / (lag - K/2 + 1), so the output is sum_j beta (1 - beta)^j v[t-j] at a mean distance of lag,
    gated by the same z every token."""
    keys = p.gguf_keys
    width, taps = 2 * keys["ssm.group_count"] * keys["ssm.state_size"], keys["ssm.conv_kernel"]
    qk = (first + np.arange(rows.shape[0]) < width)[:, None]  # rows of q and k channels
    one = reads_one(s, il, len(u)) * u
    if kind == "attn_qkv":
        return np.where(qk, one, VALUE_SCALE * _without(rows, u)).astype(np.float32)
    if kind == "ssm_conv1d":  # taps oldest first: q and k take the token's own input, v the mean of those before
        mean = np.zeros_like(rows)
        mean[:, -1:], mean[:, :-1] = qk, ~qk / (taps - 1)
        return mean
    if kind == "ssm_a":  # no decay: g = softplus(alpha + dt_bias) * 0
        return np.zeros_like(rows)
    beta = 1 / (s.lag - taps / 2 + 1)
    logit = np.log(beta / (1 - beta)) if kind == "ssm_beta" else GATE
    return np.broadcast_to(logit * one, rows.shape).astype(np.float32)
