"""Text cut by a stream: how much of a tail to hold back because it may be the start of a marker."""

from __future__ import annotations


def partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker (0: none)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
