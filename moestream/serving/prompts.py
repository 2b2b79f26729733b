"""Requests' prompts to token ids, off the event loop.

Chat templating (a child process a request), tokenizing and compiling a response_format take from milliseconds to
seconds; on the event loop they stall /health and every running stream meanwhile. They run on a pool of
--threads-http threads (llama-server's flag), which also bounds how many run at once; the rendered template is
capped before it is tokenized.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from moestream.errors import MoestreamError
from moestream.serving.errors import ApiError

T = TypeVar("T")


def default_threads(max_seqs: int) -> int:
    """llama-server's default for --threads-http -1: a few more than the sequences served, or the cores but one."""
    return max(max_seqs + 4, (os.cpu_count() or 1) - 1)


class Prompts:
    def __init__(self, tokenizer, n_ctx: int, threads: int):
        if threads < 1:
            raise MoestreamError(f"--threads-http {threads}: give at least 1 (-1: the default)")
        self.tokenizer, self.n_ctx = tokenizer, n_ctx
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="moestream-prompts")

    async def encode(self, prompt: Any) -> list[int]:
        """A /v1/completions prompt as token ids: a string, or the ids themselves (as clients that tokenize send)."""
        if isinstance(prompt, str):
            return await self.off_loop(self.tokenizer.encode, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            n_vocab = self.tokenizer.vocab_size
            if not all(0 <= t < n_vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {n_vocab}), the model's vocabulary")
            return list(prompt)
        raise ApiError(400, "prompt must be one string or one list of token ids")

    async def encode_chat(self, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
        """Chat messages through the model's template (variables: more of its inputs, such as tools), as ids."""
        return await self.off_loop(self._chat, messages, variables)

    def _chat(self, messages: list[dict[str, Any]], variables: dict[str, Any]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, n_ctx=self.n_ctx, **variables)
        return self.tokenizer.encode(text, add_special=False)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool; its MoestreamError a 400 naming the cause."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except MoestreamError as e:
            raise ApiError(400, str(e)) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
