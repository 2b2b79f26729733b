"""Splitting a gpt-oss turn into reasoning (the analysis channel) and content (the others), however the
stream cuts it."""

from __future__ import annotations

import pytest

from moestream.serving.harmony import HarmonySplit, is_harmony

TURN = (
    "<|channel|>analysis<|message|>The user greets; a 1<|2 compare stays text.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    "<|start|>assistant<|channel|>final<|message|>Hello! <|x|> stays.<|return|>"
)
REASONING = "The user greets; a 1<|2 compare stays text."
CONTENT = '{"a": 1}Hello! <|x|> stays.'


def split(pieces: list[str]) -> tuple[str, str]:
    s, out = HarmonySplit(), ["", ""]
    for piece in pieces:
        r, c = s.push(piece)
        out[0] += r
        out[1] += c
    r, c = s.flush()
    return out[0] + r, out[1] + c


def test_whole_turn():
    assert split([TURN]) == (REASONING, CONTENT)


@pytest.mark.parametrize("at", range(0, len(TURN), 7))
def test_any_cut_gives_the_same_split(at):
    assert split([TURN[:at], TURN[at:]]) == (REASONING, CONTENT)


def test_one_character_at_a_time():
    assert split(list(TURN)) == (REASONING, CONTENT)


def test_text_without_markers_is_content_and_a_cut_marker_is_held_back():
    assert split(["plain answer <|", "not"]) == ("", "plain answer <|not")
    s = HarmonySplit()
    assert s.push("<|chan") == ("", "")  # may still become <|channel|>
    assert s.push("nel|>analysis<|message|>hm") == ("hm", "")


def test_harmony_is_told_by_its_channel_marker():
    assert is_harmony("...<|start|>assistant<|channel|>final<|message|>...")
    assert not is_harmony("<|im_start|>assistant\n") and not is_harmony(None)
