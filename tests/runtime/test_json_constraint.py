"""The JSON token mask: the validator on fixed texts, cut at every byte; the mask on a real tokenizer; a
generated model's sampled answers always parse and follow the schema."""

from __future__ import annotations

import json

import pytest

import moestream
from moestream.errors import MoestreamError
from moestream.runtime.json_constraint import JsonConstraint, complete, feed, rules, schema_of
from moestream.runtime.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "mood": {"enum": ["calm", "storm"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "mood"],
    "additionalProperties": False,
}


def accepts(schema: dict, text: str, compiled: bool = False) -> bool:
    """Whether text is one value the schema allows (compiled: schema is rules already)."""
    state = (("value", schema if compiled else rules(schema)),)
    for b in text.encode():
        state = feed(state, b)
        if state is None:
            return False
    return complete(state)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ann", "mood": "calm"}', True),
        ('{"name":"A\\u00e9\\n","age":-12,"mood":"storm","tags":["x",""],"ok":null}', True),
        ('{ "mood" : "calm" , "name" : "é" }', True),
        ('{"name": "Ann"}', False),  # mood is required
        ('{"name": "Ann", "mood": "rain"}', False),  # not in the enum
        ('{"name": "Ann", "mood": "calm", "age": 1.5}', False),  # an integer
        ('{"name": "Ann", "mood": "calm", "extra": 1}', False),  # only the listed properties
        ('{"name": "Ann", "name": "Bo", "mood": "calm"}', False),  # a key twice
        ('{"name": 3, "mood": "calm"}', False),
        ('{"name": "Ann", "mood": "calm"', False),  # not closed
        ('{"name": "Ann", "mood": "calm", "tags": [1]}', False),
        ('{"name": "Ann", "mood": "calm", "ok": true}  ', True),
        ('{"name": "Ann", "mood": "calm"} x', False),
    ],
)
def test_the_validator_against_the_schema(text, ok):
    assert accepts(SCHEMA, text) == ok


def test_any_json_object_and_numbers():
    obj = {"type": "object"}
    assert accepts(obj, '{"a": [1, -0.5e+3, {"b": null}], "c": "d"}')
    assert not accepts(obj, "[1]") and not accepts(obj, '{"a": 01}') and not accepts(obj, '{"a": 1.}')
    assert accepts(obj, '{"a\\"b\\u00e9": 1}') and not accepts(obj, '{"a\\x": 1}')  # escapes in any key
    assert accepts({"type": "number"}, "-12.5E3") and not accepts({"type": "integer"}, "2e3")


def _parses_as_number(text: str) -> bool:
    try:
        value = json.loads(text, parse_constant=lambda word: None)  # NaN and Infinity are no JSON
    except ValueError:
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_numbers_agree_with_a_json_parser():
    """Every printable byte before, inside and after a number: a letter is no digit (d was read as one)."""
    texts = []
    for base in ["0", "7", "-12", "1.5", "3e5", "-0.25E-7"]:
        for c in map(chr, range(0x20, 0x7F)):
            texts += [base + c, c + base, base[:1] + c + base[1:], base[:-1] + c + base[-1:]]
    wrong = [t for t in texts if accepts({"type": "number"}, t) != _parses_as_number(t)]
    assert not wrong, wrong[:10]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("fmt", "word"),
    [
        ({"type": "json_schema", "json_schema": {"schema": {"anyOf": []}}}, "anyOf"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object", "additionalProperties": True}}},
            "additionalProperties",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "map"}}}, "map"),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": [{"a": 1}]}}}, "enum"),
        ({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"pattern": "x"}}}}}, "properties.a"),
        # malformed shapes and hostile depth: a clear error, not a TypeError or a RecursionError
        ({"type": "json_schema", "json_schema": {"schema": {"type": 5}}}, "type 5"),
        ({"type": "json_schema", "json_schema": {"schema": {"properties": []}}}, "properties must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {"required": "a"}}}, "required must be a list"),
        ({"type": "json_schema", "json_schema": {"schema": _nested(900)}}, "nests deeper than 64"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": []}}}, "allows no value"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "enum": [1.5, "2"]}}},
            "no value of enum",
        ),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": [float("inf")]}}}, "no value of enum"),
    ],
)
def test_unsupported_schemas_are_refused(fmt, word):
    with pytest.raises(MoestreamError, match=word):
        schema_of(fmt)


ODD = ['"', "\\", "a\nb", "\t", "\u0000", "é/日"]  # names and values JSON spells with escapes, or not


@pytest.mark.parametrize("text", ODD)
def test_names_and_values_that_need_escapes(text):
    """A property name or enum value is spelled as json.dumps does: escapes are written, and a wrong escape or
    the bare character is refused."""
    schema = {"type": "object", "properties": {text: {"enum": [text, "x"]}}, "required": [text]}
    answer = json.dumps({text: text}, ensure_ascii=False)
    assert accepts(schema, answer) and accepts(schema, json.dumps({text: "x"}, ensure_ascii=False))
    assert not accepts(schema, json.dumps({text + "y": text}, ensure_ascii=False))
    if "\\" in json.dumps(text, ensure_ascii=False):
        assert not accepts(schema, answer.replace("\\", "\\u005c", 1))  # another spelling: not the one taken


def test_no_prefix_is_a_dead_end():
    """Every byte the validator takes can be finished: inside an enum's escapes too (a model is never left
    where no token continues)."""
    schema = rules({"enum": ['"', "\\n", "a"]})
    state = (("value", schema),)
    for b in b'"\\':
        state = feed(state, b)
    assert feed(state, ord("n")) is None and feed(state, ord("t")) is None  # no value goes on as \\n or \\t
    assert feed(state, ord('"')) is not None and feed(state, ord("\\")) is not None


def test_enum_values_the_type_cannot_write_are_dropped_and_a_bare_number_ends_only_in_the_enum():
    schema = rules({"type": "integer", "enum": [1.5, 2, 1.0]})  # 1.5 and 1.0 (spelled 1.0) are no integers
    assert schema["enum"].sorted == [b"2"]
    state = (("value", rules({"enum": [15]})),)
    state = feed(state, ord("1"))
    assert not complete(state) and complete(feed(state, ord("5")))


def test_a_long_free_key_costs_a_byte_a_byte():
    """An object of any keys keeps its key's escape state in its frame: a 20000-byte key is not rescanned."""
    import time

    state = (("value", rules({"type": "object"})),)
    start = time.perf_counter()
    for b in b'{"' + b"ab\\n" * 5000:
        state = feed(state, b)
    assert state is not None and time.perf_counter() - start < 1.0  # rescanning took ~30 s


def test_a_long_enum_is_checked_in_log_time():
    """40000 values: each byte is a lookup in the sorted spellings, not a pass over the list."""
    import time

    values = [f"v{i:06d}" for i in range(40_000)]
    schema = rules({"enum": values})
    start = time.perf_counter()
    for _ in range(50):
        assert accepts(schema, '"v031415"', compiled=True)
    assert time.perf_counter() - start < 1.0  # a pass over the list a byte took ~15 s


@pytest.fixture(scope="module")
def engine(model_file):
    e = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=1024, ubatch=16)
    yield e
    e.close()


def test_the_mask_is_what_allows_says(engine):
    tok = engine.tokenizer
    c = JsonConstraint(tok, rules(SCHEMA))
    for text in ('{"name": "Ann', '", "mood": ', '"calm", "age": 1', "}"):  # a free string, a value, a number, the end
        for t in tok.encode(text):
            assert c.allows(t)
            c.advance(t)
        mask = c.mask(tok.vocab_size)
        assert mask.tolist() == [c.allows(i) for i in range(tok.vocab_size)]
        assert any(mask[i] for i in tok.eos_ids) == (text == "}")


class _Words:
    """A tokenizer's three fields the constraint reads, over every byte and random words with blanks, quotes,
    backslashes and JSON punctuation (a generated model's vocabulary has few of them)."""

    def __init__(self, size: int, seed: int, extra: tuple[bytes, ...] = ()):
        import random

        from moestream.formats.tokenizer import NORMAL

        rng = random.Random(seed)
        self.words = [bytes([b]) for b in range(256)] + list(extra)
        while len(self.words) < size:
            word = "".join(rng.choice('ab9 "\\:,{}[]ntrue.-e') for _ in range(rng.randint(2, 6)))
            self.words.append(word.encode())
        self.token_types, self.eos_ids = [NORMAL] * size, (0,)

    def token_bytes(self, i: int) -> bytes:
        return self.words[i]


def test_an_end_of_text_token_typed_as_text_is_masked_until_the_json_is_whole():
    words = _Words(300, 1)
    words.words[299], words.eos_ids = b"</s>", (299,)  # plain string text, and the end of text
    c = JsonConstraint(words, rules({"type": "object"}))
    for b in b'{"a": "x':
        c.advance(b)
    assert not c.mask(300)[299] and not c.allows(299)
    for b in b'"}':
        c.advance(b)
    assert c.mask(300)[299] and c.allows(299)


SHARDS_ANSWERS = [
    (
        {"type": "object", "properties": {'k"1': {"type": "array", "items": {"enum": ["a\\b", 9]}}, "t": {}}},
        b'{ "k\\"1" : [ "a\\\\b" , 9 ] , "t" : { "x\\n" : "a b" } }',
        (),
    ),
    # free keys: a repeat is refused, a required one counted where the object closes; tokens that share a tail
    # after their name's closing quote but not its verdict (at the outer object's third key)
    (
        {"type": "object", "required": ["ab"]},
        b'{"b":1,"a\\"":"x","ab":{"b":[],"a":"b"},"a":9}',
        (b'a":9,"a"', b'aa":9,"a"', b'a":9}', b'ab":9}'),
    ),
]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("schema, answer, extra", SHARDS_ANSWERS)
def test_the_mask_is_what_allows_says_over_a_vocabulary_of_json_shards(seed, schema, answer, extra):
    """The mask's shortcuts (groups skipped by their first two bytes, free string text taken unfed, tails after
    a closing quote fed once) give every token the verdict feeding it gives, at each byte of an answer."""
    words = _Words(3000, seed, extra)
    c = JsonConstraint(words, rules(schema))
    for b in answer:
        mask = c.mask(len(words.words))
        assert mask.tolist() == [c.allows(i) for i in range(len(words.words))], bytes([b])
        c.advance(b)
    assert c.mask(len(words.words))[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_answers_follow_the_schema(engine, seed):
    """A random model at temperature 1: every answer the mask lets through parses and follows the schema."""
    from moestream.runtime.sampling import Sampler

    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["calm", "storm"]}, "n": {"type": "integer"}},
        "required": ["mood", "n"],
        "additionalProperties": False,
    }
    tok = engine.tokenizer
    constraint = JsonConstraint(tok, rules(schema))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), constraint=constraint)
    cache = engine.new_cache()
    prompt = tok.encode("Answer in JSON:")
    token, out = sampler(engine.forward(prompt, cache)[-1]), []
    while token not in tok.eos_ids and len(out) < 60:
        out.append(token)
        token = sampler(engine.forward([token], cache)[-1])
    value = json.loads(tok.decode(out))
    assert token in tok.eos_ids, tok.decode(out)
    assert set(value) == {"mood", "n"} and value["mood"] in ("calm", "storm") and isinstance(value["n"], int)
