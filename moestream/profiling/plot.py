"""A PNG timeline of one pass per schedule, in the manner of an Nsight Systems view.

One row per schedule on a shared millisecond axis, so serial and overlapped runs compare at a glance; in each
row a lane per stream (copy, compute, CPU copy threads), bars coloured by kind, layer numbers written where
they fit, and stalls (compute idle while an upload is in flight) hatched in red on the compute lane.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from moestream.profiling.stats import Summary, gaps, summarize, union
from moestream.profiling.timeline import Span, ordered_lanes

KIND_COLORS = {
    "upload": "#4e79a7",
    "stage": "#76b7b2",
    "attention": "#f28e2b",
    "router": "#edc948",
    "dequant": "#b07aa1",
    "experts": "#59a14f",
    "embed": "#bab0ac",
    "head": "#9c755f",
}
OTHER_COLORS = ["#e15759", "#ff9da7", "#17becf", "#8c564b", "#7f7f7f", "#bcbd22"]
STALL_COLOR = "#d62728"
FONT_SIZE = 7


def _colors(runs: Mapping[str, list[Span]]) -> dict[str, str]:
    names = sorted({s.name for spans in runs.values() for s in spans})
    others = iter(OTHER_COLORS * (len(names) // len(OTHER_COLORS) + 1))
    return {n: KIND_COLORS.get(n) or next(others) for n in names}


def _row_title(name: str, s: Summary) -> str:
    parts = [f"{name}: wall {s.wall_s * 1e3:.1f} ms", f"compute idle {s.idle_pct:.0f}%"]
    if s.wait_on_host_s is not None:
        parts.append(f"waiting on the host {s.wait_on_host_s * 1e3:.1f} ms")
    if s.overlap_pct is not None:
        parts.append(f"overlap {s.overlap_pct:.0f}%")
    if s.copy_gbps is not None:
        parts.append(f"link {s.copy_gbps:.1f} GB/s copying, {s.avg_gbps:.1f} GB/s over the pass")
    return ", ".join(parts)


def plot_timelines(
    runs: Mapping[str, list[Span]], path: str | Path, title: str | None = None, width_in: float = 16.0
) -> None:
    """Save a PNG with one row of lanes per run ({schedule: spans}); times in ms from each run's start."""
    runs = {name: spans for name, spans in runs.items() if spans}
    lanes = {name: ordered_lanes(spans) for name, spans in runs.items()}
    colors = _colors(runs)
    heights = [max(len(v), 1) + 0.8 for v in lanes.values()] or [1.0]
    fig = Figure(figsize=(width_in, 0.9 + 0.45 * sum(heights)), dpi=120, layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    x_max = max((s.end for spans in runs.values() for s in spans), default=1.0) * 1e3
    # a label fits a bar if the bar is wider than the text: characters across the plot, roughly
    ms_per_char = x_max / (width_in * 0.85 * 72 / (0.62 * FONT_SIZE))

    for ax, (name, spans) in zip(axes, runs.items(), strict=False):  # no runs: one empty axis
        rows = {lane: i for i, lane in enumerate(reversed(lanes[name]))}
        summary = summarize(spans)
        by_lane_name: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for s in sorted(spans, key=lambda s: -s.duration):  # long bars first, nested ones drawn over them
            by_lane_name[s.lane, s.name].append((s.start * 1e3, s.duration * 1e3))
        for (lane, kind), bars in by_lane_name.items():
            ax.broken_barh(
                bars, (rows[lane] - 0.4, 0.8), facecolors=colors[kind], edgecolors="white", linewidth=0.3
            )  # the edge keeps back-to-back bars apart
        blocks: dict[tuple[str, int, int | None], list[float]] = {}
        for s in spans:
            if s.layer is not None:
                b = blocks.setdefault((s.lane, s.layer, s.ubatch), [s.start, s.end])
                b[0], b[1] = min(b[0], s.start), max(b[1], s.end)
        for (lane, layer, _), (a, b) in blocks.items():
            label = str(layer)
            if (b - a) * 1e3 >= (len(label) + 1) * ms_per_char:
                ax.text(
                    (a + b) / 2 * 1e3,
                    rows[lane],
                    label,
                    ha="center",
                    va="center",
                    fontsize=FONT_SIZE,
                    color="white",
                    clip_on=True,
                )
        if "compute" in rows:
            stalls = [(st.start * 1e3, st.duration * 1e3) for st in summary.stalls]
            ax.broken_barh(
                stalls,
                (rows["compute"] - 0.4, 0.8),
                facecolors="none",
                edgecolors=STALL_COLOR,
                hatch="////",
                linewidth=0.6,
            )
            busy = union((s.start, s.end) for s in spans if s.lane == "compute")
            idle = gaps(busy, 0.0, max(s.end for s in spans))
            ax.broken_barh(
                [(a * 1e3, (b - a) * 1e3) for a, b in idle],
                (rows["compute"] - 0.45, 0.06),
                facecolors=STALL_COLOR,
                linewidth=0,
            )
        ax.set_yticks(range(len(rows)), list(rows))
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_title(_row_title(name, summary), fontsize=FONT_SIZE + 2, loc="left")
        ax.tick_params(labelsize=FONT_SIZE + 1)
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    axes[-1].set_xlim(0, x_max * 1.005)
    axes[-1].set_xlabel("time since the pass started (ms)", fontsize=FONT_SIZE + 1)
    handles = [Patch(color=c, label=n) for n, c in colors.items()]
    handles += [
        Patch(facecolor="none", edgecolor=STALL_COLOR, hatch="////", label="stall: waits on uploads"),
        Patch(color=STALL_COLOR, label="compute idle (thin line)"),
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 8),
        fontsize=FONT_SIZE + 1,
        frameon=False,
    )
    if title:
        fig.suptitle(title, fontsize=FONT_SIZE + 4)
    fig.savefig(path, format="png")
