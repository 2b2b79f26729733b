"""response_format json_object / json_schema as a token mask: an incremental JSON validator fed each candidate
token's bytes. The sampler asks `allows(pick)` first and builds the whole `mask` only when the pick breaks the
JSON (as llama.cpp applies grammars), so most steps check one token.

Bytes, not characters: JSON's structure is ASCII, and a token may end inside a UTF-8 character. A string's
non-ASCII bytes are taken as they come (the text is decoded, with replacement, as any answer is).
The schema subset: type (one or a list), properties (only those keys: OpenAI's strict outputs), required,
enum (of scalars), items, additionalProperties false; titles and descriptions are read past. Any other keyword
is refused, so a schema is never half enforced. A checked schema is kept as rules: property names and enum
values as the bytes JSON spells them (escapes included), sorted, so a byte is checked in log time however long
the lists. The state is a tuple of frames, so checking a token copies nothing.
"""

from __future__ import annotations

import json
import re
import weakref
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from moestream.errors import MoestreamError
from moestream.formats.tokenizer import NORMAL

if TYPE_CHECKING:
    import torch

IGNORED = frozenset({"title", "description", "$schema", "default", "examples", "strict", "$comment"})
TAKEN = frozenset({"type", "properties", "required", "enum", "items", "additionalProperties"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_BLANKS = 16  # blanks in a row outside strings: a model cannot pad forever
MAX_DEPTH = 64  # schemas nested deeper are refused: the checks recurse (and no answer needs so many levels)
WS = frozenset(b" \t\n\r")
_SPECIAL = re.compile(rb'["\\\x00-\x1f]')  # the bytes that end or escape a string, or break it
LITERALS = {b"t": b"true", b"f": b"false", b"n": b"null"}
_KIND_OF = {b"true": "boolean", b"false": "boolean", b"null": "null"}
# the number grammar as a DFA: state -> {byte class: state}; accepting: 2 (0), 3 (digits), 5 (fraction), 8 (exponent)
_NUM = {
    0: {"-": 1, "0": 2, "1-9": 3},
    1: {"0": 2, "1-9": 3},
    2: {".": 4, "e": 6},
    3: {"0": 3, "1-9": 3, ".": 4, "e": 6},
    4: {"0": 5, "1-9": 5},
    5: {"0": 5, "1-9": 5, "e": 6},
    6: {"+": 7, "-": 7, "0": 8, "1-9": 8},
    7: {"0": 8, "1-9": 8},
    8: {"0": 8, "1-9": 8},
}
_NUM_DONE = frozenset({2, 3, 5, 8})


class Spellings:
    """The JSON spellings (bytes) of a set of values or property names: whole and prefix lookups in log time."""

    def __init__(self, spelled) -> None:
        self.sorted = sorted(set(spelled))
        self.whole = frozenset(self.sorted)

    def extends(self, raw: bytes, taken: frozenset = frozenset()) -> bool:
        """Whether raw begins a spelling that is not in taken."""
        i = bisect_left(self.sorted, raw)
        while i < len(self.sorted) and self.sorted[i].startswith(raw):
            if self.sorted[i] not in taken:
                return True
            i += 1
        return False


def spelled(name: str) -> bytes:
    """A string's bytes between the quotes of its JSON spelling (json.dumps', escapes and all)."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


def schema_of(response_format: dict) -> dict:
    """The rules a response_format asks for, checked: json_object is any object."""
    if response_format.get("type") == "json_object":  # with llama-server's schema, or any object
        return rules(response_format.get("schema") or {"type": "object"})
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise MoestreamError("json_schema.schema must be a JSON schema object")
    return rules(schema)


def rules(schema: Any, where: str = "schema", depth: int = 0) -> dict:
    """A schema checked and kept as the validator reads it: enum a Spellings of values, properties keyed by
    their spelled names (with a Spellings of them under "names"), required as spelled names."""
    if depth > MAX_DEPTH:
        raise MoestreamError(f"the schema nests deeper than {MAX_DEPTH} levels; flatten it")
    if not isinstance(schema, dict):
        raise MoestreamError(f"{where} must be a schema object")
    for key in schema:
        if key not in TAKEN | IGNORED:
            raise MoestreamError(f"{where}: the keyword {key!r} is not supported (only {', '.join(sorted(TAKEN))})")
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not all(isinstance(k, str) and k in TYPES for k in kinds):
        raise MoestreamError(
            f"{where}: type {schema['type']!r} is not a JSON schema type ({', '.join(sorted(TYPES))}, or a list)"
        )
    if "type" in schema and not kinds:
        raise MoestreamError(f"{where}: type [] allows no value; name at least one type")
    if schema.get("additionalProperties", False) is not False:
        raise MoestreamError(f"{where}: only additionalProperties false (the properties listed, as OpenAI's strict)")
    out: dict[str, Any] = {k: schema[k] for k in ("type",) if k in schema}
    enum = schema.get("enum")
    if enum is not None:
        if not isinstance(enum, list) or not enum or any(isinstance(v, (dict, list)) for v in enum):
            raise MoestreamError(f"{where}: enum must be a non-empty list of strings, numbers, booleans or null")
        # only values the type lets be written (1.5 is no integer, Infinity no JSON): the others lead nowhere
        typed = {**out, "required": frozenset()}
        spelled_values = [json.dumps(v, ensure_ascii=False).encode() for v in enum]
        out["enum"] = Spellings(v for v in spelled_values if _whole(typed, v))
        if not out["enum"].sorted:
            raise MoestreamError(f"{where}: no value of enum is JSON of type {schema.get('type')!r}; fix either")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise MoestreamError(f"{where}: properties must be an object of name -> schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise MoestreamError(f"{where}: required must be a list of property names")
    if not set(required) <= set(properties) and "properties" in schema:
        raise MoestreamError(f"{where}: required names a property that properties does not list")
    if "properties" in schema:
        out["properties"] = {
            spelled(name): rules(sub, f"{where}.properties.{name}", depth + 1) for name, sub in properties.items()
        }
        out["names"] = Spellings(out["properties"])
    out["required"] = frozenset(spelled(r) for r in required)
    if "items" in schema:
        out["items"] = rules(schema["items"], f"{where}.items", depth + 1)
    return out


ANY = rules({})  # a value of any kind


def _kinds(schema: dict) -> frozenset[str]:
    kinds = schema.get("type")
    if kinds is None:
        return TYPES
    kinds = frozenset([kinds] if isinstance(kinds, str) else kinds)
    return kinds | {"number"} if "integer" in kinds else kinds  # integer: a number without . or e (checked below)


def _enum_ok(schema: dict, raw: bytes, done: bool) -> bool:
    enum = schema.get("enum")
    if enum is None:
        return True
    return raw in enum.whole if done else enum.extends(raw)


def _string_byte(esc: int, b: int) -> int | None:
    """The escape state after byte b inside a string (not its closing quote): 0 outside an escape, -1 just after
    the backslash, or how many hex digits of a \\u escape are still due; None where JSON allows no such byte."""
    if esc == -1:
        return 4 if b == ord("u") else 0 if bytes([b]) in b'"\\/bfnrt' else None
    if esc > 0:
        return esc - 1 if bytes([b]) in b"0123456789abcdefABCDEF" else None
    if b < 0x20:
        return None
    return -1 if b == ord("\\") else 0


# Frames (tuples): ("value", schema) a value is due; ("obj", schema, phase, seen, key, escape) escape: a key's, as
# a string's (0 in other phases); ("arr", schema, phase);
# ("str", schema, raw, escape) escape: 0, "\" seen (-1) or hex digits left; ("num", schema, raw, dfa state);
# ("lit", schema, raw); ("done",) the whole value is read.


def _start(schema: dict, b: int) -> tuple | None:
    """The frame a value starting with byte b opens, if the schema lets it."""
    kinds, c = _kinds(schema), bytes([b])
    if c == b"{" and "object" in kinds and "enum" not in schema:
        return ("obj", schema, "first", frozenset(), b"", 0)
    if c == b"[" and "array" in kinds and "enum" not in schema:
        return ("arr", schema, "first")
    if c == b'"' and "string" in kinds:
        return ("str", schema, c, 0) if _enum_ok(schema, c, False) else None
    if c in LITERALS and _KIND_OF[LITERALS[c]] in kinds:
        return ("lit", schema, c) if _enum_ok(schema, c, False) else None
    if (c == b"-" or c.isdigit()) and "number" in kinds:
        return _number(("num", schema, b"", 0), b)
    return None


def _integer_only(schema: dict) -> bool:
    declared = schema.get("type")
    declared = {declared} if isinstance(declared, str) else set(declared or ())
    return "integer" in declared and "number" not in declared


def _number(frame: tuple, b: int) -> tuple | None:
    _, schema, raw, state = frame
    c = chr(b)
    cls = "1-9" if c in "123456789" else "e" if c in "eE" else c
    nxt = _NUM[state].get(cls)
    if nxt is None or (cls in (".", "e") and _integer_only(schema)):
        return None
    raw += bytes([b])
    return ("num", schema, raw, nxt) if _enum_ok(schema, raw, False) else None


def _value_done(stack: tuple) -> tuple | None:
    """The parent's frame after a value ends (stack: without the value's frame)."""
    if not stack:
        return (("done",),)
    parent = stack[-1]
    if parent[0] == "obj":
        _, schema, _, seen, key, _ = parent
        return (*stack[:-1], ("obj", schema, "after", seen | {key}, b"", 0))
    return (*stack[:-1], ("arr", parent[1], "after"))


def _close_ok(frame: tuple) -> bool:
    return frame[1]["required"] <= frame[3]


def _property_schema(schema: dict, key: bytes) -> dict | None:
    props = schema.get("properties")
    return ANY if props is None else props.get(key)


def feed(stack: tuple, b: int) -> tuple | None:
    """The state after byte b, or None if no JSON the schema allows goes this way."""
    top = stack[-1]
    kind, rest = top[0], stack[:-1]
    if kind == "done":
        return stack if b in WS else None
    if kind == "value":
        if b in WS:
            return stack
        frame = _start(top[1], b)
        return None if frame is None else (*rest, frame)
    if kind == "str":
        _, schema, raw, esc = top
        raw2 = raw + bytes([b])
        if esc == 0 and b == ord('"'):
            return _value_done(rest) if _enum_ok(schema, raw2, True) else None
        nxt = _string_byte(esc, b)  # an enum's prefix is checked inside escapes too: no state is a dead end
        return None if nxt is None or not _enum_ok(schema, raw2, False) else (*rest, ("str", schema, raw2, nxt))
    if kind == "lit":
        _, schema, raw = top
        raw2 = raw + bytes([b])
        word = LITERALS[raw[:1]]
        if not word.startswith(raw2) or not _enum_ok(schema, raw2, raw2 == word):
            return None
        return _value_done(rest) if raw2 == word else (*rest, ("lit", schema, raw2))
    if kind == "num":
        grown = _number(top, b)
        if grown is not None:
            return (*rest, grown)
        if top[3] not in _NUM_DONE or not _enum_ok(top[1], top[2], True):
            return None
        after = _value_done(rest)  # the number ended: the byte belongs to what follows
        return None if after is None else feed(after, b)
    if kind == "obj":
        return _feed_object(rest, top, b)
    return _feed_array(rest, top, b)


def _feed_object(rest: tuple, top: tuple, b: int) -> tuple | None:
    _, schema, phase, seen, key, esc = top
    if phase == "key":  # key: the name's bytes so far, as spelled in JSON
        if b == ord('"') and esc == 0:  # the name ends (a listed name's spelling has no bare quote)
            sub = _property_schema(schema, key)
            return None if sub is None or key in seen else (*rest, ("obj", schema, "colon", seen, key, 0))
        grown, esc = key + bytes([b]), _string_byte(esc, b)
        if esc is None or ("names" in schema and not schema["names"].extends(grown, seen)):
            return None
        return (*rest, ("obj", schema, "key", seen, grown, esc))
    if b in WS:
        return (*rest, top)
    if phase in ("first", "next") and b == ord('"') and schema.get("properties", True):  # {} : no key to write
        return (*rest, ("obj", schema, "key", seen, b"", 0))
    if phase in ("first", "after") and b == ord("}"):
        return _value_done(rest) if _close_ok(top) else None
    if phase == "after" and b == ord(","):  # only where a key is left to write
        props = schema.get("properties")
        left = props is None or len(seen) < len(props)  # seen: only listed names
        return (*rest, ("obj", schema, "next", seen, b"", 0)) if left else None
    if phase == "colon" and b == ord(":"):
        return (*rest, ("obj", schema, "value", seen, key, 0), ("value", _property_schema(schema, key)))
    return None


def _feed_array(rest: tuple, top: tuple, b: int) -> tuple | None:
    _, schema, phase = top
    if b in WS:
        return (*rest, top)
    if phase == "first" and b == ord("]"):
        return _value_done(rest)
    if phase == "after":
        if b == ord("]"):
            return _value_done(rest)
        return (*rest, ("arr", schema, "next")) if b == ord(",") else None
    return feed((*rest, ("arr", schema, "value"), ("value", schema.get("items", ANY))), b)


def _free(stack: tuple) -> bool:
    """Whether any plain text may follow: inside a string without an enum, or a key of an object of any keys."""
    top = stack[-1]
    if top[0] == "str":
        return top[3] == 0 and "enum" not in top[1]
    return top[0] == "obj" and top[2] == "key" and "properties" not in top[1] and top[5] == 0


def complete(stack: tuple) -> bool:
    """Whether the bytes so far are one whole value (a bare number is whole where it may end)."""
    top = stack[-1]
    bare_number = len(stack) == 1 and top[0] == "num" and top[3] in _NUM_DONE
    return top[0] == "done" or (bare_number and _enum_ok(top[1], top[2], True))


def _whole(schema: dict, text: bytes) -> bool:
    """Whether text is one value the schema allows."""
    after = _feed_bytes((("value", schema),), 0, text)
    return after is not None and complete(after[0])


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _index(tokenizer)


class JsonConstraint:
    """The sampler's Constraint for one sequence: JSON the rules (schema_of's) allow, then an end-of-text token."""

    def __init__(self, tokenizer, rules: dict) -> None:
        self.tokenizer = tokenizer
        if tokenizer not in _INDEXES:  # here, not at the first mask: the server makes constraints off its engine
            _INDEXES[tokenizer] = _index(tokenizer)
        self.state: tuple = (("value", rules),)
        self.blanks = 0  # blanks in a row outside strings

    def _after(self, token: int) -> tuple[tuple, int] | None:
        """The state and blank run after a token, or None if it breaks the JSON."""
        tok = self.tokenizer
        if token in tok.eos_ids:
            return (self.state, self.blanks) if complete(self.state) else None
        data = tok.token_bytes(token)
        if not data or tok.token_types[token] != NORMAL:  # only normal tokens spell JSON (no markers, no padding)
            return None
        return _feed_bytes(self.state, self.blanks, data)

    def allows(self, token: int) -> bool:
        return self._after(token) is not None

    def mask(self, n_vocab: int) -> torch.Tensor:
        """Every token's verdict. Tokens are grouped by their first byte, then their second: a group whose first
        bytes break the JSON is skipped whole (a blank, then a letter, where a key is due). Where the first byte
        leaves a free string (or any key), what a token's other bytes do is known from the index: stay inside
        (taken at once) or close it, and then only the bytes from the closing quote on are fed, once each."""
        import torch

        allowed = torch.zeros(max(n_vocab, len(self.tokenizer.token_types)), dtype=torch.bool)
        for first, (inside, closing, by_second) in _INDEXES[self.tokenizer].items():
            after = feed(self.state, first)
            if after is None:
                continue
            if _free(after) and (first not in WS or _free(self.state)):  # a blank outside strings is counted
                allowed[inside] = True
                ids = _closing(after, closing)
            else:  # a second byte that breaks the JSON rules out its group (then each is fed whole)
                fed = [group for second, group in by_second.items() if second is None or feed(after, second)]
                ids = [i for group in fed for i in group if self._after(i) is not None]
            if ids:
                allowed[ids] = True
        allowed[list(self.tokenizer.eos_ids)] = complete(self.state)  # also where one is typed as normal text
        return allowed[:n_vocab]

    def advance(self, token: int) -> None:
        after = self._after(token)
        if after is None:  # the sampler picks only allowed tokens
            raise MoestreamError(f"token {token} breaks the JSON the answer must be")
        self.state, self.blanks = after


def _feed_bytes(state: tuple, blanks: int, data: bytes) -> tuple[tuple, int] | None:
    """The state and blank run (outside strings) after data, or None if it breaks the JSON."""
    for b in data:
        in_string = state[-1][0] == "str" or (state[-1][0] == "obj" and state[-1][2] == "key")
        blanks = 0 if in_string or b not in WS else blanks + 1
        state = feed(state, b) if blanks <= MAX_BLANKS else None
        if state is None:
            return None
    return state, blanks


def _closing(after: tuple, closing: dict[bytes, tuple[list[int], list[bytes]]]) -> list[int]:
    """Of the tokens that close the free string (or key) open in `after`, those whose bytes from the closing
    quote on (their tail) the JSON allows. A string's close leads to one state whatever its text, so each tail is
    fed once. A key's close depends on its whole name (a repeat is refused, a required one counted when the object
    closes), so a tail is fed once for the names that are neither; a tail of 3 quotes or more may close another
    key, whose repeat check reads this name: those are fed per name."""
    top = after[-1]
    if top[0] == "str":
        shut = _value_done(after[:-1])
        return [i for tail, (ids, _) in closing.items() if _feed_bytes(shut, 0, tail[1:]) for i in ids]
    _, schema, _, seen, key, _ = top
    verdicts: dict[tuple[bytes, bytes | None], bool] = {}
    out = []
    for tail, (ids, middles) in closing.items():
        shared = tail.count(b'"') <= 2
        for i, middle in zip(ids, middles, strict=True):
            name = key + middle
            if name in seen:
                continue
            which = (tail, None if shared and name not in schema["required"] else name)
            if which not in verdicts:
                named = (*after[:-1], ("obj", schema, "colon", seen, name, 0))
                verdicts[which] = _feed_bytes(named, 0, tail[1:]) is not None
            if verdicts[which]:
                out.append(i)
    return out


def _close_at(data: bytes) -> int | None:
    """Where a token's closing quote is, read as the rest of a free string from its second byte: its index,
    None if the token stays inside the string, -1 if a byte breaks it (a control byte, a bad escape)."""
    if _SPECIAL.search(data, 1) is None:  # most tokens: no quote, backslash or control byte
        return None
    esc = 0
    for k in range(1, len(data)):
        if esc == 0 and data[k] == 0x22:
            return k
        esc = _string_byte(esc, data[k])
        if esc is None:
            return -1
    return None


def _index(tok) -> dict[int, tuple[torch.Tensor, dict[bytes, tuple[list[int], list[bytes]]], dict]]:
    """The vocabulary's normal tokens by first byte, each group as: the tokens whose other bytes stay inside a
    free string (a tensor); those that close it, by their tail from the closing quote on (ids, and the text
    before the quote); and all of them by second byte (None: one-byte tokens). Made once a tokenizer."""
    import torch

    groups: dict[int, tuple[list[int], dict, dict[int | None, list[int]]]] = {}
    for i, kind in enumerate(tok.token_types):
        data = tok.token_bytes(i) if kind == NORMAL else b""
        if not data:
            continue
        inside, closing, by_second = groups.setdefault(data[0], ([], {}, {}))
        by_second.setdefault(data[1] if len(data) > 1 else None, []).append(i)
        at = _close_at(data)
        if at is None:
            inside.append(i)
        elif at > 0:
            ids, middles = closing.setdefault(data[at:], ([], []))
            ids.append(i)
            middles.append(data[1:at])
    return {
        first: (torch.tensor(inside, dtype=torch.long), closing, by_second)
        for first, (inside, closing, by_second) in groups.items()
    }
