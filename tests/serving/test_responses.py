"""Answers built from fixed model outputs, read back with the openai client's own types: tool calls as
deltas (each call whole in one) and in the message, reasoning apart, finish_reason tool_calls."""

from __future__ import annotations

import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from moestream.serving.output import AnswerSplit
from moestream.serving.responses import Answer
from moestream.serving.scheduler import Event

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEMPLATE = "{%- if tools %}<tool_call>{% endif %}<think>"
OUTPUT = (
    "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def answer(max_calls=None) -> Answer:
    splits = [AnswerSplit(TEMPLATE, "auto", TOOLS, opens_thinking=False)]
    return Answer(True, "m", splits, lambda t: b"x", max_calls)


def feed(a: Answer, pieces: list[str]) -> list[dict]:
    chunks = []
    for p in pieces:
        chunks += a.event(0, Event("text", text=p))
    return chunks + a.event(0, Event("done", finish_reason="stop", prompt_tokens=5, completion_tokens=30))


def test_streamed_tool_calls_are_whole_deltas_and_add_up_to_the_message():
    a = answer()
    chunks = [ChatCompletionChunk.model_validate(c) for c in feed(a, [OUTPUT[i : i + 7] for i in range(0, 400, 7)])]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Oslo"}),
    ]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants weather.\n"
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = ChatCompletion.model_validate(a.whole())
    message = whole.choices[0].message
    assert (message.content, whole.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert [tc.id for tc in message.tool_calls] == [tc.id for tc in calls]
    assert whole.usage.total_tokens == 35


def test_parallel_tool_calls_false_keeps_the_first():
    a = answer(max_calls=1)
    feed(a, [OUTPUT])
    assert [tc["function"]["arguments"] for tc in a.whole()["choices"][0]["message"]["tool_calls"]] == [
        '{"city": "Paris"}'
    ]


def test_no_call_finishes_as_the_scheduler_said():
    a = answer()
    feed(a, ["Just text."])
    whole = ChatCompletion.model_validate(a.whole())
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].message.tool_calls is None
