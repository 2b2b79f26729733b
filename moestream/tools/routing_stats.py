"""The routing statistics a decode policy lives on, measured on a text: how often the next-layer guess names a
layer's picks, how many picks a token shares with the one before, how popular a layer's top experts are.

Legend: T = tokens, K = experts a token uses, W = guess width, E = experts of a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.tools.tokens import ENGLISH, random_prompt, text_tokens

TOP_SHARE = 0.10  # the share of a layer's experts whose picks top_share counts


@dataclass(frozen=True)
class LayerRouting:
    """One layer's statistics (guesses None: no layer before it to guess from)."""

    layer: int
    guess: float | None  # fraction of picks the K-wide guess from the layer before named
    guess_wide: float | None  # the same for a guess 1.5 K wide
    reuse: float  # fraction of a token's picks the previous token also made
    top_share: float  # fraction of picks carried by the layer's top 10% of experts
    entropy: float  # of the layer's pick counts, bits (log2 E when every expert is as popular)


@dataclass(frozen=True)
class RoutingReport:
    layers: list[LayerRouting]
    n_tokens: int
    n_expert: int
    picks: dict[int, torch.Tensor]  # each expert layer's picks [T, K], for the cache replay

    def mean(self, field: str) -> float:
        """A statistic's mean over the layers that have it."""
        values = [v for r in self.layers if (v := getattr(r, field)) is not None]
        return sum(values) / len(values) if values else float("nan")


def wide(k: int) -> int:
    """The wider guess: 1.5 K experts."""
    return (3 * k + 1) // 2


def layer_routing(layer: int, ids: torch.Tensor, n_expert: int, guess: torch.Tensor | None) -> LayerRouting:
    """Statistics of picks ids [T, K] against guess [T, W] (W >= 1.5 K), ranked best first."""
    k = ids.shape[1]
    picked = torch.zeros(ids.shape[0], n_expert, dtype=torch.bool).scatter_(1, ids, True)  # [T, E]

    def named(width: int) -> float:
        guessed = torch.zeros_like(picked).scatter_(1, guess[:, :width], True)
        return float((picked & guessed).sum()) / picked.sum().item()

    reuse = float((picked[1:] & picked[:-1]).sum()) / max(1, (ids.shape[0] - 1) * k)
    counts = picked.sum(0).double()
    top = counts.sort(descending=True).values[: max(1, math.ceil(TOP_SHARE * n_expert))]
    p = counts / counts.sum()
    entropy = float(-(p[p > 0] * p[p > 0].log2()).sum())
    g, gw = (named(k), named(wide(k))) if guess is not None else (None, None)
    return LayerRouting(layer, g, gw, reuse, float(top.sum() / counts.sum()), entropy)


def routing_report(engine, tokens: list[int]) -> RoutingReport:
    """Run tokens as one prompt and measure every expert layer's routing; each guess is the one a decode step
    makes: layer L's router on the residual stream entering layer L - 1."""
    spec, model = engine.spec, engine.model
    routed = set(spec.expert_layers)
    picks: dict[int, list[torch.Tensor]] = {il: [] for il in routed}
    guesses: dict[int, list[torch.Tensor]] = {il: [] for il in routed}

    def on_layer(il: int, x: torch.Tensor) -> None:
        if il + 1 in routed and il in routed:
            guesses[il + 1].append(model.guess_experts(il + 1, x, wide(spec.n_expert_used)).cpu())

    def on_route(il: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        picks[il].append(ids.cpu())

    engine.forward(tokens, engine.new_cache(), on_route=on_route, on_layer=on_layer)
    joined = {il: torch.cat(picks[il]) for il in sorted(routed)}
    layers = [
        layer_routing(il, ids, spec.n_expert, torch.cat(guesses[il]) if guesses[il] else None)
        for il, ids in joined.items()
    ]
    return RoutingReport(layers, len(tokens), spec.n_expert, joined)


def report_tokens(engine, text: str | None, limit: int) -> tuple[list[int], str]:
    """The tokens info --routing measures on and what they are: the text (default: the shipped English one)
    when the file has a tokenizer, else random ids."""
    if text is None and engine.tokenizer is None:
        return random_prompt(limit, engine.spec.n_vocab), "random tokens (the file has no tokenizer)"
    tokens = text_tokens(engine, text or ENGLISH, limit)
    return tokens, f"tokens of {Path(text).name if text else 'the shipped English text'}"


def report_lines(r: RoutingReport, k: int, what: str) -> list[str]:
    """info --routing's table: a row per layer, then the means."""
    w = wide(k)
    head = f"routing on {r.n_tokens} {what}: guess (layer L's router on layer L-1's input) names"
    lines = [
        head,
        f"  {'':9s} {'guess@' + str(k):>9s} {'guess@' + str(w):>9s} {'reuse':>6s} {'top10%':>7s} "
        f"{'entropy':>8s} (bits; uniform {math.log2(r.n_expert):.2f})",
    ]

    def pct(v: float | None) -> str:
        return f"{'-':>8s}" if v is None else f"{100 * v:7.1f}%"

    for x in r.layers:
        lines.append(
            f"  layer {x.layer:3d} {pct(x.guess):>9s} {pct(x.guess_wide):>9s} {100 * x.reuse:5.1f}% "
            f"{100 * x.top_share:6.1f}% {x.entropy:8.2f}"
        )
    m = r.mean
    lines.append(
        f"  {'mean':9s} {pct(m('guess')):>9s} {pct(m('guess_wide')):>9s} {100 * m('reuse'):5.1f}% "
        f"{100 * m('top_share'):6.1f}% {m('entropy'):8.2f}"
    )
    return lines
