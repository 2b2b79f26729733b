"""OpenAI's response objects for one request, built from its choices' scheduler events: streamed chunks as
they come, or the whole answer at the end (the same text either way). Chat choices go through an AnswerSplit
(reasoning_content, content, tool_calls); a choice that called a tool finishes with `tool_calls`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moestream.runtime.sampling import TokenLogprob
from moestream.serving.output import AnswerSplit, Delta
from moestream.serving.scheduler import Event


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class _Choice:
    split: AnswerSplit | None  # chat only
    text: Delta = field(default_factory=Delta)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # characters of text before the next logprob entry (completions' text_offset)
    finish: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its sequence took from the prompt cache
    started: bool = False  # a streamed chat choice's first chunk carries the role
    calls: int = 0  # tool calls sent so far


class Answer:
    """One request's choices: `event` gives the chunks a scheduler event makes, `whole` the finished answer."""

    def __init__(
        self,
        chat: bool,
        model_id: str,
        splits: list[AnswerSplit | None],
        token_bytes: Callable[[int], bytes],
        max_calls: int | None = None,
    ) -> None:
        self.chat, self.model_id, self.token_bytes, self.max_calls = chat, model_id, token_bytes, max_calls
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice(s) for s in splits]
        self.prompt_tokens = 0
        self.logprobs_on = False

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    @property
    def usage(self) -> dict[str, Any]:
        """The prompt counted once; cached: the prompt tokens every choice's sequence took from the cache."""
        cached = min(c.cached_tokens for c in self.choices)
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices), cached)

    def event(self, index: int, ev: Event) -> list[dict]:
        """The chunks a text or done event of choice `index` makes (it is also kept for `whole`)."""
        c = self.choices[index]
        if ev.kind == "done":
            self.prompt_tokens, c.completion_tokens, c.cached_tokens = (
                ev.prompt_tokens,
                ev.completion_tokens,
                ev.cached_tokens,
            )
        delta = self._delta(c, ev.text, last=ev.kind == "done")
        chunks = [self._chunk(index, delta, ev.logprobs)] if delta or ev.logprobs else []
        c.logprobs += ev.logprobs
        if ev.kind == "done":
            c.finish = "tool_calls" if c.calls and ev.finish_reason == "stop" else ev.finish_reason
            if self.chat and not c.started:  # nothing said: the role still opens the choice, as OpenAI's streams
                chunks.append(self._chunk(index, Delta(), []))
            chunks.append(self._chunk(index, Delta(), [], c.finish))
        return chunks

    def _delta(self, c: _Choice, text: str, last: bool) -> Delta:
        if c.split is None:
            delta = Delta(content=text)
        else:
            delta = c.split.push(text)
            if last:
                delta += c.split.flush()
        if self.max_calls is not None:  # parallel_tool_calls false: the first call only
            delta.calls = delta.calls[: max(0, self.max_calls - c.calls)]
        c.text += delta
        return delta

    def _chunk(self, index: int, delta: Delta, logprobs: list[TokenLogprob], finish: str | None = None) -> dict:
        c = self.choices[index]
        lp = self._logprobs(c, logprobs) if self.logprobs_on else None
        if not self.chat:
            choice = {"index": index, "text": delta.content, "logprobs": lp, "finish_reason": finish}
            return self._object("text_completion", [choice])
        out: dict[str, Any] = {} if c.started else {"role": "assistant"}
        c.started = True
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content or (delta and not finish):
            out["content"] = delta.content or None
        if delta.calls:
            out["tool_calls"] = [call.as_openai(c.calls + i) for i, call in enumerate(delta.calls)]
            c.calls += len(delta.calls)
        choice = {"index": index, "delta": out, "logprobs": lp, "finish_reason": finish}
        return self._object("chat.completion.chunk", [choice])

    def whole(self) -> dict:
        """The finished answer, with usage."""
        choices = []
        for i, c in enumerate(self.choices):
            lp = self._logprobs(_Choice(None), c.logprobs) if self.logprobs_on else None
            if not self.chat:
                choices.append({"index": i, "text": c.text.content, "logprobs": lp, "finish_reason": c.finish})
                continue
            message: dict[str, Any] = {"role": "assistant", "content": c.text.content or None}
            if c.text.reasoning:
                message["reasoning_content"] = c.text.reasoning
            if c.text.calls:
                message["tool_calls"] = [call.as_openai() for call in c.text.calls]
            elif message["content"] is None:
                message["content"] = ""
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish})
        return self._object("chat.completion" if self.chat else "text_completion", choices) | {"usage": self.usage}

    def usage_chunk(self) -> dict:
        """The last streamed chunk when include_usage is asked: no choices, the usage."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": self.usage}

    def _object(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id, "choices": choices}

    def _logprobs(self, c: _Choice, entries: list[TokenLogprob]) -> dict:
        """OpenAI's logprobs of some tokens: chat's {content: [...]}, completions' four parallel lists."""
        text = [self.token_bytes(e.token) for e in entries]
        if self.chat:
            return {
                "content": [
                    {
                        "token": _text(b),
                        "logprob": e.logprob,
                        "bytes": list(b),
                        "top_logprobs": [
                            {"token": _text(tb := self.token_bytes(t)), "logprob": lp, "bytes": list(tb)}
                            for t, lp in e.top
                        ],
                    }
                    for e, b in zip(entries, text, strict=True)
                ],
                "refusal": None,
            }
        offsets = []
        for b in text:
            offsets.append(c.offset)
            c.offset += len(_text(b))
        return {
            "tokens": [_text(b) for b in text],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top_by_text(e) for e in entries],
            "text_offset": offsets,
        }

    def _top_by_text(self, entry: TokenLogprob) -> dict[str, float]:
        """Completions' alternatives, keyed by text: tokens of partial characters read alike, the likelier kept."""
        out: dict[str, float] = {}
        for t, lp in entry.top:
            out.setdefault(_text(self.token_bytes(t)), lp)
        return out


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")
