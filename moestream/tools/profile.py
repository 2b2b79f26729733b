"""Profile one prefill pass per schedule: a recorded timeline, its summary, and the cost of recording."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from moestream.profiling.stats import Summary, summarize
from moestream.profiling.timeline import NULL, Span, Timeline
from moestream.tools.probe import timed


@dataclass
class Profile:
    schedule: str
    spans: list[Span]
    summary: Summary
    wall_on_s: float  # mean pass time with recording on
    wall_off_s: float  # mean pass time with recording off, same run

    @property
    def overhead_pct(self) -> float:
        return 100 * (self.wall_on_s / self.wall_off_s - 1)


def profile_pass(engine, tokens: list[int], schedule: str, repeats: int = 3, say=None) -> Profile:
    """Time the pass with recording off and on (alternating, after warm-up). The walls are medians (a first
    pass's one-time costs do not move them), and the timeline shown is the recorded pass of the median time,
    so the summary's wall is the recorded wall. say(text), if given, hears of each pass as it starts (a pass on
    the CPU can take minutes)."""
    engine.setup.reconfigure(stream=schedule, progress=False)

    def run() -> None:
        engine.forward(tokens, engine.new_cache())

    if say:
        say(f"{schedule}: warm-up pass")
    run()
    off, recorded = [], []
    for i in range(repeats):
        if say:
            say(f"{schedule}: passes {2 * i + 1} and {2 * i + 2} of {2 * repeats} (unrecorded, recorded)")
        engine.record(NULL)
        off += timed(run, engine.device, repeats=1, warmup=0)
        timeline = Timeline(engine.device)
        engine.record(timeline)
        recorded.append((timed(run, engine.device, repeats=1, warmup=0)[0], timeline))
    engine.record(NULL)
    wall_on, timeline = sorted(recorded, key=lambda r: r[0])[(len(recorded) - 1) // 2]
    spans = timeline.resolve()
    summary = summarize(spans, wall_on)
    return Profile(schedule, spans, summary, summary.wall_s, statistics.median(off))
