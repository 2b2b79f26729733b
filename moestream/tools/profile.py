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
    """Time the pass with recording off and on (alternating, after warm-up); keep the last recorded timeline.
    say(text), if given, hears of each pass as it starts (a pass on the CPU can take minutes)."""
    engine.setup.reconfigure(stream=schedule, progress=False)

    def run() -> None:
        engine.forward(tokens, engine.new_cache())

    if say:
        say(f"{schedule}: warm-up pass")
    run()
    off, on, last = [], [], None
    for i in range(repeats):
        if say:
            say(f"{schedule}: passes {2 * i + 1} and {2 * i + 2} of {2 * repeats} (unrecorded, recorded)")
        engine.record(NULL)
        off += timed(run, engine.device, repeats=1, warmup=0)
        last = Timeline(engine.device)
        engine.record(last)
        on += timed(run, engine.device, repeats=1, warmup=0)
    engine.record(NULL)
    spans = last.resolve()
    return Profile(schedule, spans, summarize(spans, on[-1]), statistics.mean(on), statistics.mean(off))
