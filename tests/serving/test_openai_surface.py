"""The OpenAI fields clients send, through the official openai client on 127.0.0.1 over a generated model:
n choices, logprobs, logit_bias, tools through the chat template, template variables, and a 400 naming every
field that is not taken."""

from __future__ import annotations

import json

import openai
import pytest
from local_server import LocalServer

import moestream

PROMPT = "The lighthouse keeper"
MESSAGES = [{"role": "user", "content": "Lighthouse keepers"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def engine(model_file):
    e = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=2048, ubatch=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(engine):
    srv = LocalServer(engine, max_seqs=4)
    yield openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    srv.stop()


def test_n_greedy_choices_each_equal_the_one_alone(client):
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    many = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [one.choices[0].text] * 3
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    chat_one = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, n=2, stream=True
    )
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [chat_one.choices[0].message.content] * 2
    assert finishes == [chat_one.choices[0].finish_reason] * 2


def test_n_sampled_choices_differ_and_a_seed_repeats_them(client):
    def draw():
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.5, n=2, seed=5)
        return [c.text for c in r.choices]

    first = draw()
    assert first[0] != first[1]  # seed + i per choice
    assert draw() == first


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen <= 0  # a dict by text: tokens of partial characters share one
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True
    )
    tokens = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_and_a_logit_bias_ban(client, engine):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    token = first.choices[0].logprobs.tokens[0]
    tok = engine.tokenizer
    ids = [i for i in range(tok.vocab_size) if tok.token_bytes(i).decode("utf-8", errors="replace") == token]
    banned = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, logit_bias={str(i): -100 for i in ids}
    )
    assert banned.choices[0].logprobs.tokens[0] != token


def test_tools_reach_the_template(client, engine):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, temperature=0, tools=TOOLS, tool_choice="auto"
    )
    rendered = engine.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    assert "get_weather" in rendered
    assert with_tools.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special=False))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    none = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # none drops the tools
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Brest"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "fog"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=1, temperature=0, tools=TOOLS)
    want = engine.tokenizer.apply_chat_template(
        [
            *history[:1],
            history[1]
            | {
                "tool_calls": [
                    history[1]["tool_calls"][0] | {"function": {"name": "get_weather", "arguments": {"city": "Brest"}}}
                ]
            },
            history[2],
        ],
        tools=TOOLS,
    )
    assert '"arguments": {"city": "Brest"}' in want
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(want, add_special=False))


def test_template_variables(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    no_think = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=1,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert no_think.usage.prompt_tokens > plain.usage.prompt_tokens  # the empty <think></think> block
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.colour"):
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": {"colour": 1}}
        )
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):  # ChatML reads no such variable
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, reasoning_effort="low")
    for name in ("messages", "tools", "add_generation_prompt"):  # read by the template, but the server's to set
        with pytest.raises(openai.BadRequestError, match=f"chat_template_kwargs.{name}: the server sets it"):
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": {name: []}}
            )


@pytest.mark.parametrize(
    ("endpoint", "fields", "word"),
    [
        ("completions", {"frobnicate": 1}, "frobnicate: not a field"),
        ("completions", {"suffix": "x"}, "suffix: not supported"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"tools": TOOLS}, "tools: a field of /v1/chat/completions"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"n": 17}, "n must be"),
        ("completions", {"logit_bias": {"99999": 1}}, "not in the vocabulary"),
        ("completions", {"logit_bias": {"5": 101}}, "from -100 to 100"),
        ("chat", {"tool_choice": "required", "tools": TOOLS}, "cannot be enforced"),
        ("chat", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": TOOLS}, "forced"),
        ("chat", {"tools": [{"type": "custom"}]}, r"tools\[0\] must be"),
        ("chat", {"tools": [1]}, r"tools\[0\] must be"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters must"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
            r"tools\[0\].function.parameters.properties must",
        ),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": "x"}}, "json_schema.schema"),
        ("chat", {"response_format": {"type": "text", "x": 1}}, "response_format of type text takes only type"),
        ("chat", {"max_completion_tokens": "x"}, "max_completion_tokens must be"),
        ("chat", {"stream_options": {"include_usage": True}}, "only with stream true"),
        ("completions", {"presence_penalty": -3}, "presence_penalty must be from -2 to 2"),
        ("completions", {"frequency_penalty": 1e308}, "frequency_penalty must be"),
        ("completions", {"logit_bias": {" 1 ": 1}}, "is not a token id"),
        ("completions", {"temperature": -1}, r"temperature -1.0: must be >= 0"),
        ("completions", {"top_p": 0}, r"top_p 0.0: must be in \(0, 1\]"),
        ("chat", {"functions": [{"name": "f"}]}, "functions: not supported"),
        ("chat", {"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos with response_format"),
        ("chat", {"reasoning_format": "loud"}, "reasoning_format"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"stream_options": {"chunk": 1}}, "stream_options"),
    ],
)
def test_every_field_not_taken_is_a_400_naming_it(client, endpoint, fields, word):
    with pytest.raises(openai.BadRequestError, match=word):
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=fields)
        else:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=fields)


def test_what_a_request_gets_wrong_is_a_400_and_what_it_leaves_out_has_a_default(client, engine):
    """Bans of the whole vocabulary and a role no template knows are the client's (400, not 500); a one-token
    prompt, a default max_tokens near a full context and a vanishing repeat penalty are answered."""
    n_vocab = engine.tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError, match="bans every token"):
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, logit_bias={str(i): -100 for i in range(n_vocab)}
        )
    with pytest.raises(openai.BadRequestError, match="role 'wizard'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="needs content"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": None}], max_tokens=1)
    assert client.completions.create(model="tiny", prompt=[5], max_tokens=2).usage.prompt_tokens == 1
    tool = {"type": "function", "function": {"name": "f", "parameters": None}}
    r = client.chat.completions.create(  # nulls inside objects mean the default, as at the top level
        model="tiny",
        messages=[*MESSAGES, {"role": "function", "name": "f", "content": "{}"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": None},
        extra_body={"response_format": {"type": "text", "json_schema": None}, "tools": [tool]},
    )
    assert [c for c in r if c.choices]
    r = client.completions.create(model="tiny", prompt=[5] * 2040, temperature=0)  # 8 positions left of 2048
    assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("length", "stop")
    r = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=1, extra_body={"repeat_penalty": 1e-300}
    )
    assert r.usage.completion_tokens >= 1


def test_neutral_fields_are_accepted(client):
    r = client.chat.completions.create(
        model="any-name",
        messages=MESSAGES,
        max_tokens=1,
        user="u1",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        parallel_tool_calls=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(r)[-1].usage.completion_tokens == 1
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, user="u1", best_of=1, echo=False)
    assert c.usage.completion_tokens == 1


def test_response_format_is_enforced(client):
    """A random model, sampled: json_object and json_schema answers parse, the schema's answers follow it."""
    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["calm", "storm"]}, "n": {"type": "integer"}},
        "required": ["mood", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, temperature=1.0, seed=3, n=2, response_format=fmt
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert set(value) == {"mood", "n"} and value["mood"] in ("calm", "storm") and isinstance(value["n"], int)
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, temperature=1.0, seed=4, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":  # a random model may not close its object in 80 tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    typed = {"type": "object", "properties": {"n": {"enum": [7, 8]}}, "required": ["n"]}  # llama-server's form
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        seed=6,
        response_format={"type": "json_object", "schema": typed},
        logprobs=True,
        top_logprobs=5,  # tokens the schema masks among them: -inf was a 500 (JSON has no infinity)
    )
    assert json.loads(r.choices[0].message.content)["n"] in (7, 8)
    tops = [t.logprob for token in r.choices[0].logprobs.content for t in token.top_logprobs]
    assert len(tops) == 5 * len(r.choices[0].logprobs.content) and -9999.0 in tops
    odd = {"type": "object", "properties": {'say "hi"': {"enum": ['"', "a\\b"]}}, "required": ['say "hi"']}
    fmt = {"type": "json_schema", "json_schema": {"name": "odd", "schema": odd}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, seed=5, response_format=fmt)
    assert json.loads(r.choices[0].message.content)['say "hi"'] in ('"', "a\\b")  # names and values with escapes
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 3}}}
    with pytest.raises(openai.BadRequestError, match="minLength"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format=bad)


def test_reasoning_format_none_leaves_harmony_raw_and_a_template_without_tools_refuses_them(model_file):
    engine = moestream.load(model_file("tiny-gpt-oss", "Q8_0"), device="cpu", progress=False, n_ctx=1024)
    srv = LocalServer(engine)
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        rendered = engine.tokenizer.apply_chat_template(MESSAGES)
        raw = c.completions.create(model="m", prompt=rendered, max_tokens=12, temperature=0).choices[0].text
        r = c.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"reasoning_format": "none"}
        )
        assert r.choices[0].message.content == raw
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        with pytest.raises(openai.BadRequestError, match="tools: the model's chat template"):
            c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, tools=TOOLS)
    finally:
        srv.stop()
        engine.close()


def test_think_blocks_come_back_as_reasoning_content(client, engine):
    """The model made to write <think> (a bias of 100 on that token): the first opens the block, the rest is
    reasoning; reasoning_format none leaves it all in the content."""
    think = engine.tokenizer.encode("<think>", add_special=False)
    assert len(think) == 1
    ask = dict(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logit_bias={str(think[0]): 100})
    r = client.chat.completions.create(**ask)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("<think><think>", "")
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == (
        "<think><think>"
    )
    raw = client.chat.completions.create(**ask, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == "<think>" * 3
    assert getattr(raw.choices[0].message, "reasoning_content", None) is None


def test_a_stop_string_cuts_the_logprobs_with_the_text(client):
    """The tokens whose text starts past a stop string's cut go unreported, whole and streamed (they were sent
    with the last text, and a token held back as a possible stop string's start was reported early)."""
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1).choices[0]
    tokens, offsets = full.logprobs.tokens, full.logprobs.text_offset
    k = next(i for i in range(3, len(tokens) - 1) if tokens[i].isprintable() and tokens[i + 1].isprintable())
    stop = full.text[offsets[k + 1] - 1 : offsets[k + 1] + 1]  # token k's last character, token k+1's first
    cut = full.text.find(stop)
    want = [t for t, o in zip(tokens, offsets, strict=True) if o < cut]
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stop=[stop]
    ).choices[0]
    assert whole.finish_reason == "stop" and whole.text == full.text[:cut]
    assert whole.logprobs.tokens == want
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stop=[stop], stream=True
    )
    streamed = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens]
    assert streamed == want


def test_a_streamed_choice_that_says_nothing_still_opens_with_the_role(client):
    chunks = list(
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0, n=2, stream=True, seed=1)
    )
    for i in range(2):
        deltas = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert deltas[0].delta.role == "assistant" and deltas[0].finish_reason is None
        assert deltas[-1].finish_reason == "length" and deltas[-1].delta.role is None
