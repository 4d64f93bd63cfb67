"""The command line: `npllm info`, and errors printed as one clear line with a non-zero exit."""

import argparse
import subprocess
import sys

import pytest

from npllm import cli
from tests_support import COMPILE_TIMEOUT, REPO


def run_npllm(*args):
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=COMPILE_TIMEOUT)


def test_info_describes_stories260k(stories260k):
    result = run_npllm("info", str(stories260k))
    assert result.returncode == 0, result.stderr
    assert "5 layers, dim 64" in result.stdout and "260,032" in result.stdout and "tok512.bin" in result.stdout


def test_errors_are_one_line_not_a_traceback(stories260k, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x00\x00\x00" * 3)
    for args in (["info", str(bad)], ["generate", "--model", str(tmp_path / "absent.bin")],
                 ["generate", "hi", "--model", str(stories260k), "--temperature", "-1"],
                 ["generate", "hi", "--model", str(stories260k), "--top-p", "1.5"]):
        result = run_npllm(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("npllm: error:") and "Traceback" not in result.stderr, result.stderr


def test_logprobs_go_to_stderr_and_match_the_model(stories260k):
    import numpy as np

    import npllm
    from npllm.sampling import log_softmax

    plain = npllm_cli_text(stories260k)
    result = run_npllm("generate", "Lily", "--model", str(stories260k), "--temperature", "0", "--max-new-tokens", "6",
                   "--logprobs", "2")
    assert result.returncode == 0 and result.stdout == plain
    lines = [line for line in result.stderr.splitlines() if line.startswith("[logprobs]")]
    assert len(lines) == 6
    llm = npllm.load(stories260k)
    ids = llm.tokenizer.encode("Lily", bos=True)
    new = list(llm.generate_ids(ids, 6, temperature=0))
    expected = log_softmax(llm.logits(ids + new).astype(np.float64))[len(ids) - 1:-1]
    for line, token, row in zip(lines, new, expected):
        assert float(line.split()[2]) == pytest.approx(row[token], abs=2e-4)


def npllm_cli_text(stories260k):
    return run_npllm("generate", "Lily", "--model", str(stories260k), "--temperature", "0", "--max-new-tokens", "6").stdout


# --------------------------------------------------------------------------------------------------------------
# I/O behaviour: closed pipes, input checked before output, Ctrl-C, the prompt from stdin


def npllm_process(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "npllm", *args], cwd=REPO, **kwargs)


def test_a_closed_pipe_ends_quietly():
    """`npllm generate ... | head -c 20`: the reader leaves after 20 bytes; no traceback, status 141 (SIGPIPE)."""
    proc = npllm_process("generate", "Once upon", "--max-new-tokens", "400", "--seed", "1",
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = proc.stdout.read(20)
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=COMPILE_TIMEOUT)
    assert head.startswith(b"Once upon")
    assert proc.returncode == 141, stderr
    assert b"Traceback" not in stderr and b"Exception" not in stderr, stderr


@pytest.mark.parametrize("args", [
    ["generate", "once " * 1000],  # longer than the 512-token context
    ["generate", "hi", "--max-new-tokens", "-1"],
    ["generate", "hi", "--top-p", "0"],
    ["generate", "hi", "--threads", "0"],
])
def test_bad_input_writes_nothing_to_stdout(args):
    result = run_npllm(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr and "error" in result.stderr


def test_invalid_utf8_prompts_are_clear_errors():
    """$'\\xff' from the shell reaches Python as a lone surrogate; piped bytes that are not UTF-8 likewise."""
    result = subprocess.run([sys.executable, "-m", "npllm", "generate", b"\xff"], capture_output=True, cwd=REPO,
                            timeout=COMPILE_TIMEOUT)
    assert result.returncode == 2 and result.stdout == b"", result.stderr
    assert result.stderr.startswith(b"npllm: error: the prompt is not valid UTF-8")
    result = subprocess.run([sys.executable, "-m", "npllm", "generate", "-"], input=b"Lily \xc3", capture_output=True,
                            cwd=REPO, timeout=COMPILE_TIMEOUT)
    assert result.returncode == 2 and result.stdout == b"" and b"not UTF-8" in result.stderr, result.stderr


def test_dash_reads_the_prompt_from_stdin():
    common = ["--temperature", "0", "--max-new-tokens", "12"]
    piped = subprocess.run([sys.executable, "-m", "npllm", "generate", "-", *common], input="Lily and Ben\n",
                           capture_output=True, text=True, cwd=REPO, timeout=COMPILE_TIMEOUT)
    direct = run_npllm("generate", "Lily and Ben", *common)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.startswith("Lily and Ben")


def test_ctrl_c_ends_the_line_and_exits_130(tmp_path, stories260k):
    """SIGINT in the middle of a long generation (a random model with a long context, slow enough to be caught
    mid-way): the line is ended, stderr says so in one line, status 130."""
    import signal

    from npllm.config import ModelConfig
    from npllm.formats.llama2c import write_llama2c
    from npllm.formats.random import random_weights

    config = ModelConfig(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512,
                         max_seq_len=1 << 16)
    write_llama2c(tmp_path / "long.bin", config, random_weights(config, seed=1))
    proc = npllm_process("generate", "Once", "--model", str(tmp_path / "long.bin"), "--tokenizer",
                         str(stories260k.parent / "tok512.model"), "--max-new-tokens", "60000", "--backend", "numpy",
                         "--seed", "1", "--ignore-eos",  # an end token drawn early must not end the run first
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         # as a terminal would run it: a shell without job control starts background jobs with
                         # SIGINT ignored, a child inherits that, and Python then installs no KeyboardInterrupt
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(40)  # generation is under way
    proc.send_signal(signal.SIGINT)
    rest, stderr = proc.communicate(timeout=COMPILE_TIMEOUT)
    out = first + rest
    assert proc.returncode == 130, stderr
    assert out.startswith(b"Once") and out.endswith(b"\n")
    assert b"Traceback" not in stderr and stderr.decode().strip().endswith("npllm: interrupted"), stderr


def test_the_first_compile_of_a_run_is_announced_once(capsys):
    """A Numba cache miss (compilation) under a model-running command prints one line on stderr, however many
    functions compile; loading from the cache raises no event, and outside the command nothing is printed."""
    from numba import njit

    def fresh():  # a new dispatcher each call: compiled on first use, never cached
        return njit(lambda x: x + 1)

    from numba.core import event

    listeners = list(event._registered["numba:compile"])
    with cli.compile_notice(True):
        assert fresh()(1) == 2 and fresh()(2.5) == 3.5
    assert capsys.readouterr().err.count("[npllm] compiling kernels for this CPU") == 1
    assert event._registered["numba:compile"] == listeners  # its listener gone with the command
    with cli.compile_notice(False):
        fresh()(1)
    fresh()(1)
    assert capsys.readouterr().err == ""
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    announced = {name for name, parser in commands.items() if parser.get_default("compiles")}
    assert announced == {"generate", "chat", "bench", "perplexity", "embed", "serve", "batch"}  # the commands that run a model


# ---- a refused argument is one line, for every command and every kind of refusal --------------------------------


def subcommand_parsers() -> dict:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def bad_value_cases() -> list[list[str]]:
    """For every command: each typed option given a word, each bounded number one below its range, each choice
    option a value not among its choices; then missing values, unknown flags and commands, missing arguments."""
    cases = []
    for name, sub in subcommand_parsers().items():
        for action in sub._actions:
            if not action.option_strings:
                continue
            flag = action.option_strings[0]
            if action.type is not None:
                cases.append([name, flag, "abc"])
                if getattr(action.type, "__name__", "").startswith(("integer >=", "seconds")):
                    cases.append([name, flag, "-1"])
            if action.choices is not None:
                cases.append([name, flag, "no-such-choice"])
            if action.nargs != 0:
                cases.append([name, flag])  # the value is missing
        cases.append([name, "--no-such-flag"])
    return cases + [["generate", "Once", "--threads", "0"], ["serve", "--port", "70000"], ["no-such-command"], [],
                    ["quantize"], ["generate", "--max-new-tokens", "1.5"], ["serve", "--header-timeout", "nan"]]


BAD_VALUES = bad_value_cases()


def test_the_bad_value_cases_cover_every_command():
    assert {case[0] for case in BAD_VALUES if case} >= set(subcommand_parsers())
    assert len(BAD_VALUES) > 100


@pytest.mark.parametrize("argv", BAD_VALUES, ids=" ".join)
def test_a_refused_argument_is_one_error_line(argv, capsys):
    """argparse's own refusals (a type= or choices= failure, a missing or unknown argument) print one
    `npllm: error:` line and exit 2, like npllm's errors: not the usage block above it."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("npllm: error: ") and err.count("\n") == 1, err
    assert "usage:" not in err


# ---- info and quantize take --model too ----------------------------------------------------------------------


def test_info_takes_model_as_a_flag(stories260k, capsys):
    assert cli.main(["info", "--model", str(stories260k)]) == 0
    flagged = capsys.readouterr().out
    assert cli.main(["info", str(stories260k)]) == 0
    assert capsys.readouterr().out == flagged and "260,032" in flagged


def test_quantize_takes_model_as_a_flag(stories260k, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # the same file name in both: the file records it
    assert cli.main(["quantize", "--model", str(stories260k), str(tmp_path / "a" / "m.gguf"), "--type", "q8_0"]) == 0
    assert cli.main(["quantize", str(stories260k), str(tmp_path / "b" / "m.gguf"), "--type", "q8_0"]) == 0
    assert (tmp_path / "a" / "m.gguf").read_bytes() == (tmp_path / "b" / "m.gguf").read_bytes()


@pytest.mark.parametrize("argv", [["info", "stories260K", "--model", "stories260K"],
                                  ["quantize", "stories260K", "out.gguf", "-m", "stories260K"],
                                  ["quantize", "out.gguf"]], ids=" ".join)
def test_a_checkpoint_given_twice_or_not_at_all_is_refused(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("npllm: error: ") and err.count("\n") == 1 and "--model" in err, err
    assert not (tmp_path / "out.gguf").exists()


# ---- the package npllm.cli: every command the parser knows has its run function --------------------------------


def test_every_command_of_the_parser_is_run_by_its_module():
    assert set(subcommand_parsers()) == set(cli.RUNS)
    for name, run in cli.RUNS.items():
        assert run.__module__ == f"npllm.cli.{name}", (name, run.__module__)


def test_the_cli_package_runs_as_a_module(stories260k):
    result = subprocess.run([sys.executable, "-m", "npllm.cli", "info", str(stories260k)], capture_output=True,
                            text=True, cwd=REPO, timeout=COMPILE_TIMEOUT)
    assert result.returncode == 0 and "260,032" in result.stdout, result.stderr
