"""Bad input gets one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from moestream.cli.main import main
from moestream.formats.gguf import GGUFFile
from moestream.formats.writer import TensorPlan, write_gguf


def rewrite(src: str, dst, meta_changes=None, drop=(), retype=None, reshape=None, drop_keys=()) -> str:
    """Copy a GGUF file, changing metadata, dropping metadata keys or tensors, giving one tensor another type
    (random bytes) or storing one under another shape of the same size (reshape=(name, shape))."""
    with GGUFFile(src) as f:
        meta = {k: v for k, v in f.metadata.items() if k not in drop_keys} | (meta_changes or {})
        plans, data = [], {}
        for name, t in f.tensors.items():
            if name in drop:
                continue
            qtype = retype[1] if retype and retype[0] == name else t.qtype
            shape = reshape[1] if reshape and reshape[0] == name else t.shape
            plans.append(TensorPlan(name, qtype, shape))
            data[name] = np.array(t.data).reshape(-1) if qtype == t.qtype else None

        def produce(p):
            return (
                data[p.name].reshape(p.byte_shape)
                if data[p.name] is not None
                else np.random.default_rng(0).integers(0, 255, p.byte_shape, dtype=np.uint8)
            )

        write_gguf(dst, meta["general.architecture"], meta, plans, produce, progress=False)
    return str(dst)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def assert_one_clear_line(code: int, line: str, *words: str) -> None:
    assert code == 2
    assert line.startswith("moestream: error:"), line
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"


def test_not_gguf(tmp_path, capsys):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    assert_one_clear_line(*run_cli(capsys, "info", str(p)), "not a GGUF file")


def test_an_empty_file_a_link_loop_and_an_unreadable_file(tmp_path, capsys):
    empty, loop, locked = tmp_path / "empty.gguf", tmp_path / "loop.gguf", tmp_path / "locked.gguf"
    empty.write_bytes(b"")
    loop.symlink_to(loop)
    assert_one_clear_line(*run_cli(capsys, "info", str(empty)), "the file is empty")
    assert_one_clear_line(*run_cli(capsys, "info", str(loop)), "symbolic link", "loop")
    locked.write_bytes(b"GGUF")
    locked.chmod(0)
    try:
        open(locked, "rb").close()  # root reads it anyway: nothing to see
    except PermissionError:
        assert_one_clear_line(*run_cli(capsys, "info", str(locked)), "Permission denied", "readable")
    finally:
        locked.chmod(0o644)


def test_missing_file(tmp_path, capsys):
    assert_one_clear_line(*run_cli(capsys, "info", str(tmp_path / "nope.gguf")), "no such file")


def test_a_blank_path_is_shown_quoted(capsys):
    """`info ' '` said ' : no such file': the path is whitespace, so it is quoted to be seen."""
    assert_one_clear_line(*run_cli(capsys, "info", " "), "' ': no such file")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated(model_file, tmp_path, capsys, keep):
    data = open(model_file("tiny", "Q8_0"), "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    assert_one_clear_line(*run_cli(capsys, "run", "-m", str(p), "-p", "hi", "--device", "cpu"), str(p))


def test_warmup_on_the_cpu_reads_the_header(model_file, tmp_path, capsys):
    """It compiles nothing there, and said so with exit 0 on a damaged file."""
    data = open(model_file("tiny", "Q8_0"), "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) // 2])
    assert_one_clear_line(*run_cli(capsys, "warmup", "-m", str(p), "--device", "cpu"), "truncated")


def test_unknown_architecture(model_file, tmp_path, capsys):
    p = rewrite(model_file("tiny", "F32"), tmp_path / "x.gguf", meta_changes={"general.architecture": "mamba9"})
    assert_one_clear_line(*run_cli(capsys, "info", p), "'mamba9'", "not supported", "qwen3moe")


def test_unsupported_tensor_type(model_file, tmp_path, capsys):
    p = rewrite(
        model_file("tiny", "F32"),
        tmp_path / "x.gguf",
        retype=("blk.1.ffn_up_exps.weight", gguf.GGMLQuantizationType.Q8_K),
    )
    assert_one_clear_line(
        *run_cli(capsys, "run", "-m", p, "-p", "hi", "--device", "cpu"), "blk.1.ffn_up_exps.weight", "Q8_K"
    )


def test_missing_tensor(model_file, tmp_path, capsys):
    p = rewrite(model_file("tiny", "F32"), tmp_path / "x.gguf", drop=("blk.0.attn_k_norm.weight",))
    assert_one_clear_line(*run_cli(capsys, "info", p), "blk.0.attn_k_norm.weight", "missing")


def test_a_prompt_of_bytes_that_are_no_utf8(model_file, capsys):
    """A terminal's stray byte reaches argv as a lone surrogate: the tokenizer raised a TypeError."""
    code, line = run_cli(capsys, "run", "-m", model_file("tiny", "F32"), "-p", "caf\udce9", "--device", "cpu")
    assert_one_clear_line(code, line, "-p", "not UTF-8", "character 4", "-f FILE")


def test_prompt_longer_than_context(model_file, capsys):
    code, line = run_cli(
        capsys, "run", "-m", model_file("tiny", "F32"), "-p", "word " * 200, "-c", "32", "--device", "cpu"
    )
    assert_one_clear_line(code, line, "context", "--ctx")


@pytest.mark.parametrize(
    "flags,word",
    [
        (["-ub", "0"], "--ubatch"),
        (["--temp", "-1"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["--device", "tpu"], "--device"),
        (["--expert-cache", "-2"], "--expert-cache"),
        (["--prefetch", "-1"], "--prefetch"),
        (["--prefetch-ahead", "3"], "--prefetch-ahead 3"),
        (["--threads", "100000"], "--threads"),  # a thread that cannot start crashed the process
        (["--devices", "cuda:x"], "--devices"),
        (["--devices", "cpu,cpu", "-ts", "nan,1", "-ncmoe", "all"], "--tensor-split"),
        (["--devices", "cpu,cpu", "-ts", "1e308,1e308", "-ncmoe", "all"], "--tensor-split"),
        (["--device", "cudax"], "--device cudax"),  # was reported as --device cuda
        (["--vram-budget", "-1G"], "positive"),  # a value after a space was "expected one argument"
        (["--temp", "-1e-3"], "--temp"),
    ],
)
def test_flags_out_of_range(model_file, capsys, flags, word):
    assert_one_clear_line(*run_cli(capsys, "run", "-m", model_file("tiny", "F32"), "-p", "hi", *flags), word)


def test_entry_point_exit_code(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"nope")
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "info", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_prompt_too_long_is_refused_before_any_weight_moves(model_file, capsys, monkeypatch):
    import moestream.runtime.loader as loader

    def no_upload(*args, **kwargs):
        raise AssertionError("weights were uploaded before the prompt was checked")

    monkeypatch.setattr(loader, "DenseWeights", no_upload)
    code, line = run_cli(capsys, "run", "-m", model_file("tiny", "F32"), "-p", "word " * 200, "-c", "32")
    assert_one_clear_line(code, line, "context", "--ctx")


def test_n_cpu_moe_auto_without_a_budget_is_refused_before_anything_runs(model_file, capsys, monkeypatch):
    """It was refused by the placement, after the dense weights had loaded (and in bench after the rows before)."""
    import moestream.runtime.loader as loader

    def no_upload(*args, **kwargs):
        raise AssertionError("weights were uploaded before -ncmoe auto was checked")

    monkeypatch.setattr(loader, "DenseWeights", no_upload)
    m = model_file("tiny", "F32")
    for argv in (
        ["run", "-m", m, "-p", "hi", "-ncmoe", "auto"],
        ["bench", "-m", m, "-p", "8", "-n", "0", "-ncmoe", "1,auto"],
    ):
        assert_one_clear_line(*run_cli(capsys, *argv, "--device", "cpu"), "--n-cpu-moe auto", "--vram-budget")


@pytest.mark.parametrize(("flags", "word"), [(["-ub", "4,8"], "4,8"), (["--expert-cache", "2,999"], "2,999")])
def test_profile_takes_one_value_of_each_flag_but_stream(model_file, capsys, flags, word):
    """profile read every engine flag as bench's comma list and ran with the first value, silently."""
    argv = ["profile", "-m", model_file("tiny", "F32"), "--device", "cpu", "-p", "8", "-r", "1", *flags]
    with pytest.raises(SystemExit) as e:  # argparse's own refusal now: one line
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("moestream: error:") and word in err[0]


def test_make_model_leaves_an_existing_file_whole_when_it_fails(model_file, tmp_path, capsys):
    """A bad flag found half-way (numpy refused the seed) used to leave a 29 KB stub in place of the model."""
    p = tmp_path / "keep.gguf"
    p.write_bytes(open(model_file("tiny", "Q8_0"), "rb").read())
    before = p.read_bytes()
    assert_one_clear_line(*run_cli(capsys, "make-model", str(p), "--preset", "tiny", "--seed", "-1"), "--seed")
    assert p.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["keep.gguf"]


def test_an_unknown_recipe_is_said_before_the_run(tmp_path, capsys):
    """--quant Q9_K said "writing o.gguf (preset tiny, Q9_K)" first, as if the file were on its way."""
    from moestream.cli.main import main

    assert main(["make-model", str(tmp_path / "o.gguf"), "--preset", "tiny", "--quant", "Q9_K"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moestream: error: --quant Q9_K: choose from"), err
    assert not list(tmp_path.iterdir())


def test_an_output_the_system_refuses_is_said_before_the_run(model_file, capsys):
    code, line = run_cli(
        capsys, "profile", "-m", model_file("tiny", "F32"), "--device", "cpu", "-p", "8", "--trace", "/proc/version"
    )
    assert_one_clear_line(code, line, "--trace /proc/version", "cannot be written")


@pytest.mark.parametrize("argv", [["profile", "-p", "8", "--trace", ""], ["make-model", "", "--preset", "tiny"]])
def test_an_empty_output_path_is_said_as_such(model_file, capsys, argv):
    if argv[0] == "profile":
        argv = [*argv, "-m", model_file("tiny", "F32"), "--device", "cpu"]
    assert_one_clear_line(*run_cli(capsys, *argv), "the path is empty")  # said ": is a directory"


def test_serve_says_a_port_in_use_before_loading_the_model(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        missing = str(tmp_path / "not-loaded.gguf")  # reaching the load would say no such file instead
        assert_one_clear_line(*run_cli(capsys, "serve", "-m", missing, "--port", port), "--port " + port, "in use")
    assert_one_clear_line(*run_cli(capsys, "serve", "-m", missing, "--api-key", ""), "--api-key is empty")


@pytest.mark.parametrize(
    "flags,words",
    [
        (["bench", "-p", "8", "--stream", "serial,bogus", "-o", "json"], ["--stream bogus"]),  # rows lost before
        (["bench", "-p", "8", "-ub", "4,0"], ["--ubatch 0"]),
        (["bench", "-p", "10000000000"], ["positions", "4095"]),  # was a 80 GB prompt, then "out of memory"
        (["bench", "-p", "8", "-c", "4"], ["-p, -n and -d", "at most 3"]),  # named a -d not given
        (["profile", "-p", "8", "--stream", "serial,bogus"], ["--stream bogus"]),
    ],
)
def test_bench_and_profile_check_every_row_before_the_first_runs(model_file, capsys, flags, words):
    code = main([*flags[:1], "-m", model_file("tiny", "F32"), "--device", "cpu", "-r", "1", *flags[1:]])
    out, err = capsys.readouterr()
    assert_one_clear_line(code, err.strip().splitlines()[-1], *words)
    assert "tiny" not in out and "pp8" not in out  # not one row measured


@pytest.mark.parametrize(
    "argv", [["run", "-m", "m.gguf", "-ncmoe", "1.5"], ["run", "-m", "m.gguf", "--small-batch", "some"], ["bench"]]
)
def test_a_flag_argparse_refuses_is_one_line_too(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("moestream: error:") and "--help" in err[0]


def test_make_model_trained_routing_of_a_preset_without_its_settings(tmp_path, capsys):
    code, line = run_cli(capsys, "make-model", str(tmp_path / "o.gguf"), "--preset", "tiny", "--routing", "trained")
    assert_one_clear_line(code, line, "--routing trained", "tiny", "qwen3-30b-a3b", "--routing uniform")
    assert not (tmp_path / "o.gguf").exists()


def test_make_model_layers_past_what_a_file_may_hold(tmp_path, capsys):
    code, line = run_cli(capsys, "make-model", str(tmp_path / "o.gguf"), "--preset", "tiny", "--layers", "100000")
    assert_one_clear_line(code, line, "--layers 100000", "4096")


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--routing", "--tokens", "99999999"], ["--tokens 99999999", "at most 4096"]),  # said: raise --ctx
        (["--routing", "--tokens", "0"], ["--tokens 0", "at least 1"]),
        (["--tokens", "-5"], ["--tokens -5", "at least 1"]),  # passed silently
        (["--tokens", "16"], ["--tokens", "--routing"]),  # ignored without --routing
        (["--routing", "--device", "cudax"], ["--device cudax", "cuda:N"]),  # said after the whole report
        (["--text", "a.txt"], ["--text a.txt", "--routing"]),
        (["--routing", "--text", "/no/such.txt"], ["--text /no/such.txt", "No such file", "plain text"]),
    ],
)
def test_info_tokens(model_file, capsys, flags, words):
    code = main(["info", model_file("tiny", "F32"), "--device", "cpu", *flags])
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1] if err.strip() else ""
    assert_one_clear_line(code, line, *words)
    assert "--ctx" not in line  # a flag info does not have
    assert out == ""  # refused before the report, not after it


@pytest.mark.parametrize(
    "changes,drop_keys,words",
    [
        ({}, ["tokenizer.chat_template"], ["tokenizer.chat_template", "without --chat", "/v1/completions"]),
        (
            {"tokenizer.chat_template": "{{ raise_exception('no user role') }}"},
            [],
            ["no user role", "without --chat", "/v1/completions"],  # the server's clients read it too
        ),
    ],
)
def test_chat_template_errors_name_a_fix(model_file, tmp_path, capsys, changes, drop_keys, words):
    p = rewrite(model_file("tiny", "F32"), tmp_path / "x.gguf", changes, drop_keys=drop_keys)
    assert_one_clear_line(*run_cli(capsys, "run", "-m", p, "-p", "hi", "--chat", "--device", "cpu"), *words)


def test_more_experts_used_than_exist(model_file, tmp_path, capsys):
    p = rewrite(model_file("tiny", "F32"), tmp_path / "x.gguf", {"qwen3moe.expert_used_count": 100})
    words = ["inconsistent", "qwen3moe.expert_used_count = 100", "qwen3moe.expert_count = 8", "convert"]
    assert_one_clear_line(*run_cli(capsys, "info", p), *words)


@pytest.mark.parametrize(
    "changes,drop_keys,words",
    [
        ({"tokenizer.ggml.model": "llama"}, [], ["'llama'", "'gpt2'", "convert"]),
        ({}, ["tokenizer.ggml.merges"], ["tokenizer.ggml.merges", "convert"]),  # was read as single bytes
    ],
)
def test_tokenizer_kinds(model_file, tmp_path, capsys, changes, drop_keys, words):
    p = rewrite(model_file("tiny", "F32"), tmp_path / "x.gguf", changes, drop_keys=drop_keys)
    assert_one_clear_line(*run_cli(capsys, "run", "-m", p, "-p", "hi", "-n", "1", "--device", "cpu"), *words)


@pytest.mark.parametrize("argv", [["run", "-m", "", "-p", "hi"], ["info", ""], ["probe", "-m", ""]])
def test_empty_model_path(capsys, argv):
    code, line = run_cli(capsys, *argv)
    assert_one_clear_line(code, line, "empty")
    assert "directory" not in line  # '' read as '.'


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cpu_moe_with_n_cpu_moe(model_file, capsys, command):
    extra = ["-p", "hi"] if command == "run" else ["-p", "8", "-r", "1"]
    argv = [command, "-m", model_file("tiny", "F32"), *extra, "--device", "cpu", "--cpu-moe", "-ncmoe", "1"]
    assert_one_clear_line(*run_cli(capsys, *argv), "--cpu-moe", "--n-cpu-moe 1", "one of them")


@pytest.mark.parametrize("flag", ["--expert-cache", "--prefetch"])
def test_more_experts_than_a_layer_has_is_refused_before_the_weights_load(model_file, capsys, monkeypatch, flag):
    import moestream.runtime.loader as loader

    def no_upload(*args, **kwargs):
        raise AssertionError("weights were uploaded before the expert count was checked")

    monkeypatch.setattr(loader, "DenseWeights", no_upload)
    code, line = run_cli(capsys, "run", "-m", model_file("tiny", "F32"), "-p", "hi", "--device", "cpu", flag, "999")
    assert_one_clear_line(code, line, f"{flag} 999", "8 experts")
    # bench: a later row's count too, before the first row (or the weights) can run
    bench = ["bench", "-m", model_file("tiny", "F32"), "--device", "cpu", "-ncmoe", "all", "-p", "8", "-n", "0"]
    assert_one_clear_line(*run_cli(capsys, *bench, flag, "2,999"), f"{flag} 999", "8 experts")


def test_probe_n_cpu_moe_needs_a_model(capsys):
    assert_one_clear_line(*run_cli(capsys, "probe", "--device", "cpu", "-ncmoe", "5"), "-ncmoe", "-m")
    # out of range: said as such, with or without -m (it said "give -m MODEL too")
    assert_one_clear_line(*run_cli(capsys, "probe", "--device", "cpu", "-ncmoe", "-1"), "-ncmoe -1", "at least 0")


@pytest.mark.parametrize("command", ["info", "run", "bench"])
def test_help_names_each_default_once(capsys, command):
    """--tokens and --ctx default to None (not given) and name their real default in the help: argparse used to
    append "(default: None)" after it."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    own = "(default 2048)" if command == "info" else "(default 4096)"
    assert own in text and f"{own} (default: None)" not in text
