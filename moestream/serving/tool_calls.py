"""Tool calls in a model's answer, in the format its chat template teaches, as OpenAI's `tool_calls`.

Three formats wrap each call in `<tool_call>...</tool_call>` and differ inside:
- Qwen3 (Hermes): `{"name": "f", "arguments": {...}}`, JSON;
- Qwen3.5 / 3.6 (Qwen3-Coder's XML): `<function=f><parameter=x>value</parameter></function>`;
- GLM-4.5 / 4.6: `f<arg_key>x</arg_key><arg_value>value</arg_value>`.
gpt-oss (Harmony) addresses a commentary message `to=functions.f`: serving/harmony.py collects those.
The XML forms write parameter values bare: a value whose schema type is not a string is read as JSON (a number,
true, an object...), as the template wrote it with tojson. A call that does not parse as strict JSON (no NaN, as a
client's JSON.parse reads it), or names no tool of the request's, stays in the text.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from moestream.errors import MoestreamError
from moestream.serving.markers import partial_tail
from moestream.serving.openai_fields import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, "call_" + uuid.uuid4().hex[:24])


def _no_constant(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"{text} is past a double's range")
    return value


def strict_json(text: str) -> Any:
    """JSON as a strict parser (a client's JSON.parse) reads it: no NaN or Infinity, nesting Python can follow;
    ValueError otherwise."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _hermes(body: str, types: dict) -> tuple[str, Any] | None:
    try:
        call = strict_json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = strict_json(args)
        except ValueError:
            return None
    return call["name"], args


def _in_json_string(text: str) -> bool:
    """Whether text (the start of a JSON value) ends inside a string: a close tag there is the string's text."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _value(text: str, schema_type: Any) -> Any:
    """A bare parameter value: text for a string parameter, else JSON where it parses."""
    text = text.removeprefix("\n").removesuffix("\n")
    if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
        return text
    try:
        return strict_json(text)
    except ValueError:
        return text


def _qwen_xml(body: str, types: dict) -> tuple[str, Any] | None:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, inner = m[1], m[2]
    params = _PARAMETER.findall(inner)
    if _PARAMETER.sub("", inner).strip():
        return None
    kinds = types.get(name, {})
    return name, {k: _value(v, kinds.get(k)) for k, v in params}


def _glm(body: str, types: dict) -> tuple[str, Any] | None:
    name, _, rest = body.strip().partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name or "\n" in name:
        return None
    rest = "<arg_key>" + rest if rest else ""
    if _ARG.sub("", rest).strip():
        return None
    kinds = types.get(name, {})
    return name, {k.strip(): _value(v, kinds.get(k.strip())) for k, v in _ARG.findall(rest)}


# name -> (how the chat template is recognised, how a call's body is read)
FORMATS = {
    "glm45": ("<arg_key>", _glm),
    "qwen3_xml": ("<function=", _qwen_xml),
    "hermes": (OPEN, _hermes),
}


def template_format(template: str | None) -> str | None:
    """Which of FORMATS a chat template teaches (None: none of them; gpt-oss's Harmony is told apart first)."""
    return next((name for name, (marker, _) in FORMATS.items() if marker in (template or "")), None)


def parameter_types(tools: list[dict]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters' JSON schema types, by tool name then parameter name."""
    out = {}
    for tool in tools:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def parse_call(fmt: str, body: str, types: dict) -> ToolCall | None:
    """One call from the text between <tool_call> and </tool_call>; None if it is not one, or names no tool of
    the request's (types: parameter_types of its tools)."""
    read = FORMATS[fmt][1](body, types)
    if read is None or read[0] not in types or not isinstance(read[1], dict):
        return None
    return new_call(read[0], json.dumps(read[1], ensure_ascii=False))


class ToolCallSplit:
    """An answer's text, as it streams, into content and whole tool calls. Held back: what may be the start of
    <tool_call>, a call from its start to its end (each call comes as one delta), and trailing blanks, which
    are dropped where a call follows them (text after a call starts on a new line), however the text is cut."""

    def __init__(self, fmt: str, tools: list[dict]) -> None:
        if fmt not in FORMATS:
            raise MoestreamError(f"tool-call format {fmt!r}: expected one of {', '.join(FORMATS)}")
        self.fmt, self.types = fmt, parameter_types(tools)
        self._pending = ""  # not yet placed
        self._blank = ""  # placed content's trailing blanks, held
        self._called = False  # a call came last: blanks that follow it are dropped
        self._said = False  # content came before: text after a call starts on a new line

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        out, calls = [], []
        while self._pending:
            at = self._pending.find(OPEN)
            if at < 0:  # no call starts: keep back only a tail that may begin one
                keep = partial_tail(self._pending, OPEN)
                self._content(self._pending[: len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep :]
                break
            self._content(self._pending[:at], out)
            self._pending = self._pending[at:]
            end = self._close(self._pending)
            if end < 0:
                break
            call = parse_call(self.fmt, self._pending[len(OPEN) : end], self.types)
            if call is None:
                self._content(self._pending[: end + len(CLOSE)], out)
            else:
                calls.append(call)
                self._blank, self._called = "", True
            self._pending = self._pending[end + len(CLOSE) :]
        return "".join(out), calls

    def _close(self, text: str) -> int:
        """Where the call text opens ends (-1: not yet). A Hermes call's "</tool_call>" inside a JSON string is
        the string's text, unless another call opens before a later close: then this one ended there, broken."""
        end = text.find(CLOSE)
        while self.fmt == "hermes" and end >= 0 and _in_json_string(text[len(OPEN) : end]):
            later, reopened = text.find(CLOSE, end + 1), text.find(OPEN, end)
            if reopened >= 0 and (later < 0 or reopened < later):
                break
            end = later
        return end

    def flush(self) -> str:
        """The held text at the end of the answer (an unfinished call stays text)."""
        out: list[str] = []
        self._content(self._pending, out)
        self._pending = ""
        rest = "".join(out) + ("" if self._called else self._blank)
        self._blank = ""
        return rest

    def _content(self, text: str, out: list[str]) -> None:
        if self._called:
            text = text.lstrip()
            self._called = not text
            if text and self._said:  # "Sure." <call> "Done." reads "Sure.\nDone.", not "Sure.Done."
                text = "\n" + text
        if not text:
            return
        body = text.rstrip()
        if body:
            out.append(self._blank + body)
            self._blank, self._said = "", True
        self._blank += text[len(body) :]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: earlier tool calls' arguments as objects (GLM's template iterates them;
    Qwen's writes a mapping as JSON), where OpenAI's clients send them as JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
                        raise BadRequest(
                            f"messages: tool call {fn.get('name')!r} has arguments that are not JSON"
                        ) from None
                    call = call | {"function": fn | {"arguments": args}}
                fixed.append(call)
            m = m | {"tool_calls": fixed}
        out.append(m)
    return out
