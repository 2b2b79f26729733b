"""The model path itself: a regular file that starts as a GGUF file does. No numpy here: the CLI says a wrong path
before the slow imports."""

from __future__ import annotations

import os
from pathlib import Path

from moestream.errors import MoestreamError


def check_model_file(path: str | os.PathLike[str]) -> Path:
    """The path, if it names a readable regular file with GGUF's magic; else one line saying what it is."""
    if not os.fspath(path):  # Path("") is ".", a directory
        raise MoestreamError("the model path is empty; pass the path of a .gguf model file")
    p = Path(path)
    if not p.is_file():
        if p.is_dir():
            what = "is a directory"
        elif p.exists():
            what = "is not a regular file (a pipe or device cannot be memory-mapped)"
        elif p.is_symlink():
            what = "is a symbolic link that leads to no file (its target is missing, or the links loop)"
        else:
            what = "no such file"
        shown = str(p) if str(p).strip() == str(p) else repr(str(p))  # ' '
        raise MoestreamError(f"{shown}: {what}; pass the path of a .gguf model file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MoestreamError(f"{p}: {e.strerror}; check the file's permissions (it must be readable)") from None
    if not magic:
        raise MoestreamError(f"{p}: the file is empty (0 bytes); download or convert the model again")
    if magic != b"GGUF":
        raise MoestreamError(
            f"{p}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py or pass a .gguf file"
        )
    return p
