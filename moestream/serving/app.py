"""The HTTP side of `moestream serve`: OpenAI's /v1/models, /v1/completions and /v1/chat/completions
(streamed as server-sent events or whole), /health and Prometheus /metrics, over a Scheduler."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from moestream.errors import MoestreamError
from moestream.runtime.prompt_cache import metrics as prompt_cache_metrics
from moestream.serving.choices import answer_for, chat_variables, choice_jobs
from moestream.serving.errors import ApiError, Errors, parse_body
from moestream.serving.errors import error_response as _error
from moestream.serving.guard import MAX_BODY, Guard
from moestream.serving.openai_fields import CHAT, COMPLETIONS, Ask, BadRequest, check_context, read_request
from moestream.serving.prompts import Prompts, default_threads
from moestream.serving.scheduler import Event, QueueFull, Scheduler
from moestream.serving.scheduler import Request as Job
from moestream.serving.tool_calls import template_messages

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: OpenAI's older tool role


def _kind(event) -> str:
    return "invalid_request_error" if event.client else "server_error"


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message checked (a 400 where a template would fail on it), its content as one text where it is a
    list of parts (OpenAI's format): templates expect text."""
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ApiError(400, f"message role {role!r}: expected one of {', '.join(ROLES)}")
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise ApiError(400, "tool_calls: a list, in assistant messages only")
    if content is None and not (role == "assistant" and (calls or message.get("function_call"))):
        raise ApiError(400, f"a {role} message needs content (only an assistant's tool calls may come without)")
    if content is not None and not isinstance(content, (str, list)):
        raise ApiError(400, "message content must be a string or a list of text parts")
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
    reasoning_format: str = "auto",
) -> FastAPI:
    if api_key is not None and not api_key.strip():  # an empty key would let every request in
        raise MoestreamError("the API key is empty: give a key, or none to serve without one")
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

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest):
        return _error(400, str(e))

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException):  # an unknown path or method, in OpenAI's error shape
        served = "GET /health, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions"
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}; this server answers {served}")

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
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
            (
                "moestream_expert_cache_experts",
                "gauge",
                "experts of each streamed layer held in the GPU expert cache now (it gives KV caches their room)",
            ): scheduler.cache_experts,
            ("moestream_kv_cache_bytes", "gauge", "bytes of the KV caches alive: running and pooled"): (
                scheduler.engine.setup.kv_bytes() if scheduler.engine.model is not None else 0
            ),
            ("moestream_queue_length", "gauge", "requests waiting"): scheduler.queue.qsize(),
            **prompt_cache_metrics(scheduler.prompts),
            ("moestream_running_sequences", "gauge", "sequences being served"): len(scheduler.running),
            (
                "moestream_turn_milliseconds",
                "gauge",
                "a decode turn of `rows` sequences in one pass or each alone: the median of the last turns timed "
                "(what the server chooses between)",
            ): {
                f'rows="{n}",way="{"alone" if alone else "batched"}"': seconds * 1e3
                for (alone, n), seconds in sorted(scheduler.mode.timings.costs().items(), key=lambda kv: kv[0][::-1])
            },
        }
        lines = []
        for (name, kind, help_), value in values.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            series = value if isinstance(value, dict) else {"": value}  # labelled series, or one value
            lines += [f"{name}{{{labels}}} {v}" if labels else f"{name} {v}" for labels, v in series.items()]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def body_of(request: Request) -> dict[str, Any]:
        raw = b""
        async for part in request.stream():  # chunked bodies too: stop reading past the limit
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request is larger than {MAX_BODY} bytes")
        return parse_body(raw)

    async def run(request: Request, ask: Ask, prompt_tokens: list[int], chat: bool):
        check_context(len(prompt_tokens), ask, engine.n_ctx)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        answer = answer_for(engine.tokenizer, ask, prompt_tokens, model_id, chat, reasoning_format)
        choices = await prompts.off_loop(choice_jobs, ask, engine.tokenizer)  # a schema's rules, the vocab's index
        jobs = [
            Job(
                prompt_tokens,
                params,
                lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev)),
                stop=ask.stop,
                cache_prompt=ask.cache_prompt,
                constraint=constraint,
            )
            for i, (params, constraint) in enumerate(choices)
        ]
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFull as e:
            for job in jobs:
                job.cancelled.set()
            raise ApiError(503, str(e), "server_busy") from None

        if ask.stream:

            async def sse() -> AsyncIterator[str]:
                try:
                    while not answer.done:
                        i, ev = await events.get()
                        if ev.kind == "error":
                            yield f"data: {json.dumps({'error': {'message': ev.text, 'type': _kind(ev)}})}\n\n"
                            yield "data: [DONE]\n\n"  # the stream ends as every stream does
                            return
                        for chunk in answer.event(i, ev):
                            yield f"data: {json.dumps(chunk)}\n\n"
                    if ask.include_usage:
                        yield f"data: {json.dumps(answer.usage_chunk())}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    for job in jobs:  # finished, failed or the client went away: free the sequences now
                        job.cancelled.set()

            return StreamingResponse(sse(), media_type="text/event-stream")

        checked = time.monotonic()
        try:
            while not answer.done:
                try:
                    i, ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10: not yet the builtin)
                    ev = None
                if time.monotonic() - checked > 0.25:  # nobody will read the answer: free the sequences
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ApiError(499, "the client closed the connection")
                if ev is None:
                    continue
                if ev.kind == "error":
                    raise ApiError(400 if ev.client else 500, ev.text, _kind(ev))
                answer.event(i, ev)
        finally:
            for job in jobs:
                job.cancelled.set()
        return answer.whole()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt (a batch of several is refused)
        ask = read_request(body, COMPLETIONS, max_tokens, engine.tokenizer.vocab_size)
        return await run(request, ask, await prompts.encode(prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
        ask = read_request(body, CHAT, max_tokens, engine.tokenizer.vocab_size)
        variables = chat_variables(engine.tokenizer.chat_template, ask, reasoning_format)
        prompt = await prompts.encode_chat(template_messages([_plain(m) for m in messages]), **variables)
        return await run(request, ask, prompt, chat=True)

    return app
