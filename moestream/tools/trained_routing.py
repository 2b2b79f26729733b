"""Weights planted so a generated file routes like a trained model (make-model --routing trained).

Random weights route almost uniformly, neighbouring tokens share experts only by chance and the next-layer guess
is nearly always right. Three structures give a file a trained model's statistics (targets in ROUTING, sources
in docs/routing.md):
- popularity: every token embedding carries a shared direction u, and each layer's router rows are tilted
  along u by a per-expert amount, so some experts of a layer win far more often (not layer 0's, which trained
  models route near uniformly);
- reuse: layer 0's attention looks at the last few tokens only (q and k read only u, so they are the same for
  every token, and their rotary pairs are chosen so the score falls with distance), and adds their mean to the
  residual stream: neighbours then share a part of every later router's input;
- next-layer predictability: each layer's residual update (attention and expert outputs) is a fixed fraction of
  the stream it adds to, whatever the file's depth, so a slice routes like the same layers of the whole model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from moestream.errors import MoestreamError
from moestream.models.spec import ModelSpec, Preset

MIN_THETA, MAX_THETA = 0.02, 0.3  # rotary frequencies (radians a position) layer 0's q and k use: a window of
# a few tokens, no revival of far ones (the faster pairs alias, the slower ones never decay)


BLIND = ("attn_v", "ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp", "ffn_up_shexp")  # projections that ignore u
# (and attn_q / attn_k past layer 0, whose rows read only u)


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
    context: float  # layer 0's attention output std per unit of input, against a random projection's 1
    focus: float  # layer 0's attention score at its peak over its far floor: higher, a narrower window
    lag: float  # the distance (tokens back) layer 0's attention peaks at: the window leaves the token out
    update: float  # each later residual update's std, against the stream's RMS
    lift: float  # the stream's RMS after layer 0 (its context added) over before
    growth: float  # the stream's RMS growth a later layer (what the update scale and router tilt follow)

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
    if routing == "trained" and p.spec.arch != "qwen3moe":
        raise MoestreamError(f"--routing trained: not planted for {p.spec.arch} yet; use --routing uniform")
    return None if routing == "uniform" else settings


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
    if kind == "ffn_gate_inp":  # router rows tilted along u by a per-expert bias only (none at layer 0)
        u = shared_direction(D, seed)
        rows = _without(rows, u)
        if il == 0:
            return rows
        bias = np.random.default_rng([seed, zlib.crc32(name.encode()), 1]).standard_normal(rows.shape[0])
        # u . rms_norm(x) = shared * sqrt(D) / rms(x)
        tilt = s.popularity * s.rms(il) * (1 + s.shared**2) ** 0.5 / (s.shared * D**0.5)
        return rows + (tilt * bias[:, None] * u[None, :]).astype(np.float32)
    if kind in BLIND:  # only the routers read u: an update that did would add the same vector to every token,
        # a popularity that grows with depth
        return _without(rows, shared_direction(D, seed))
    if kind in ("attn_q", "attn_k"):
        if il > 0:
            return _without(rows, shared_direction(D, seed))
        lag = s.lag if kind == "attn_q" else 0.0
        return window_rows(rows, first, spec, lag, shared_direction(D, seed))
    if il == 0 and kind in ("attn_q_norm", "attn_k_norm"):
        # q . k / sqrt(Dh) at distance 0 is focus once q and k are rms-normed over Dh channels
        return np.full_like(rows, (s.focus / spec.head_dim**0.5) ** 0.5)
    return rows


def _without(rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rows with their component along the unit vector u taken out."""
    return (rows - np.outer(rows @ u, u)).astype(np.float32)


def trained_std(name: str, fan_in: int, s: RoutingSettings) -> float | None:
    """The std of a residual update's weights (None: make-model's usual one): layer 0's attention adds the
    window's context, each later update a fixed fraction of the stream, so no layer's depends on the depth."""
    if not name.startswith("blk.") or not any(k in name for k in ("attn_output", "ffn_down", "ssm_out")):
        return None
    il = int(name.split(".")[1])
    if il == 0 and "attn_output" in name:
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
