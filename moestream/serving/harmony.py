"""gpt-oss's answers in Harmony: a turn is messages of `<|channel|>{channel}<|message|>{text}<|end|>`, each but
the first after `<|start|>assistant`. The final channel is the answer (`content`); the analysis channel is the
model's reasoning, which the server returns apart as `reasoning_content` (as llama.cpp's server does). A message
addressed `to=functions.NAME` (on the commentary channel) is a tool call, its text the arguments. Fed text as it
streams, a split holds back only what may be the start of a marker, and a call until its message ends.
"""

from __future__ import annotations

import re

from moestream.serving.tool_calls import ToolCall, new_call, strict_json

MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|return|>", "<|call|>")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes Harmony (llama.cpp tells gpt-oss's format by the same marker)."""
    return template is not None and "<|channel|>" in template


class HarmonySplit:
    """A turn's text, as it comes, into (reasoning, content): analysis messages are reasoning, the others
    content; headers (roles, channels) and markers are neither. Text before any marker is content."""

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        """tool_names: the request's tools, whose messages become `calls` (taken with take_calls), not content."""
        self._names, self._calls, self._call = tool_names, [], None  # _call: [name, arguments] being read
        self._route = ""  # the whole header since <|start|>: a recipient may come before or after the channel
        self._pending = ""  # text not yet placed: what follows a "<|" that may still become a marker
        self._framed = False  # a marker has been seen: text outside a message is a header
        self._header = ""  # the current header's text (role, channel, recipient)
        self._channel: str | None = None  # the channel of the message being read; None between messages

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content text adds (either may be empty)."""
        self._pending += text
        out = ["", ""]
        while self._pending:
            at = self._pending.find("<|")
            if at != 0:  # plain text up to the next "<|", or all of it but a last "<"
                chunk = self._pending[:at] if at > 0 else self._pending.removesuffix("<")
                if not chunk:
                    break  # a lone "<": wait for what follows
                self._pending = self._pending[len(chunk) :]
                self._place(chunk, out)
                continue
            marker = next((m for m in MARKERS if self._pending.startswith(m)), None)
            if marker is None:
                if any(m.startswith(self._pending) for m in MARKERS):
                    break  # may be a marker cut by the stream: wait for more
                self._place("<|", out)
                self._pending = self._pending[2:]
                continue
            self._pending = self._pending[len(marker) :]
            self._marker(marker, out)
        return out[0], out[1]

    def flush(self) -> tuple[str, str]:
        """What is still held back at the end of the turn."""
        out = ["", ""]
        self._place(self._pending, out)
        self._pending = ""
        if self._call is not None:  # <|call|> ends generation, so the server never sees it: the call is whole
            self._marker("<|call|>", out)
        return out[0], out[1]

    def take_calls(self) -> list[ToolCall]:
        """The tool calls whose messages ended since the last take."""
        calls, self._calls = self._calls, []
        return calls

    def _marker(self, marker: str, out: list[str]) -> None:
        self._framed = True
        self._route += " "  # a marker parts the header's words
        if marker == "<|message|>":
            self._channel = self._header.split()[0] if self._header.split() else ""
            to = re.search(r"to=functions\.([^\s<]+)", self._route)
            if self._names and to:
                self._call = [to[1], ""]
        elif marker in ("<|channel|>", "<|start|>"):
            self._header, self._channel = "", None
            if marker == "<|start|>":
                self._route = ""
        elif marker == "<|constrain|>":
            self._header += " "
        else:  # <|end|>, <|return|>, <|call|>: the message is over
            self._header, self._channel, self._route = "", None, ""
            if self._call is not None:
                name, text = self._call
                self._call, args = None, text.strip() or "{}"
                if name in self._names and _is_object(args):
                    self._calls.append(new_call(name, args))
                else:  # a call that does not parse, or to no tool of the request's, stays text
                    out[1] += text

    def _place(self, text: str, out: list[str]) -> None:
        if self._call is not None:
            self._call[1] += text
        elif self._channel is not None:
            out[0 if self._channel == "analysis" else 1] += text
        elif self._framed:
            self._header += text
            self._route += text
        else:
            out[1] += text


def _is_object(text: str) -> bool:
    try:
        return isinstance(strict_json(text), dict)
    except ValueError:
        return False
