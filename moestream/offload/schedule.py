"""Schedules (--stream): how streamed layers' uploads are ordered against compute, and how many staging slots
each allocates. Placement budgets and the streamer allocates by the same rule, `Schedule.staging_slots`.
Small-batch modes (--small-batch): what a micro-batch too small to upload whole layers does instead, with
`auto` resolved by one rule, `SmallBatch.resolve`, for the budget and the expert source alike."""

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
        return _parse(cls, text, "--stream")

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


class SmallBatch(enum.StrEnum):
    """Below --stream-min-batch tokens: upload just the chosen experts (a sync to learn which), gather them with
    a kernel reading the page-locked map (no sync), or compute them on the CPU straight from the map; auto
    picks by resolve()."""

    AUTO = "auto"
    UPLOAD = "upload"
    GATHER = "gather"
    CPU = "cpu"

    @classmethod
    def parse(cls, text: str | SmallBatch) -> SmallBatch:
        return _parse(cls, text, "--small-batch")

    def resolve(self, on_gpu: bool, readable: bool, kernel_ok: bool, sharded: bool) -> SmallBatch:
        """The mode that runs: auto gathers on a GPU whose kernels can read the page-locked experts (decode
        10.4 vs upload's 7.8 tokens/s on the H200, before prefetch), else uploads; with several --devices, where
        no device holds a whole layer to upload into, it gathers where readable and computes on the CPU if not."""
        if self is not SmallBatch.AUTO:
            return self
        if on_gpu and readable and kernel_ok:
            return SmallBatch.GATHER
        if sharded:
            return SmallBatch.GATHER if readable else SmallBatch.CPU
        return SmallBatch.UPLOAD


def _parse(cls, text, flag: str):
    """The member of enum cls spelled text; anything else is a one-line error naming flag and the choices."""
    try:
        return cls(text)
    except ValueError:
        raise MoestreamError(f"{flag} {text}: expected one of {', '.join(m.value for m in cls)}") from None
