"""Tokenizer and chat template from GGUF metadata, tokenizing as llama.cpp does for byte-level BPE.

The `tokenizer.ggml.*` keys carry the whole vocabulary, so no `tokenizer.json` is needed: the tokens and
merges become a Hugging Face `tokenizers` BPE model with the pre-tokenizer regex llama.cpp selects from
`tokenizer.ggml.pre`. Decoding is done here, token by token as bytes, so a stream can hold back a
character whose UTF-8 bytes are split across tokens.
"""

from __future__ import annotations

import codecs
from collections import Counter
from collections.abc import Sequence
from functools import cache
from itertools import pairwise
from typing import Any

import tokenizers

from moestream.errors import MoestreamError
from moestream.formats.chat_template import WITHOUT_CHAT
from moestream.formats.chat_template import render as render_template
from moestream.formats.gguf_check import StringArray

# tokenizer.ggml.token_type codes (llama.cpp llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's split regexes (LLAMA_VOCAB_PRE_TYPE_QWEN2, _QWEN35): digits one by one; qwen35 keeps combining
# marks (\p{M}) with the letters they modify instead of splitting them off as punctuation. gpt-4o (o200k, gpt-oss):
# words split before capitals, contractions case-free, digits in threes; this is the tokenizer.json form, which
# llama.cpp rewrites with lookaheads for its own regex engine.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_O200K_WORD = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_SPLIT_REGEX = {
    "gpt-4o": _O200K_WORD
    + r"*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    + _O200K_WORD
    + r"+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
    + r"\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # GLM-4.5 / 4.6 (llama.cpp's CHATGLM4): qwen2's split with digits in threes
    "glm4": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Pre-tokenizers whose pieces found whole in the vocabulary are taken whole, before any merge (llama.cpp's
# ignore_merges for them)
_WHOLE_PIECES = frozenset({"glm4"})

# Token texts llama.cpp treats as end of generation whatever the eos id says (llama-vocab.cpp, EOG and FIM
# detection by text): a chat model ends its turn with one of these.
_END_OF_GENERATION = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


@cache
def _byte_of_char() -> dict[int, int]:
    """GPT-2's byte-level alphabet reversed (code point -> byte), as a str.translate table.

    Printable latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points 256 and up
    in byte order, so every byte has a visible, non-space character.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: b for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update((256 + n, b) for n, b in enumerate(shifted))
    return table


def _byte_level_alphabet() -> list[str]:
    """The 256 single-byte tokens, in the order GPT-2 and Qwen vocabularies list them."""
    return [chr(c) for c in sorted(_byte_of_char())]


def _pre_tokenizer(split_regex: str) -> tokenizers.pre_tokenizers.PreTokenizer:
    return tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(split_regex), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """Text <-> token ids and chat prompts for one GGUF model."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        tokens: list[str],
        token_types: list[int],
        *,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._hf = hf
        self.tokens = tokens
        self.token_types = token_types
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from the `tokenizer.*` keys of a GGUF file's metadata."""
        model = _text(meta, "tokenizer.ggml.model")
        if model != "gpt2":
            raise MoestreamError(
                f"tokenizer.ggml.model is {model!r}; moestream reads only 'gpt2' (byte-level BPE) tokenizers, which "
                "Qwen3 and Qwen3.5 files carry: convert the model again with llama.cpp's convert_hf_to_gguf.py"
            )
        pre = _text(meta, "tokenizer.ggml.pre")
        if pre not in _SPLIT_REGEX:
            raise MoestreamError(
                f"tokenizer.ggml.pre is {pre!r}; moestream supports the pre-tokenizers {sorted(_SPLIT_REGEX)}"
            )
        tokens = _list_of(meta, "tokenizer.ggml.tokens", str, [])
        if not tokens:
            raise MoestreamError("the model file has no vocabulary (tokenizer.ggml.tokens)")
        types = _list_of(meta, "tokenizer.ggml.token_type", int, [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise MoestreamError(f"tokenizer metadata has {len(tokens)} tokens but {len(types)} token types")
        odd = next((i for i, kind in enumerate(types) if not 0 <= kind <= BYTE), None)  # 0: llama.cpp's undefined
        if odd is not None:
            raise MoestreamError(
                f"tokenizer.ggml.token_type[{odd}] = {types[odd]} is no token type (0 to {BYTE}); the file's tokenizer "
                "is damaged, convert the model again"
            )
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom")}
        for key, i in ids.items():
            if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
                raise MoestreamError(f"tokenizer.ggml.{key}_token_id {i!r:.40} is not one of the {len(tokens)} tokens")
        merge_texts = _list_of(meta, "tokenizer.ggml.merges", str, [])
        if not merge_texts:  # llama.cpp refuses it too ("cannot find tokenizer merges")
            raise MoestreamError(
                "the tokenizer is byte-level BPE (tokenizer.ggml.model 'gpt2') but the file has no merges "
                "(tokenizer.ggml.merges), so text would split into single bytes; convert the model again"
            )
        bad = next((k for k, m in enumerate(merge_texts) if m.count(" ") != 1 or " " in (m[0], m[-1])), None)
        if bad is not None:
            raise MoestreamError(f"tokenizer.ggml.merges[{bad}] = {merge_texts[bad]!r:.40} is not two tokens")
        template = _text(meta, "tokenizer.chat_template")

        # A repeated merge keeps its first rank, as in llama.cpp (Hugging Face's BPE would keep the last).
        merges = [tuple(m.split(" ", 1)) for m in dict.fromkeys(merge_texts)]
        # Duplicate texts keep the last id, as llama.cpp's token_to_id map does.
        vocab = {text: i for i, text in enumerate(tokens)}
        try:
            bpe = tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _WHOLE_PIECES)
            hf = tokenizers.Tokenizer(bpe)
        except Exception as e:  # a merge of tokens that are not in the vocabulary...
            raise MoestreamError(f"tokenizer metadata is malformed ({str(e)[:120]})") from None
        hf.pre_tokenizer = _pre_tokenizer(_SPLIT_REGEX[pre])
        # Control, unknown and user-defined tokens are matched whole in the raw text before splitting
        # (decoding is done here, so Hugging Face's special/non-special distinction does not matter).
        hf.add_tokens(
            [
                tokenizers.AddedToken(text, special=True, normalized=False)
                for text, kind in zip(tokens, types, strict=True)
                if kind in (CONTROL, UNKNOWN, USER_DEFINED) and text
            ]
        )
        eos_ids = {i for k, i in ids.items() if k != "bos" and i is not None}
        eos_ids.update(i for i, text in enumerate(tokens) if text in _END_OF_GENERATION)
        ends = {tokens[i] for i in eos_ids}
        if {"<|return|>", "<|call|>", "<|end|>"} <= ends:  # Harmony (gpt-oss): <|end|> closes one message of
            eos_ids -= {i for i in eos_ids if tokens[i] == "<|end|>"}  # several in a turn, as llama.cpp reads it
        return cls(
            hf,
            tokens,
            types,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            eos_ids=frozenset(eos_ids),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts in it ("<|im_start|>") become their single ids.

        `add_special` prepends BOS when the model asks for it (`tokenizer.ggml.add_bos_token`).
        """
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def encode_prompt(self, prompt: str, chat: bool = False, n_ctx: int | None = None) -> list[int]:
        """A user's prompt as token ids, wrapped in the chat template when chat is set (a rendering too long for
        an n_ctx context refused before it is tokenized)."""
        if chat:
            text = self.apply_chat_template([{"role": "user", "content": prompt}], n_ctx=n_ctx)
            return self.encode(text, add_special=False)
        return self.encode(prompt)

    def token_bytes(self, token_id: int) -> bytes:
        """What one token prints as, in bytes: a BPE token may hold part of a UTF-8 character.

        Like llama.cpp: control and user-defined tokens print their text, unused (padding) tokens nothing.
        """
        piece = self._pieces.get(token_id)
        if piece is None:
            text, kind = self.tokens[token_id], self.token_types[token_id]
            if kind == NORMAL:
                piece = text.translate(_byte_of_char()).encode("latin-1", errors="replace")
            elif kind in (CONTROL, UNKNOWN, USER_DEFINED):
                piece = text.encode()
            else:
                piece = b""
            self._pieces[token_id] = piece
        return piece

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        return b"".join(map(self.token_bytes, ids)).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        n_ctx: int | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own template.

        `variables` reach the template as they do through transformers (e.g. Qwen3's `enable_thinking`).
        n_ctx: refuse a rendering too long for a context of that many tokens (chat_template.MAX_CHARS_PER_TOKEN).
        """
        if not self.chat_template:
            raise MoestreamError(f"the model file has no chat template (tokenizer.chat_template); {WITHOUT_CHAT}")
        special = {
            f"{name}_token": "" if i is None else self.tokens[i]
            for name, i in (("bos", self.bos_id), ("eos", self.eos_id))
        }
        variables = dict(variables, messages=messages, add_generation_prompt=add_generation_prompt, **special)
        return render_template(self.chat_template, variables, n_ctx)


class TextStream:
    """Fed generated ids one at a time, returns the text each adds, holding back unfinished characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back at the end, as replacement characters if incomplete."""
        return self._utf8.decode(b"", final=True)


def _text(meta: dict[str, Any], key: str) -> str | None:
    """A metadata string, None where the key is absent, or one clear error where it holds another type."""
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise MoestreamError(f"{key} must be text, not {type(value).__name__}; the file's tokenizer is damaged")
    return value


def _list_of(meta: dict[str, Any], key: str, kind: type, default: list) -> list:
    """A metadata list whose every entry has the given type, or one clear error."""
    value = meta.get(key, default)
    if isinstance(value, StringArray) and kind is str:
        return list(value)  # strings by construction: decoded here
    value = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise MoestreamError(f"{key} must be a list of {kind.__name__} values; the file's tokenizer is damaged")
    return value


# --- the tokenizer generated test models carry ---

_CORPUS = """\
The lighthouse stood at the end of a long spit of sand, and for forty years the same family had kept its
lamp burning. Every evening at dusk the keeper climbed 112 steps, trimmed the wick, and wound the clockwork
that turned the lens. On clear nights the beam reached 18 miles out to sea; in fog it barely reached the reef.

"I don't think they'll ever automate it," the keeper said to the inspector who came each spring. "You can't
teach a machine to smell weather coming." The inspector smiled, wrote something in his notebook, and said
nothing. We've heard that before, he thought. They're all sure of it until the day it happens.

The keeper's daughter learned the work before she could read. She knew that the oil had to be filtered
twice, that the brass must be polished on Tuesdays and Fridays, and that a ship's horn in the dark meant
someone was lost. In the winter of 1962 a storm broke three windows and put the lamp out for nine minutes.
She relit it with her hands shaking, and afterwards she wrote the time in the log: 02:47 to 02:56.

Recipe for the keeper's bread: mix 500 grams of flour, 10 grams of salt, 7 grams of yeast and 350 millilitres
of warm water. Knead the dough for ten minutes, let it rise for an hour, shape it, and let it rise again.
Bake at 220 degrees for thirty minutes, until the loaf sounds hollow when you tap the bottom.

Questions the inspector asked, year after year:
1. Is the lamp lit at the right time?
2. Are the logs complete and signed?
3. Have the stores of oil, wicks and glass been counted?
4. Is there anything the keeper needs?

The answer to the last question was always the same. "Nothing," the keeper said. "Just more hours in the day."

When the light was finally automated, the family moved inland to a town with a river, a market and a school.
The daughter became an engineer. She designed control systems for ships, and in every one of them she left a
small manual switch, painted red, that a person could turn by hand when the machine was wrong. Her colleagues
asked her why. "Because the sea doesn't read the manual," she said, "and neither does the weather."

Years later she went back to the spit of sand. The tower was still there, white and patient, and the lamp was
still turning, steered by a computer in a grey box. She climbed the 112 steps, counted them out loud as she
always had, and stood at the top watching the beam sweep across the water: one, two, three, four, and dark.

def keeper_log(hour, minute, note):
    # Record one entry in the lighthouse log, padded the way the old books were.
    return f"{hour:02d}:{minute:02d}  {note}"

for night in range(365):
    print(keeper_log(20, 15, "lamp lit, sky clear, wind west, sea calm"))
"""

# Qwen3's tool prompt, shortened: the tools as JSON in a system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn. Without tools it renders plain ChatML.
_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>\' }}'
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Harmony, gpt-oss's chat format: a system header, the developer's instructions, then messages of
# <|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>; an assistant's earlier answers keep only their
# final channel. A shorter form of the template gpt-oss files carry (no tools), rendering the same text for
# plain conversations.
_HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' }}"
    "{{- 'Knowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\n' }}"
    "{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\\n\\n' }}"
    "{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}"
    "{%- set loop_messages = messages %}"
    "{%- if messages[0].role in ('system', 'developer') %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '\\n\\n<|end|>' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# (text, token type) after the BPE tokens, in Qwen3's order.
_QWEN3_SPECIALS = (
    ("<|endoftext|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
)
_HARMONY_SPECIALS = tuple(
    (text, CONTROL)
    for text in (
        "<|startoftext|>",
        "<|endoftext|>",
        "<|return|>",
        "<|constrain|>",
        "<|channel|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|call|>",
    )
)
_BASE_VOCAB = 512  # bytes + merges + specials, so a 512-row tiny model has no padding at all


@cache
def _trained_bpe() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A byte-level BPE learned on `_CORPUS`: the classic greedy loop, ties broken by the pair's text."""
    words = Counter(piece for piece, _ in _pre_tokenizer(_SPLIT_REGEX["qwen2"]).pre_tokenize_str(_CORPUS))
    split = {word: list(word) for word in words}
    tokens, merges = _byte_level_alphabet(), []
    known = set(tokens)
    while len(tokens) < _BASE_VOCAB - len(_QWEN3_SPECIALS):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(split[word]):
                pairs[pair] += count
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{a} {b}")
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)
        for symbols in split.values():
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == a and symbols[i + 1] == b:
                    symbols[i : i + 2] = [a + b]
                i += 1
    return tuple(tokens), tuple(merges)


def tiny_tokenizer_metadata(n_vocab: int, chat: str = "chatml") -> dict[str, Any]:
    """The `tokenizer.*` keys of a generated test model with `n_vocab` embedding rows.

    A real byte-level BPE (512 tokens) with a chat format's tokens, padded as convert_hf_to_gguf.py pads
    real files up to the embedding size: `[PAD{id}]` tokens of type unused. chat "chatml": Qwen3's tokens and
    ids (BOS and padding <|endoftext|>, EOS <|im_end|>). chat "harmony": gpt-oss's (the gpt-4o pre-tokenizer,
    BOS <|startoftext|>, EOS <|return|>, padding <|endoftext|>). No BOS is added.
    """
    if chat not in ("chatml", "harmony"):
        raise MoestreamError(f"chat format {chat!r}: choose chatml or harmony")
    bpe_tokens, merges = _trained_bpe()
    specials = _QWEN3_SPECIALS if chat == "chatml" else _HARMONY_SPECIALS
    tokens = [*bpe_tokens, *(text for text, _ in specials)]
    if n_vocab < len(tokens):
        raise MoestreamError(f"n_vocab {n_vocab} is too small: the test tokenizer needs {len(tokens)} tokens")
    types = [NORMAL] * len(bpe_tokens) + [kind for _, kind in specials]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [UNUSED] * (n_vocab - len(types))
    ids = ("<|endoftext|>", "<|im_end|>") if chat == "chatml" else ("<|startoftext|>", "<|return|>")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2" if chat == "chatml" else "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": tokens.index(ids[0]),
        "tokenizer.ggml.eos_token_id": tokens.index(ids[1]),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": _CHATML_TEMPLATE if chat == "chatml" else _HARMONY_TEMPLATE,
    }
