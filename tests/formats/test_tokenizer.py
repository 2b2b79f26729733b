"""Tokenizer from GGUF metadata against transformers' Qwen tokenizers built from the same vocabulary."""

import string
import time
import unicodedata

import pytest
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3_5Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from moestream.errors import MoestreamError
from moestream.formats.tokenizer import TextStream, Tokenizer, tiny_tokenizer_metadata

# Words given whole-word merges below, so a wrong split shows as a different id sequence, not just the bytes.
# A word's spaced form comes first: its chain must not be cut short by the other's higher-priority merges.
MERGED_WORDS = ["12345", " 日本語", "日本語", " नमस्ते", "नमस्ते", " ภาษาไทย", "🎉🎉"]

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, 1,000,000 - 2024-06-01 at 09:30",
    "I'm sure they'll say it's what we've done; YOU'RE RIGHT, I'D SAY, she'd've",
    "   leading spaces\tand\ttabs    then   trailing   ",
    "line one\nline two\r\n\n\nline three\n    indented\n\n",
    "日本語のテキストと中文混合，标点符号！",
    "emoji 🎉🎉 and 👩‍👩‍👧 family, ✓ ok",
    "Hindi नमस्ते दुनिया and Thai ภาษาไทย",
    "Ünïcödé façade naïve Ωμέγα кириллица",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>",
    "text<|endoftext|>more <think>x</think>",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "",
]


def byte_level(text: str) -> str:
    """`text` as GPT-2 byte-level BPE writes it in the vocabulary."""
    return "".join(bytes_to_unicode()[b] for b in text.encode())


def with_word_merges(meta: dict, words: list[str]) -> dict:
    """`meta` plus chained merges that build each word into one token.

    As in a real vocabulary the new tokens go before the special ones (transformers needs the ids contiguous).
    """
    typed = list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True))
    bpe = [t for t, k in typed if k == 1]
    merges = list(meta["tokenizer.ggml.merges"])
    for word in words:
        chars = byte_level(word)
        for end in range(2, len(chars) + 1):
            if chars[:end] not in bpe:
                merges.append(f"{chars[: end - 1]} {chars[end - 1]}")
                bpe.append(chars[:end])
    specials = [(t, k) for t, k in typed if k in (3, 4)]
    n_used = len(bpe) + len(specials)
    tokens = bpe + [t for t, _ in specials] + [f"[PAD{i}]" for i in range(n_used, len(typed))]
    types = [1] * len(bpe) + [k for _, k in specials] + [5] * (len(typed) - n_used)
    return {
        **meta,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
    }


def transformers_reference(meta: dict, cls: type):
    """transformers' tokenizer from the vocabulary, merges and added tokens a Hugging Face repo would ship."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    typed = list(enumerate(zip(tokens, types, strict=True)))
    ref = cls(
        vocab={t: i for i, (t, k) in typed if k != 5},
        merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    added = [(i, t, k) for i, (t, k) in typed if k in (3, 4)]
    ref.add_tokens([AddedToken(t, special=k == 3, normalized=False) for _, t, k in added])
    assert [ref.convert_tokens_to_ids(t) for _, t, _ in added] == [i for i, _, _ in added]
    ref.chat_template = meta["tokenizer.chat_template"]
    return ref


@pytest.fixture(scope="module")
def meta() -> dict:
    return with_word_merges(tiny_tokenizer_metadata(600), MERGED_WORDS)


@pytest.mark.parametrize(("pre", "reference_cls"), [("qwen2", Qwen2Tokenizer), ("qwen35", Qwen3_5Tokenizer)])
def test_ids_match_transformers(meta, pre, reference_cls):
    meta = {**meta, "tokenizer.ggml.pre": pre}
    ours = Tokenizer.from_metadata(meta)
    ref = transformers_reference(meta, reference_cls)
    for text in TEXTS:
        assert unicodedata.is_normalized("NFC", text)  # transformers normalizes to NFC, llama.cpp does not
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text


def test_splits_like_llama_cpp(meta):
    qwen2 = Tokenizer.from_metadata(meta)
    qwen35 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen35"})
    tokens = meta["tokenizer.ggml.tokens"]
    for tok in (qwen2, qwen35):
        assert [tokens[i] for i in tok.encode("12345")] == list("12345")  # digits one by one despite merges
        assert tok.encode(" 日本語") == [tokens.index(byte_level(" 日本語"))]
        assert tok.encode("<|im_start|>") == [tokens.index("<|im_start|>")]
        assert tok.encode("a<think>b") == [tokens.index(t) for t in ("a", "<think>", "b")]
    # Devanagari vowel signs are combining marks: qwen2 cuts the word at them, qwen35 keeps it whole.
    assert qwen35.encode(" नमस्ते") == [tokens.index(byte_level(" नमस्ते"))]
    assert len(qwen2.encode(" नमस्ते")) > 1


def test_glm4_splits_digits_in_threes_and_takes_whole_pieces(meta):
    """llama.cpp's glm4 pre-tokenizer: qwen2's split with up to three digits a piece, and a piece that is a
    token takes that token even where no chain of merges builds it (ignore_merges)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[-1] = byte_level(" xyzzy")  # a padding slot becomes a word no merge builds
    meta = {
        **meta,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"][:-1], 1],
    }
    glm4 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "glm4"})
    qwen2 = Tokenizer.from_metadata(meta)
    assert [tokens[i] for i in glm4.encode("12345")] == ["123", "4", "5"]  # "123" is a link of 12345's chain
    assert glm4.encode(" xyzzy") == [len(tokens) - 1] and len(qwen2.encode(" xyzzy")) > 1
    for text in TEXTS:
        assert glm4.decode(glm4.encode(text)) == text


def test_repeated_merge_keeps_first_rank():
    meta = tiny_tokenizer_metadata(600)
    merges = meta["tokenizer.ggml.merges"]
    text = "The keeper thought the weather would hold."
    first = Tokenizer.from_metadata(meta).encode(text)
    moved = Tokenizer.from_metadata({**meta, "tokenizer.ggml.merges": merges[1:] + merges[:1]}).encode(text)
    repeated = Tokenizer.from_metadata({**meta, "tokenizer.ggml.merges": merges + merges[:1]}).encode(text)
    assert moved != first and repeated == first  # llama.cpp keeps the first rank of a repeated merge


def test_round_trip_without_normalization():
    tok = Tokenizer.from_metadata(tiny_tokenizer_metadata(600))
    for text in ["cafe\u0301 decomposed", "\x00\x01 control bytes \x7f", "zero\u200bwidth", "\r\n\r\n"]:
        assert tok.decode(tok.encode(text)) == text


def test_bos_and_eos():
    meta = tiny_tokenizer_metadata(600)
    tokens = meta["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_metadata(meta)
    assert tok.eos_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert tok.vocab_size == 600
    assert tok.encode("hi") == tok.encode("hi", add_special=False)  # Qwen adds no BOS
    with_bos = Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi") == [tok.bos_id, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special=False) == tok.encode("hi")


def test_stream_holds_back_split_characters():
    tok = Tokenizer.from_metadata(tiny_tokenizer_metadata(600))
    text = "日本語 🎉 naïve — ok"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters are split across byte tokens
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids) == text
    assert "" in pieces and all("\ufffd" not in p for p in pieces)
    cut = TextStream(tok)
    assert "".join(cut.push(i) for i in tok.encode("🎉")[:2]) == ""
    assert cut.flush() == "\ufffd"


def test_chat_template():
    meta = tiny_tokenizer_metadata(600)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    prompt = Tokenizer.from_metadata(meta).apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ref = transformers_reference(meta, Qwen2Tokenizer)
    for kwargs in ({}, {"enable_thinking": False}):
        for add in (True, False):
            assert Tokenizer.from_metadata(meta).apply_chat_template(
                messages, add, **kwargs
            ) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs)


def test_chat_template_helpers_and_errors():
    meta = tiny_tokenizer_metadata(600)
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system turn') }}"
        "{% endif %}{{ bos_token }}{{ messages | tojson }}"
    )
    tok = Tokenizer.from_metadata({**meta, "tokenizer.chat_template": template})
    system = [{"role": "system", "content": "日本"}]
    assert tok.apply_chat_template(system) == '<|endoftext|>[{"role": "system", "content": "日本"}]'
    with pytest.raises(MoestreamError, match="needs a system turn"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    no_template = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    with pytest.raises(MoestreamError, match="no chat template"):
        Tokenizer.from_metadata(no_template).apply_chat_template(system)
    with pytest.raises(MoestreamError, match="does not compile"):
        Tokenizer.from_metadata({**meta, "tokenizer.chat_template": "{% for %}"}).apply_chat_template(system)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("tokenizer.ggml.model", "llama", "'llama'.*'gpt2'"),
        ("tokenizer.ggml.pre", "llama-bpe", "'llama-bpe'.*qwen2"),
        ("tokenizer.ggml.pre", None, "None.*qwen35"),
        ("tokenizer.ggml.token_type", [1, 1], "token types"),
        ("tokenizer.ggml.tokens", [], "no vocabulary"),
        ("tokenizer.ggml.eos_token_id", 10**6, "eos_token_id"),
    ],
)
def test_unsupported_metadata(key, value, named):
    with pytest.raises(MoestreamError, match=named):
        Tokenizer.from_metadata({**tiny_tokenizer_metadata(600), key: value})


def test_tiny_metadata_is_deterministic_and_padded():
    assert tiny_tokenizer_metadata(1000) == tiny_tokenizer_metadata(1000)
    meta = tiny_tokenizer_metadata(1000)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 1000
    assert len(set(tokens)) == 1000
    assert tokens[512:] == [f"[PAD{i}]" for i in range(512, 1000)] and set(types[512:]) == {5}
    assert types[:256] == [1] * 256 and len(meta["tokenizer.ggml.merges"]) >= 251
    assert tiny_tokenizer_metadata(512)["tokenizer.ggml.tokens"][-1] == "</think>"
    with pytest.raises(MoestreamError, match="too small"):
        tiny_tokenizer_metadata(511)


def test_real_size_vocabulary_builds_fast():
    """Qwen3's sizes: 151,643 BPE tokens from 151,387 merges, padded to 151,936 rows (synthetic merges)."""
    meta = tiny_tokenizer_metadata(512)
    alphabet = sorted(bytes_to_unicode().values())
    letters = string.ascii_letters
    pairs = [(a, b) for a in alphabet for b in alphabet]
    pairs += [(a + b, c) for a in letters for b in letters for c in alphabet][: 151643 - 256 - len(pairs)]
    tokens = alphabet + [a + b for a, b in pairs] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), 151936)]
    types = [1] * 151643 + [3] * 3 + [5] * (151936 - 151646)
    meta.update(
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in pairs],
        }
    )
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    seconds = time.perf_counter() - start
    assert seconds < 5, f"building took {seconds:.2f} s"
    assert tok.encode("abc<|im_end|>") == [tokens.index("abc"), 151645]
    assert tok.decode([151935]) == ""  # unused rows print nothing, as in llama.cpp
    assert len(tok.encode("[PAD151935]")) > 1  # and are not matched in text


# tiktoken's o200k_base pattern (gpt-4o, gpt-oss), run by the `regex` module: an engine of its own
O200K = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def test_gpt4o_splits_where_o200k_splits(meta):
    """Every o200k piece boundary is a token boundary (whole-word merges notwithstanding), nothing more is cut
    than BPE cuts, and text round-trips."""
    import regex

    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "gpt-4o"})
    tokens = meta["tokenizer.ggml.tokens"]
    camel = "HelloWorld getHTTPResponse DON'T i'M 1234567 a/b/c\n\n"
    for text in [t for t in TEXTS if "<|" not in t and "<think>" not in t] + [camel]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        cuts, at = set(), 0
        for i in ids:
            at += len(tok.token_bytes(i))
            cuts.add(at)
        pieces = [m.group() for m in regex.finditer(O200K, text)]
        assert "".join(pieces) == text
        bounds = {len("".join(pieces[: k + 1]).encode()) for k in range(len(pieces))}
        assert bounds <= cuts, text
    assert [tokens[i] for i in tok.encode("12345")] == ["123", "4", "5"]  # a merged "12345" cut after three digits


def test_harmony_tokens_template_and_end_of_generation():
    """gpt-oss's chat tokens are single ids; <|return|> and <|call|> end generation, <|end|> does not (it closes
    one message of several in a turn, as llama.cpp reads Harmony); the template renders Harmony."""
    meta = tiny_tokenizer_metadata(1291, "harmony")
    tok = Tokenizer.from_metadata(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.pre"] == "gpt-4o"
    assert {tokens[i] for i in tok.eos_ids} == {"<|return|>", "<|call|>", "<|endoftext|>"}
    assert tok.encode("<|channel|>final<|message|>Hi<|end|>")[:1] == [tokens.index("<|channel|>")]
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And?"},
        ],
        reasoning_effort="low",
    )
    date = time.strftime("%Y-%m-%d")
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: low\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
        "<|start|>user<|message|>And?<|end|><|start|>assistant"
    )
