"""<think> blocks apart from the answer, however the stream cuts the text."""

from __future__ import annotations

import pytest

from moestream.serving.reasoning import ThinkSplit, opens_thinking


def split(text: str, opened: bool, pieces: int) -> tuple[str, str]:
    s, out = ThinkSplit(opened), ["", ""]
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        r, c = s.push(text[i : i + step])
        out = [out[0] + r, out[1] + c]
    r, c = s.flush()
    return out[0] + r, out[1] + c


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_split(pieces):
    assert split("<think>\nweigh it\n</think>\n\nThe answer.", False, pieces) == ("weigh it\n", "The answer.")
    assert split("\nweigh it</think>The answer.", True, pieces) == ("weigh it", "The answer.")  # opened by the prompt
    assert split("No block. <think>x</think>", False, pieces) == ("", "No block. <think>x</think>")
    assert split("<think>never closed", False, pieces) == ("never closed", "")
    assert split("<thin", False, pieces) == ("", "<thin")
    assert split("a </think", True, pieces) == ("a </think", "")


def test_opened_by_the_prompt():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
