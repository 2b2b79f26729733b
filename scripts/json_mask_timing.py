"""How long response_format's full token mask takes at each point of a JSON answer, over a vocabulary the size
of Qwen3's (151k tokens: every byte, then random words, most with a leading blank, some ending in JSON
punctuation). A generated model's vocabulary has ~500 normal tokens, so it cannot show this.

    python scripts/json_mask_timing.py [TREE]   # TREE: a checkout to import moestream from (an A/B), default this one
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

from moestream.formats.tokenizer import NORMAL  # noqa: E402
from moestream.runtime.json_constraint import JsonConstraint, schema_of  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "mood": {"enum": ["calm", "storm"]}, "n": {"type": "integer"}},
    "required": ["name", "mood"],
}
# the answers so far, fed a byte at a time (tokens 0-255 are the single bytes); a mask is timed after each piece.
# The second: response_format json_object (any JSON), whose keys are free text.
ANSWERS = [
    (SCHEMA, [b"{", b'"', b"na", b'me":', b' "', b"Ann and", b'", "mood": "', b"ca"]),
    ({}, [b"{", b'"', b"na", b'me": "', b"Ann and"]),
]


class Vocabulary:
    """The three things the constraint reads of a tokenizer."""

    def __init__(self, size: int = 151_000, seed: int = 0):
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        ends = ['"', ",", ".", ":", '":', '",', "\\n", "{", "}"]
        self.words = [bytes([b]) for b in range(256)]
        while len(self.words) < size:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
            word = (" " if rng.random() < 0.6 else "") + word + (rng.choice(ends) if rng.random() < 0.1 else "")
            self.words.append(word.encode())
        self.token_types = [NORMAL] * size
        self.eos_ids = (0,)

    def token_bytes(self, i: int) -> bytes:
        return self.words[i]


def main() -> None:
    vocab = Vocabulary()
    n = len(vocab.words)
    print("| schema | answer so far ends with | state | tokens allowed | mask ms (best of 3) |")
    print("|---|---|---|---:|---:|")
    for schema, pieces in ANSWERS:
        c = JsonConstraint(vocab, schema_of({"type": "json_schema", "json_schema": {"schema": schema}}))
        c.mask(n)  # the vocabulary's index, made once
        for piece in pieces:
            for b in piece:
                c.advance(b)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                allowed = c.mask(n)
                times.append(time.perf_counter() - start)
            row = ["listed" if schema else "any", f"`{piece.decode()}`", c.state[-1][0], int(allowed.sum())]
            print("| " + " | ".join(map(str, row)) + f" | {min(times) * 1000:.1f} |")


if __name__ == "__main__":
    main()
