"""One chat choice's generated text, as it streams, into OpenAI's parts: reasoning_content, content and
tool_calls. The reasoning comes apart first (Harmony's analysis channel, or a <think> block); tool calls are
read from what is left, in the format the model's template teaches (serving/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moestream.errors import MoestreamError
from moestream.serving.harmony import HarmonySplit, is_harmony
from moestream.serving.reasoning import OPEN, ThinkSplit
from moestream.serving.tool_calls import ToolCall, ToolCallSplit, parameter_types, template_format


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __iadd__(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


def tool_format(template: str | None) -> str | None:
    """The tool-call format of a chat template: harmony, or one of tool_calls.FORMATS; None if it has none."""
    if is_harmony(template):
        return "harmony"
    return template_format(template)


def check_tools(template: str | None, reasoning_format: str) -> None:
    """Why tools cannot be used with this model and these settings, as an error naming the field; or nothing."""
    if not template or "tools" not in template or tool_format(template) is None:
        raise MoestreamError(
            "tools: the model's chat template writes no tool-call format moestream reads (Qwen3's <tool_call> "
            "JSON, Qwen3.5's or GLM's XML, gpt-oss' Harmony); leave tools out"
        )
    if reasoning_format == "none" and is_harmony(template):
        raise MoestreamError("tools with reasoning_format none: gpt-oss' calls are read from its Harmony channels")


class AnswerSplit:
    """Fed a choice's text as it streams, gives each piece's Delta; flush at the end for what was held back."""

    def __init__(self, template: str | None, reasoning_format: str, tools: list[dict], opens_thinking: bool) -> None:
        harmony = is_harmony(template)
        names = frozenset(parameter_types(tools))
        self.harmony = HarmonySplit(names) if harmony and reasoning_format != "none" else None
        thinks = not harmony and reasoning_format != "none" and OPEN in (template or "")
        self.think = ThinkSplit(opens_thinking) if thinks else None
        fmt = None if harmony or not tools else template_format(template)
        self.tools = ToolCallSplit(fmt, tools) if fmt else None

    def push(self, text: str) -> Delta:
        if self.harmony is not None:
            r, c = self.harmony.push(text)
            return Delta(r, c, self.harmony.take_calls())
        r, c = self.think.push(text) if self.think is not None else ("", text)
        return Delta(r, *self._tool_split(c))

    def flush(self) -> Delta:
        if self.harmony is not None:
            r, c = self.harmony.flush()
            return Delta(r, c, self.harmony.take_calls())
        r, c = self.think.flush() if self.think is not None else ("", "")
        out = Delta(r, *self._tool_split(c))
        if self.tools is not None:
            out.content += self.tools.flush()
        return out

    def _tool_split(self, text: str) -> tuple[str, list[ToolCall]]:
        return self.tools.push(text) if self.tools is not None else (text, [])
