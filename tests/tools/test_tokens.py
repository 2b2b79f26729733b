"""What the tools feed a model: a text's tokens as a prompt of it encodes, or random ids, and clear errors."""

from __future__ import annotations

import pytest

import moestream
from moestream.errors import MoestreamError
from moestream.tools.tokens import ENGLISH, random_prompt, read_text, text_tokens


def test_a_text_gives_its_prompt_tokens_up_to_the_limit(model_file):
    e = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    try:
        whole = text_tokens(e)  # the shipped English text
        assert whole == e.encode_prompt(ENGLISH.read_text(encoding="utf-8")) and len(whole) > 100
        assert text_tokens(e, ENGLISH, limit=10) == whole[:10]
    finally:
        e.close()


def test_a_text_too_short_or_not_text_is_refused_with_its_fix(model_file, tmp_path):
    short, binary = tmp_path / "short.txt", tmp_path / "binary.txt"
    short.write_text("", encoding="utf-8")
    binary.write_bytes(b"\xff\xfe\x00bad")
    e = moestream.load(model_file("tiny", "F32"), device="cpu", progress=False)
    try:
        with pytest.raises(MoestreamError, match="give a text of at least two"):
            text_tokens(e, short)
    finally:
        e.close()
    with pytest.raises(MoestreamError, match="not UTF-8.*plain text"):
        read_text(binary)


def test_random_ids_are_the_seeds_and_within_the_vocabulary():
    a, b = random_prompt(64, 50), random_prompt(64, 50, seed=1)
    assert a == random_prompt(64, 50) and a != b and all(0 <= t < 50 for t in a + b) and len(a) == 64
