"""Tool calls read from fixed model outputs in each format, whole and cut at every point as a stream cuts them."""

from __future__ import annotations

import json

import pytest

from moestream.serving.harmony import HarmonySplit
from moestream.serving.openai_fields import BadRequest
from moestream.serving.output import AnswerSplit, tool_format
from moestream.serving.tool_calls import ToolCallSplit, template_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}},
            },
        },
    }
]
WANT = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "10", "units": {"c": True}})]

OUTPUTS = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "10", "units": {"c": true}}}\n</tool_call>'
    ),
    "qwen3_xml": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        '<parameter=city>\n10\n</parameter>\n<parameter=units>\n{"c": true}\n</parameter>\n</function>\n'
        "</tool_call>"
    ),
    "glm45": (
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_weather\n"
        '<arg_key>city</arg_key>\n<arg_value>10</arg_value>\n<arg_key>units</arg_key>\n<arg_value>{"c": true}'
        "</arg_value>\n</tool_call>"
    ),
}


def run(split: ToolCallSplit, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for piece in pieces:
        c, k = split.push(piece)
        content += c
        calls += k
    return content + split.flush(), calls


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_each_format_whole_and_cut_anywhere(fmt):
    text = OUTPUTS[fmt]
    cuts = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for pieces in cuts:
        content, calls = run(ToolCallSplit(fmt, TOOLS), pieces)
        assert content == "Let me check.", pieces
        assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
        assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


def test_a_call_that_does_not_parse_stays_text_and_so_does_an_unfinished_one():
    bad = "a <tool_call>{not json}</tool_call> b"
    assert run(ToolCallSplit("hermes", TOOLS), [bad]) == (bad, [])
    cut = 'x <tool_call>{"name": "get_weather"'
    assert run(ToolCallSplit("hermes", TOOLS), [cut]) == (cut, [])
    plain = "a < b, <tool and <tool_cal"
    assert run(ToolCallSplit("hermes", TOOLS), list(plain)) == (plain, [])


CALL = '<tool_call>{"name": "get_weather", "arguments": %s}</tool_call>'
NOT_CALLS = {  # a helper's probe: each was a call (or a RecursionError); each stays text
    "nested 1000 deep": CALL % ('{"city": ' + "[" * 1000 + "}"),
    "NaN, which JSON.parse refuses": CALL % '{"days": NaN}',
    "1e400 (infinity)": CALL % '{"days": 1e400}',
    "a tool the request has not": CALL.replace("get_weather", "rm_rf") % "{}",
    "an empty name": CALL.replace("get_weather", "") % "{}",
}


@pytest.mark.parametrize("name", list(NOT_CALLS))
def test_what_a_client_could_not_take_as_a_call_stays_text(name):
    text = NOT_CALLS[name]
    for pieces in ([text], list(text)):
        assert run(ToolCallSplit("hermes", TOOLS), pieces) == (text, [])
    glm = "<tool_call>I cannot do that</tool_call>"  # a sentence is no tool's name
    assert run(ToolCallSplit("glm45", TOOLS), [glm]) == (glm, [])


def test_a_close_tag_inside_a_json_string_and_text_on_both_sides_of_a_call():
    text = 'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call>\nDone.'
    for pieces in ([text], list(text)):
        content, calls = run(ToolCallSplit("hermes", TOOLS), pieces)
        assert content == "Sure.\nDone." and [json.loads(c.arguments) for c in calls] == [{"city": "</tool_call>"}]


def test_a_broken_call_with_an_open_string_does_not_swallow_the_next_one():
    """The close-tag-in-a-string rule waited for a later close: a bad call held every later call as text."""
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "x}</tool_call>'
    text = bad + '\nok <tool_call>{"name": "get_weather", "arguments": {"city": "y"}}</tool_call>\nDone.'
    for pieces in ([text], list(text)):
        content, calls = run(ToolCallSplit("hermes", TOOLS), pieces)
        assert content == bad + "\nok\nDone." and [json.loads(c.arguments) for c in calls] == [{"city": "y"}]


def test_harmony_calls_that_do_not_parse_or_name_no_tool_stay_content():
    head = "<|start|>assistant<|channel|>commentary to=functions.%s <|constrain|>json<|message|>"
    for name, args, want in [
        ("get_weather", "{city: Paris", "{city: Paris"),
        ("get_weather", '{"days": NaN}', '{"days": NaN}'),
        ("rm_rf", "{}", "{}"),
        ("get_weather", "", None),  # no arguments: "{}"
    ]:
        s = HarmonySplit(frozenset({"get_weather"}))
        _, content = s.push(head % name + args)
        content += s.flush()[1]
        calls = s.take_calls()
        if want is None:
            assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", "{}")]
        else:
            assert content == want and calls == [], (name, args)


def test_harmony_calls_on_the_commentary_channel():
    """Both places Harmony allows the recipient; <|call|> itself ends generation, so a flush closes the call."""
    turn = (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Rome"}'
    )
    for pieces in ([turn], list(turn)):
        s, reasoning, content, calls = HarmonySplit(frozenset({"get_weather"})), "", "", []
        for p in pieces:
            r, c = s.push(p)
            reasoning, content, calls = reasoning + r, content + c, calls + s.take_calls()
        r, c = s.flush()
        calls += s.take_calls()
        assert (reasoning + r, content + c) == ("Need weather.", "")
        assert [(k.name, json.loads(k.arguments)) for k in calls] == [
            ("get_weather", {"city": c}) for c in ("Paris", "Rome")
        ]


def test_template_formats_and_the_answer_split():
    assert tool_format("{{ '<|channel|>' }}") == "harmony"
    assert tool_format("<tool_call>\n<function=x>") == "qwen3_xml"
    assert tool_format("<tool_call>{{ x }}<arg_key>") == "glm45"
    assert tool_format("{%- if tools %}<tool_call>") == "hermes"
    assert tool_format("plain") is None
    template = "{%- if tools %}<tool_call>{% endif %}<think>"
    text = "<think>\nI should call.\n</think>\n\n" + OUTPUTS["hermes"]
    for pieces in ([text], list(text)):
        s, out = AnswerSplit(template, "auto", TOOLS, opens_thinking=False), None
        from moestream.serving.output import Delta

        out = Delta()
        for p in pieces:
            out += s.push(p)
        out += s.flush()
        assert (out.reasoning, out.content, len(out.calls)) == ("I should call.\n", "Let me check.", 2)
    raw = AnswerSplit(template, "none", [], opens_thinking=False)
    assert raw.push(text).content + raw.flush().content == text


def test_earlier_calls_reach_the_template_as_objects():
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert calls[0]["function"]["arguments"] == '{"a": 1}'  # the request is left as it came
    for bad in ("{oops", "[" * 100_000):  # not JSON, or nested past the parser's limit: a 400, not a 500
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": bad}}
        with pytest.raises(BadRequest, match="tool call 'f' has arguments that are not JSON"):
            template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
