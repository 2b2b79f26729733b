"""The token sequences the tools feed a model: a text file's, the way a prompt of it is encoded, or random ids
(for files without a tokenizer, and runs that must not depend on one)."""

from __future__ import annotations

from pathlib import Path

import torch

from moestream.errors import MoestreamError

ENGLISH = Path(__file__).parent / "data" / "english.txt"  # the fixed text the generator is calibrated on


def random_prompt(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_text(path: str | Path) -> str:
    """A --text file's text, or one clear error."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8"
        raise MoestreamError(
            f"--text {path}: cannot read it as UTF-8 text ({reason}); give a plain text file"
        ) from None


def text_tokens(engine, path: str | Path = ENGLISH, limit: int | None = None) -> list[int]:
    """A text file's tokens (at most limit), the way a prompt of it is encoded."""
    tokens = engine.encode_prompt(read_text(path))
    if len(tokens) < 2:
        raise MoestreamError(f"--text {path}: {len(tokens)} tokens; give a text of at least two")
    return tokens[:limit] if limit else tokens
