"""Every request field of /v1/completions and /v1/chat/completions, and what the server does with it: taken
(it changes the answer), accepted as neutral (it cannot: a user id, storage hints), or refused with a 400 that
names it. A field in no row is refused too, as OpenAI's API refuses an unknown argument: nothing is silently
ignored. `null` means the default, as in OpenAI's API. Beyond OpenAI's fields: llama-server's and vLLM's
sampling extensions (top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos), cache_prompt,
reasoning_format and chat_template_kwargs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from moestream.errors import MoestreamError
from moestream.runtime.sampling import BAN, MAX_LOGPROBS, SamplingParams
from moestream.serving.reasoning import FORMATS as REASONING_FORMATS

MAX_STOPS = 4  # as OpenAI's API
MAX_N = 16  # choices of one request, each its own sequence
DEFAULT_MAX_TOKENS = 256  # a request that gives no max_tokens: at most this, and at most the context's room
# SamplingParams' errors name the run command's flags; the server's name the request's fields
FIELD_OF_FLAG = {
    "--temp": "temperature",
    "--top-p": "top_p",
    "--top-k": "top_k",
    "--min-p": "min_p",
    "--repeat-penalty": "repeat_penalty",
    "--repeat-last-n": "repeat_last_n",
    "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty",
    "--seed": "seed",
    "--logit-bias": "logit_bias",
}
PENALTY = 2.0  # presence and frequency penalties: from -2 to 2, as OpenAI's API and vLLM
# template variables the server sets itself, so chat_template_kwargs may not: name -> where they come from
SERVER_VARIABLES = {
    "messages": "from messages",
    "tools": "from tools",
    "add_generation_prompt": "always true",
    "bos_token": "from the model file",
    "eos_token": "from the model file",
    "n_ctx": "the rendering's cap, from --ctx",
}


class BadRequest(MoestreamError):
    """A request the server answers with 400 (the message names the field)."""


BOTH, COMPLETIONS, CHAT = "both", "completions", "chat"
TAKEN, NEUTRAL, REFUSED = "taken", "neutral", "refused"

# name -> (endpoint, how, what it does or why it is refused)
FIELDS: dict[str, tuple[str, str, str]] = {
    "model": (BOTH, NEUTRAL, "one model is served; any name is answered by it"),
    "prompt": (COMPLETIONS, TAKEN, "one string, or one list of token ids"),
    "messages": (CHAT, TAKEN, "rendered with the model's chat template"),
    "max_tokens": (BOTH, TAKEN, "up to serve's --max-tokens"),
    "max_completion_tokens": (CHAT, TAKEN, "as max_tokens"),
    "n": (BOTH, TAKEN, f"up to {MAX_N} choices, each its own sequence"),
    "best_of": (COMPLETIONS, TAKEN, "only equal to n: no choice is ranked and dropped"),
    "stream": (BOTH, TAKEN, "server-sent events"),
    "stream_options": (BOTH, TAKEN, "include_usage, with stream true"),
    "stop": (BOTH, TAKEN, f"up to {MAX_STOPS} strings"),
    "temperature": (BOTH, TAKEN, "0: greedy"),
    "top_p": (BOTH, TAKEN, ""),
    "seed": (BOTH, TAKEN, "choice i samples with seed + i"),
    "logit_bias": (BOTH, TAKEN, "token id -> bias; -100 bans"),
    "presence_penalty": (BOTH, TAKEN, ""),
    "frequency_penalty": (BOTH, TAKEN, ""),
    "logprobs": (BOTH, TAKEN, "completions: how many alternatives; chat: on or off"),
    "top_logprobs": (CHAT, TAKEN, f"alternatives per token, up to {MAX_LOGPROBS}"),
    "echo": (COMPLETIONS, TAKEN, "only false: the prompt is not repeated"),
    "tools": (CHAT, TAKEN, "functions, through the chat template; calls come back as tool_calls"),
    "tool_choice": (CHAT, TAKEN, "none or auto; a forced call cannot be enforced"),
    "parallel_tool_calls": (CHAT, TAKEN, "false keeps the first call"),
    "response_format": (CHAT, TAKEN, "text, json_object (llama-server's schema too), json_schema: a token mask"),
    "reasoning_format": (CHAT, TAKEN, "none, deepseek or auto, as llama-server"),
    "reasoning_effort": (CHAT, TAKEN, "to the chat template, where it reads it (gpt-oss)"),
    "chat_template_kwargs": (CHAT, TAKEN, "variables the chat template reads (enable_thinking...)"),
    "top_k": (BOTH, TAKEN, "llama-server's"),
    "min_p": (BOTH, TAKEN, "llama-server's"),
    "repeat_penalty": (BOTH, TAKEN, "llama-server's"),
    "repeat_last_n": (BOTH, TAKEN, "llama-server's"),
    "ignore_eos": (BOTH, TAKEN, "vLLM's"),
    "cache_prompt": (BOTH, TAKEN, "llama-server's: false runs the whole prompt, no cached prefix"),
    "user": (BOTH, NEUTRAL, "an end-user id; not stored"),
    "store": (CHAT, NEUTRAL, "nothing is stored"),
    "metadata": (CHAT, NEUTRAL, "nothing is stored"),
    "service_tier": (CHAT, NEUTRAL, "one tier"),
    "safety_identifier": (CHAT, NEUTRAL, "an end-user id; not stored"),
    "prompt_cache_key": (CHAT, NEUTRAL, "a routing hint for OpenAI's cache"),
    "modalities": (CHAT, TAKEN, "only text"),
    "suffix": (COMPLETIONS, REFUSED, "no insertion (fill-in-the-middle): write the prompt in the model's format"),
    "functions": (CHAT, REFUSED, "deprecated by OpenAI: send tools"),
    "function_call": (CHAT, REFUSED, "deprecated by OpenAI: send tool_choice"),
    "audio": (CHAT, REFUSED, "moestream serves text models"),
    "prediction": (CHAT, REFUSED, "no predicted outputs (speculative decoding)"),
    "web_search_options": (CHAT, REFUSED, "no web search"),
    "verbosity": (CHAT, REFUSED, "no verbosity control; ask in the prompt"),
}


@dataclass
class Ask:
    """A request's fields as the server uses them."""

    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True  # start from a cached prefix where there is one
    tools: list[dict] = field(default_factory=list)  # empty: none, or tool_choice none
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # json_object or json_schema; None: text
    reasoning_format: str | None = None  # None: the server's
    template_variables: dict[str, Any] = field(default_factory=dict)
    max_tokens_given: bool = True  # False: the default, lowered to the room the prompt leaves


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """A 400 for a field that is refused, unknown, or belongs to the other endpoint."""
    for name in body:
        where, how, why = FIELDS.get(name, (None, REFUSED, ""))
        if where is None:
            raise BadRequest(f"{name}: not a field of /v1/{_path(endpoint)} that moestream knows; leave it out")
        if where not in (BOTH, endpoint):
            raise BadRequest(f"{name}: a field of /v1/{_path(where)}, not of /v1/{_path(endpoint)}")
        if how == REFUSED:
            raise BadRequest(f"{name}: not supported ({why})")


def _path(endpoint: str) -> str:
    return "chat/completions" if endpoint == CHAT else "completions"


def _int(body: dict, name: str, default: int, low: int, high: int | float) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}")
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number")
    return float(value)


def _penalty(body: dict, name: str) -> float:
    value = _float(body, name, 0.0)
    if not -PENALTY <= value <= PENALTY:
        raise BadRequest(f"{name} must be from {-PENALTY:g} to {PENALTY:g}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def read_request(body: dict[str, Any], endpoint: str, max_tokens: int, n_vocab: int) -> Ask:
    """The request's fields checked and read (400 naming the field for a bad one)."""
    check_fields(body, endpoint)
    body = {k: v for k, v in body.items() if v is not None}
    chat = endpoint == CHAT
    names = ("max_completion_tokens", "max_tokens")  # OpenAI's newer name first, where a client sends both
    given = [_int(body, name, 0, 0, max_tokens) for name in names if name in body]
    n_max = given[0] if given else min(DEFAULT_MAX_TOKENS, max_tokens)
    n = _int(body, "n", 1, 1, MAX_N)
    if _int(body, "best_of", n, 1, MAX_N) != n:
        raise BadRequest("best_of: only equal to n (no choice is ranked and dropped)")
    if _bool(body, "echo", False):
        raise BadRequest("echo: only false (the prompt is not repeated in the answer)")
    if body.get("modalities", ["text"]) != ["text"]:
        raise BadRequest('modalities: only ["text"]')
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise BadRequest("stream_options must be an object of include_usage (and include_obfuscation)")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer")
    try:
        params = SamplingParams(
            max_tokens=n_max,
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0, 0, n_vocab),
            min_p=_float(body, "min_p", 0.0),
            repeat_penalty=_float(body, "repeat_penalty", 1.0),
            repeat_last_n=_int(body, "repeat_last_n", 64, 0, 1 << 20),
            presence_penalty=_penalty(body, "presence_penalty"),
            frequency_penalty=_penalty(body, "frequency_penalty"),
            seed=seed,
            stop_at_eos=not _bool(body, "ignore_eos", False),
            logit_bias=_logit_bias(body.get("logit_bias", {}), n_vocab),
            logprobs=_logprobs(body, chat),
        )
    except MoestreamError as e:  # its message starts with the command line's flag: name the field instead
        flag, _, rest = str(e).partition(" ")
        raise BadRequest(f"{FIELD_OF_FLAG.get(flag, flag)} {rest}") from None
    stream = _bool(body, "stream", False)
    include_usage = _bool(options, "include_usage", False)
    if options and not stream:
        raise BadRequest("stream_options: only with stream true")
    ask = Ask(params, n, stream, include_usage, stop, _bool(body, "cache_prompt", True), max_tokens_given=bool(given))
    if chat:
        _read_chat(body, ask)
    return ask


def _logit_bias(value: Any, n_vocab: int) -> dict[int, float]:
    if not isinstance(value, dict):
        raise BadRequest("logit_bias must be an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):  # int() would take " 1 ", "1_0" and other digits
            raise BadRequest(f"logit_bias: {key!r} is not a token id")
        token = int(key)
        if not 0 <= token < n_vocab:
            raise BadRequest(f"logit_bias: token {token} is not in the vocabulary (0 to {n_vocab - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias: the bias of token {token} must be a number from -100 to 100")
        out[token] = float(bias)
    if sum(b <= BAN for b in out.values()) >= n_vocab:
        raise BadRequest(f"logit_bias bans every token of the vocabulary ({n_vocab}); ban fewer")
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """completions: logprobs N (alternatives); chat: logprobs true, top_logprobs N."""
    if not chat:
        return _int(body, "logprobs", 0, 0, MAX_LOGPROBS) if "logprobs" in body else None
    on = _bool(body, "logprobs", False)
    if "top_logprobs" in body and not on:
        raise BadRequest("top_logprobs needs logprobs: true")
    return _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if on else None


def _read_chat(body: dict, ask: Ask) -> None:
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
    choice = body.get("tool_choice", "auto")
    if choice not in ("none", "auto"):
        if choice == "required" or isinstance(choice, dict):
            raise BadRequest(
                f"tool_choice {choice!r}: a forced call cannot be enforced here; send auto (or none) and say in the "
                "prompt which tool to call"
            )
        raise BadRequest("tool_choice must be none, auto, required or a function")
    ask.tools = tools if choice == "auto" else []
    ask.parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    fmt = body.get("response_format", {"type": "text"})
    fmt = {k: v for k, v in fmt.items() if v is not None} if isinstance(fmt, dict) else fmt
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format must be {type: text}, {type: json_object} or {type: json_schema, ...}")
    extra = {"json_schema": {"json_schema"}, "json_object": {"schema"}}.get(kind, set())  # llama-server's schema
    if set(fmt) - {"type"} - extra:
        raise BadRequest(f"response_format of type {kind} takes only {', '.join(['type', *sorted(extra)])}")
    if kind == "json_object" and "schema" in fmt and not isinstance(fmt["schema"], dict):
        raise BadRequest("response_format json_object's schema (llama-server's) must be a JSON schema object")
    if kind == "json_schema" and not (
        isinstance(fmt["json_schema"], dict) and isinstance(fmt["json_schema"].get("schema"), dict)
    ):
        raise BadRequest("response_format json_schema needs json_schema.schema, a JSON schema object")
    ask.response_format = None if kind == "text" else fmt
    if ask.response_format is not None and not ask.params.stop_at_eos:  # the mask then leaves only end of text
        raise BadRequest(
            "ignore_eos with response_format: once the JSON is whole only the end of text may follow, and "
            "ignore_eos writes it as text; send one of them"
        )
    reasoning = body.get("reasoning_format")
    if reasoning is not None and reasoning not in REASONING_FORMATS:
        raise BadRequest(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
    ask.reasoning_format = reasoning
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object of template variables")
    name = next((n for n in kwargs if n in SERVER_VARIABLES), None)
    if name is not None:
        raise BadRequest(f"chat_template_kwargs.{name}: the server sets it ({SERVER_VARIABLES[name]}); leave it out")
    ask.template_variables = dict(kwargs)
    if "reasoning_effort" in body:
        if body["reasoning_effort"] not in ("minimal", "low", "medium", "high"):
            raise BadRequest("reasoning_effort must be minimal, low, medium or high")
        ask.template_variables["reasoning_effort"] = body["reasoning_effort"]


def _check_tool(tool: Any, where: str) -> None:
    """A 400 unless the tool is {"type": "function", "function": {"name": str, "parameters": object}} (parameters'
    properties, where given, an object of name -> schema: templates and the call parser read them)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
    parameters = fn.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema object")
    properties = parameters.get("properties") or {}
    if not isinstance(properties, dict) or not all(isinstance(p, (dict, bool)) for p in properties.values()):
        raise BadRequest(f"{where}.function.parameters.properties must be an object of name -> schema")


def check_template(template: str | None, ask: Ask) -> None:
    """The template variables a request sets must be ones the chat template reads: a 400 names one it does not."""
    for name in ask.template_variables:
        if name not in (template or ""):
            raise BadRequest(
                f"{'reasoning_effort' if name == 'reasoning_effort' else 'chat_template_kwargs.' + name}: the "
                "model's chat template does not read it; leave it out"
            )


def check_context(n_prompt: int, ask: Ask, n_ctx: int) -> None:
    """A 400 for an empty prompt or one that leaves no room for max_tokens; a max_tokens the request did not give
    is lowered to the room left (as llama-server generates until the context is full)."""
    if not n_prompt:
        raise BadRequest("the prompt is empty")
    if not ask.max_tokens_given:
        if n_prompt >= n_ctx:
            raise BadRequest(f"the prompt ({n_prompt} tokens) fills the context ({n_ctx}); shorten the prompt")
        ask.params = replace(ask.params, max_tokens=min(ask.params.max_tokens, n_ctx - n_prompt))
    if n_prompt + ask.params.max_tokens > n_ctx:
        raise BadRequest(
            f"the prompt ({n_prompt} tokens) plus max_tokens ({ask.params.max_tokens}) is more than the context "
            f"({n_ctx}); shorten the prompt or lower max_tokens"
        )
