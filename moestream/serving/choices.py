"""From a read request to what the scheduler runs and how its answer is built: the chat template's variables
(tools included), each choice's sampling (its own seed and constraint) and the request's Answer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moestream.errors import MoestreamError
from moestream.runtime.sampling import Constraint, SamplingParams
from moestream.serving.openai_fields import Ask, BadRequest, check_template
from moestream.serving.output import AnswerSplit, check_tools
from moestream.serving.reasoning import opens_thinking
from moestream.serving.responses import Answer


def chat_variables(template: str | None, ask: Ask, reasoning_format: str) -> dict[str, Any]:
    """What the chat template is rendered with beyond the messages: the request's variables and its tools."""
    check_template(template, ask)
    variables = dict(ask.template_variables)
    if ask.tools:
        try:
            check_tools(template, ask.reasoning_format or reasoning_format)
        except MoestreamError as e:
            raise BadRequest(str(e)) from None
        variables["tools"] = ask.tools
    return variables


def choice_jobs(ask: Ask, tokenizer) -> list[tuple[SamplingParams, Constraint | None]]:
    """Each choice's sampling: choice i draws with seed + i (the same draws otherwise), and its own constraint."""
    out, rules = [], _rules(ask)
    for i in range(ask.n):
        seed = None if ask.params.seed is None else (ask.params.seed + i) % 2**64
        out.append((replace(ask.params, seed=seed), _constraint(rules, tokenizer)))
    return out


def _rules(ask: Ask) -> dict | None:
    """The response_format's rules, made once for all the choices."""
    if ask.response_format is None:
        return None
    from moestream.runtime.json_constraint import schema_of

    try:
        return schema_of(ask.response_format)
    except MoestreamError as e:
        raise BadRequest(f"response_format: {e}") from None


def _constraint(rules: dict | None, tokenizer) -> Constraint | None:
    from moestream.runtime.json_constraint import JsonConstraint

    return None if rules is None else JsonConstraint(tokenizer, rules)


def answer_for(
    tokenizer, ask: Ask, prompt_tokens: list[int], model_id: str, chat: bool, reasoning_format: str
) -> Answer:
    """The request's Answer: each chat choice split by the model's formats (reasoning, tool calls)."""
    splits: list[AnswerSplit | None] = [None] * ask.n
    if chat:
        opened = opens_thinking(tokenizer.decode(prompt_tokens[-8:]))
        fmt = ask.reasoning_format or reasoning_format
        splits = [AnswerSplit(tokenizer.chat_template, fmt, ask.tools, opened) for _ in range(ask.n)]
    answer = Answer(chat, model_id, splits, tokenizer.token_bytes, None if ask.parallel_tool_calls else 1)
    answer.logprobs_on = ask.params.logprobs is not None
    return answer
