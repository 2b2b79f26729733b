"""Schedules (--stream): how streamed layers' uploads are ordered against compute, and how many staging slots
each allocates. Placement budgets and the streamer allocates by the same rule, `Schedule.staging_slots`.
(What a micro-batch too small to upload whole layers does instead: offload/small_batch.py.)"""

from __future__ import annotations

import enum

from moestream.errors import MoestreamError


class Schedule(enum.Enum):
    """serial: copies from the pageable map on the compute stream, then compute (llama.cpp's way); pinned: the
    same from the page-locked map; overlap: uploads on a copy stream, up to K-1 layers ahead of compute;
    layer-major: overlap, with every micro-batch through layer L before L+1 (each layer crosses once)."""

    SERIAL = "serial"
    PINNED = "pinned"
    OVERLAP = "overlap"
    LAYER_MAJOR = "layer-major"

    def __str__(self) -> str:
        return self.value  # as the CLI spells it, in messages and reports

    @classmethod
    def parse(cls, text: str | Schedule) -> Schedule:
        """A --stream value (or $MOESTREAM_STREAM); anything else is a one-line error."""
        try:
            return cls(text)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise MoestreamError(f"--stream {text}: expected one of {choices}") from None

    @property
    def overlaps(self) -> bool:
        """Uploads run on their own copy stream, ahead of compute (else on the compute stream, in turn)."""
        return self in (Schedule.OVERLAP, Schedule.LAYER_MAJOR)

    @property
    def page_locks(self) -> bool:
        """The streamed experts are page-locked in place (serial copies from the pageable map)."""
        return self is not Schedule.SERIAL

    def staging_slots(self, slots: int) -> int:
        """Staging slots allocated for --slots K: serial and pinned copy into one, overlap and layer-major into K."""
        return slots if self.overlaps else 1
