"""Opening a GGUF file: metadata and tensor views as gguf's own reader sees them, a 152k vocabulary in well under a
second (gguf's reader took seconds), and `info` on such a file quickly from the command line."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

from moestream.errors import MoestreamError
from moestream.formats.gguf import GGUFFile
from moestream.formats.writer import TensorPlan, write_gguf

N_VOCAB = 151_936  # Qwen3's


@pytest.fixture(scope="module")
def big_vocab_file(model_file, tmp_path_factory):
    """The tiny model with a Qwen3-sized vocabulary and merges in its metadata (the weights stay tiny)."""
    src, dst = model_file("tiny", "F32"), tmp_path_factory.mktemp("vocab") / "big-vocab.gguf"
    with GGUFFile(src) as f:
        meta = dict(f.metadata) | {
            "tokenizer.ggml.tokens": [f"tok{i}\u00e9" for i in range(N_VOCAB)],
            "tokenizer.ggml.token_type": [1] * N_VOCAB,
            "tokenizer.ggml.merges": [f"tok{i} tok{i + 1}" for i in range(N_VOCAB - 1)],
        }
        plans = [TensorPlan(n, t.qtype, t.shape) for n, t in f.tensors.items()]
        data = {n: np.array(t.data) for n, t in f.tensors.items()}
        write_gguf(dst, f.architecture, meta, plans, lambda p: data[p.name].reshape(p.byte_shape), progress=False)
    return str(dst)


def test_metadata_and_tensors_match_ggufs_reader(model_file):
    path = model_file("tiny-qwen35moe", "Q4_K_M")
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                if field.types[-1] == gguf.GGUFValueType.STRING:
                    expected = [bytes(field.parts[i]).decode() for i in field.data]
                else:
                    expected = np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
            else:
                expected = field.contents()
            assert f.metadata[name] == expected, name
        assert len(f.metadata) == len([n for n in reader.fields if not n.startswith("GGUF.")])
        for t in reader.tensors:
            view = f.tensors[t.name]
            assert view.qtype == t.tensor_type and view.shape == tuple(reversed(t.shape.tolist()))
            assert np.array_equal(view.data.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_a_152k_vocabulary_opens_in_well_under_a_second(big_vocab_file):
    """CPU time (0.1 s on the dev machine; its wall time depends on what else runs there)."""
    t0 = time.process_time()
    with GGUFFile(big_vocab_file) as f:
        tokens = f.metadata["tokenizer.ggml.tokens"]
        elapsed = time.process_time() - t0
        assert len(tokens) == N_VOCAB and tokens[7] == "tok7\u00e9" and tokens[-1] == f"tok{N_VOCAB - 1}\u00e9"
        assert f.metadata["tokenizer.ggml.merges"][:2] == ["tok0 tok1", "tok1 tok2"]
        assert f.metadata["tokenizer.ggml.token_type"][-1] == 1
    assert elapsed < 0.5, f"{elapsed:.2f} s"


def test_info_on_a_152k_vocabulary_takes_under_a_second_and_a_half(big_vocab_file):
    """CPU time of the whole command (0.3 s on the dev machine: it imports no torch, tests/cli/test_info.py)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "info", big_vocab_file], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0 and "vocab" in r.stdout, r.stderr
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 1.5, f"{cpu:.2f} s of CPU"


def test_bytes_no_tensor_names_after_the_data_are_a_warning(model_file, tmp_path):
    """A header whose tensor count misses its last tensor (when the infos happen to end aligned) leaves that
    tensor's bytes unread at the end: said, not an error (a writer may append something)."""
    path = tmp_path / "tail.gguf"
    path.write_bytes(open(model_file("tiny", "F32"), "rb").read() + bytes(4096))
    with pytest.warns(UserWarning, match="4096 bytes follow the last tensor's data"), GGUFFile(path) as f:
        assert f.architecture == "qwen3moe"


def test_an_architecture_of_another_type_is_not_called_missing(model_file):
    with GGUFFile(model_file("tiny", "F32")) as f:
        f.metadata["general.architecture"] = 7
        with pytest.raises(MoestreamError, match="general.architecture holds a value of type int"):
            _ = f.architecture


def test_a_model_larger_than_the_free_disk_is_refused_before_a_byte_is_written(tmp_path):
    """The file is sized up front (sparse): a 216 GB make-model on a 69 GB disk ran hours before failing."""
    plans = [TensorPlan("big.weight", gguf.GGMLQuantizationType.F32, (1 << 25, 1 << 25))]  # 4 PiB
    with pytest.raises(MoestreamError, match="the model takes 4194304.0 GiB but .* GiB free"):
        write_gguf(tmp_path / "big.gguf", "qwen3moe", {}, plans, lambda p: None, progress=False)
    assert list(tmp_path.iterdir()) == []
