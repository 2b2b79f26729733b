"""A thinking model's `<think>...</think>` block apart from its answer, as llama-server's `--reasoning-format
deepseek` returns it (`reasoning_content`). Qwen3 opens the block itself; Qwen3.5/3.6 templates open it in the
prompt, so the answer starts inside it (`open_at_start`). A block only counts at the start of the answer."""

from __future__ import annotations

from moestream.serving.markers import partial_tail

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek", "auto")  # llama-server's --reasoning-format values taken here


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the answer inside a think block (it ends with an open <think>)."""
    return prompt.rstrip().endswith(OPEN)


class ThinkSplit:
    """The answer's text, as it streams, into (reasoning, content); blanks that follow either tag are dropped.
    Held back: what may still become a tag."""

    def __init__(self, open_at_start: bool = False) -> None:
        self._state = "reasoning" if open_at_start else "start"  # start | reasoning | content
        self._pending = ""
        self._strip = open_at_start  # drop blanks at the start of the current part

    def push(self, text: str) -> tuple[str, str]:
        self._pending += text
        out = ["", ""]
        while self._pending:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(OPEN):
                    self._pending, self._state, self._strip = head[len(OPEN) :], "reasoning", True
                    continue
                if not head or OPEN.startswith(head):
                    break  # blanks, or a tag cut by the stream: wait
                self._state = "content"
            if self._state == "content":
                self._emit(self._pending, out, 1)
                self._pending = ""
                break
            at = self._pending.find(CLOSE)
            if at >= 0:
                self._emit(self._pending[:at], out, 0)
                self._pending, self._state, self._strip = self._pending[at + len(CLOSE) :], "content", True
                continue
            keep = partial_tail(self._pending, CLOSE)
            self._emit(self._pending[: len(self._pending) - keep], out, 0)
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return out[0], out[1]

    def flush(self) -> tuple[str, str]:
        """What is still held at the end: an unclosed block's tail stays reasoning."""
        out = ["", ""]
        self._emit(self._pending, out, 0 if self._state == "reasoning" else 1)
        self._pending = ""
        return out[0], out[1]

    def _emit(self, text: str, out: list[str], part: int) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        out[part] += text
