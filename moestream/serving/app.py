"""The HTTP side of `moestream serve`: OpenAI's /v1/models, /v1/completions and /v1/chat/completions
(streamed as server-sent events or whole), /health and Prometheus /metrics, over a Scheduler."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from moestream.errors import MoestreamError
from moestream.runtime.prompt_cache import metrics as prompt_cache_metrics
from moestream.runtime.sampling import SamplingParams
from moestream.serving.errors import ApiError, Errors, parse_body
from moestream.serving.errors import error_response as _error
from moestream.serving.guard import MAX_BODY, Guard
from moestream.serving.harmony import HarmonySplit, is_harmony
from moestream.serving.prompts import Prompts, default_threads
from moestream.serving.scheduler import Event, QueueFull, Scheduler
from moestream.serving.scheduler import Request as Job

MAX_STOPS = 4  # as OpenAI's API


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message whose content is a list of parts (OpenAI's format) as one text: templates expect text."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "message content parts must be text parts with a string 'text'")
        return message | {"content": "".join(texts)}
    return message


def create_app(
    scheduler: Scheduler,
    model_id: str,
    api_key: str | None = None,
    max_tokens: int = 4096,
    threads_http: int | None = None,
) -> FastAPI:
    engine = scheduler.engine
    threads = threads_http if threads_http is not None else default_threads(scheduler.max_seqs)
    prompts = Prompts(engine.tokenizer, engine.n_ctx, threads)  # templating and tokenizing: off the event loop
    app = FastAPI(title="moestream")
    started = time.time()

    app.add_middleware(Guard, api_key=api_key)
    app.add_middleware(Errors)  # the outermost of ours: it sees every exception no handler answered

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e.status, e.message, e.kind)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": int(started), "owned_by": "moestream"}],
        }

    @app.get("/metrics")
    async def metrics():
        s = scheduler.stats
        busy = s.prefill_s + s.decode_s
        uptime = time.time() - started
        values = {
            ("moestream_prompt_tokens_total", "counter", "prompt tokens run"): s.prompt_tokens,
            ("moestream_generated_tokens_total", "counter", "tokens generated"): s.decode_tokens,
            ("moestream_requests_total", "counter", "requests admitted"): s.requests,
            ("moestream_requests_failed_total", "counter", "requests that ended in an error"): s.failed,
            ("moestream_batched_turns_total", "counter", "decode turns of several sequences in one pass"): (
                s.batched_turns
            ),
            ("moestream_alone_turns_total", "counter", "decode turns of several sequences, each alone"): (
                s.alone_turns
            ),
            ("moestream_prefill_tokens_per_second", "gauge", "prompt tokens / time prefilling"): (
                s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0
            ),
            ("moestream_decode_tokens_per_second", "gauge", "generated tokens / time decoding"): (
                s.decode_tokens / s.decode_s if s.decode_s else 0.0
            ),
            ("moestream_link_gigabytes_per_second", "gauge", "expert bytes moved / busy time, GB/s"): (
                scheduler.link_bytes / busy / 1e9 if busy else 0.0
            ),
            ("moestream_uptime_seconds", "counter", "seconds since the server started"): uptime,
            (
                "moestream_idle_ratio",
                "gauge",
                "fraction of uptime with no forward pass running (the device idle between passes)",
            ): max(0.0, 1.0 - busy / uptime) if uptime else 1.0,
            (
                "moestream_expert_cache_hit_ratio",
                "gauge",
                "streamed layers' expert picks in decode held in the GPU expert cache (0: none guessed or cached)",
            ): s.held / s.picks if s.picks else 0.0,
            (
                "moestream_prefetch_hit_ratio",
                "gauge",
                "streamed layers' expert picks in decode that the guess a layer ahead named (0: no guesses)",
            ): s.guessed / s.picks if s.picks else 0.0,
            ("moestream_queue_length", "gauge", "requests waiting"): scheduler.queue.qsize(),
            **prompt_cache_metrics(scheduler.prompts),
            ("moestream_running_sequences", "gauge", "sequences being served"): len(scheduler.running),
        }
        lines = []
        for (name, kind, help_), value in values.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def body_of(request: Request) -> dict[str, Any]:
        raw = b""
        async for part in request.stream():  # chunked bodies too: stop reading past the limit
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request is larger than {MAX_BODY} bytes")
        return parse_body(raw)

    def job_of(body: dict[str, Any], prompt_tokens: list[int], emit) -> Job:
        body = {k: v for k, v in body.items() if v is not None}  # null means the default, as OpenAI's API
        n = body.get("max_tokens", body.get("max_completion_tokens", 256))
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= max_tokens:
            raise ApiError(400, f"max_tokens must be an integer from 0 to {max_tokens}")
        if not prompt_tokens:
            raise ApiError(400, "the prompt is empty")
        if len(prompt_tokens) + n > engine.n_ctx:
            raise ApiError(
                400,
                f"the prompt ({len(prompt_tokens)} tokens) plus max_tokens ({n}) is more than the context "
                f"({engine.n_ctx}); shorten the prompt or lower max_tokens",
            )
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "seed must be an integer")
        try:
            params = SamplingParams(
                max_tokens=n,
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                top_k=int(body.get("top_k", 0)),  # this and the rest below: llama-server's names and meanings
                min_p=float(body.get("min_p", 0.0)),
                repeat_penalty=float(body.get("repeat_penalty", 1.0)),
                repeat_last_n=int(body.get("repeat_last_n", 64)),
                presence_penalty=float(body.get("presence_penalty", 0.0)),
                frequency_penalty=float(body.get("frequency_penalty", 0.0)),
                seed=seed,
                stop_at_eos=not body.get("ignore_eos", False),  # vLLM's extension, for benchmarks
            )
        except (MoestreamError, TypeError, ValueError) as e:
            raise ApiError(400, f"bad sampling parameters: {e}") from None
        if not isinstance(cache_prompt := body.get("cache_prompt", True), bool):
            raise ApiError(400, "cache_prompt must be true or false")
        return Job(prompt_tokens, params, emit, stop=stop, cache_prompt=cache_prompt)

    async def run(request: Request, body: dict[str, Any], prompt_tokens: list[int], chat: bool):
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = job_of(body, prompt_tokens, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), "server_busy") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        # gpt-oss: the analysis channel comes back apart from the answer, as reasoning_content
        split = HarmonySplit() if chat and is_harmony(engine.tokenizer.chat_template) else None

        def response(text: str | None, finish: str | None, streamed: bool, reasoning: str = "") -> dict:
            """OpenAI's object for a completion or chat answer: a streamed chunk (text None: no content) or
            the whole answer; reasoning, where there is some, as reasoning_content beside the content."""
            if not chat:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                obj = "text_completion"
            elif streamed:
                delta = {} if text is None else {"role": "assistant", "content": text}
                if reasoning:
                    delta = {"role": "assistant", "content": text or None, "reasoning_content": reasoning}
                choice, obj = {"index": 0, "delta": delta, "finish_reason": finish}, "chat.completion.chunk"
            else:
                message = {"role": "assistant", "content": text}
                if reasoning:
                    message["reasoning_content"] = reasoning
                choice, obj = {"index": 0, "message": message, "finish_reason": finish}, "chat.completion"
            return {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice]}

        def parts(text: str, last: bool) -> tuple[str, str]:
            """(reasoning, content) of generated text: all content unless the answer is Harmony."""
            if split is None:
                return "", text
            r, c = split.push(text)
            if last:
                rest = split.flush()
                r, c = r + rest[0], c + rest[1]
            return r, c

        def usage_of(ev: Event) -> dict:
            return {
                "prompt_tokens": ev.prompt_tokens,
                "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
            }

        if body.get("stream"):
            include_usage = bool(options.get("include_usage"))

            async def sse() -> AsyncIterator[str]:
                try:
                    while True:
                        ev = await events.get()
                        if ev.kind == "text" and split is None:
                            yield f"data: {json.dumps(response(ev.text, None, streamed=True))}\n\n"
                            continue
                        if ev.kind == "text" or (ev.kind == "done" and split is not None):
                            reasoning, content = parts(ev.text if ev.kind == "text" else "", ev.kind == "done")
                            if reasoning or content:  # a marker alone adds neither
                                chunk = response(content or None, None, streamed=True, reasoning=reasoning)
                                yield f"data: {json.dumps(chunk)}\n\n"
                            if ev.kind == "text":
                                continue
                        if ev.kind == "done":
                            yield f"data: {json.dumps(response(None, ev.finish_reason, streamed=True))}\n\n"
                            if include_usage:
                                last = response(None, None, streamed=True) | {"choices": [], "usage": usage_of(ev)}
                                yield f"data: {json.dumps(last)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            yield f"data: {json.dumps({'error': {'message': ev.text, 'type': 'server_error'}})}\n\n"
                            yield "data: [DONE]\n\n"  # the stream ends as every stream does
                            return
                finally:
                    job.cancelled.set()  # finished, failed or the client went away: free the sequence now

            return StreamingResponse(sse(), media_type="text/event-stream")

        text, checked = "", time.monotonic()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10: not yet the builtin)
                    ev = None
                if time.monotonic() - checked > 0.25:  # nobody will read the answer: free the sequence
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ApiError(499, "the client closed the connection")
                if ev is None:
                    continue
                if ev.kind == "text":
                    text += ev.text
                elif ev.kind == "error":
                    raise ApiError(500, ev.text, "server_error")
                else:
                    break
        finally:
            job.cancelled.set()
        reasoning, text = parts(text, last=True)
        return response(text, ev.finish_reason, False, reasoning) | {"usage": usage_of(ev)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return await run(request, body, await prompts.encode(prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
        return await run(request, body, await prompts.encode_chat([_plain(m) for m in messages]), chat=True)

    return app
