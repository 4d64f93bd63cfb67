"""npllm batch in one process (npllm/batch.py): what `npllm generate` prints, per request, whatever the batch size;
a killed run resumed with every id exactly once; bad lines in the errors file with the run going on; bad files
refused with one error line. The model is stories260K, embedded in the package, on the default (Numba) backend,
whose batched rows are computed exactly as a lone prompt's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from npllm.cli import main

PROMPTS = ["Once upon a time", "Lily and Ben went", "The little dog", "Tom had a red ball"]


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def npllm(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in this process: (status, stdout, stderr)."""
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def generated(capsys, prompt: str, max_tokens: int, *options) -> str:
    """What `npllm generate` prints for the prompt."""
    status, out, _ = npllm(capsys, "generate", prompt, "--max-new-tokens", str(max_tokens), *options)
    assert status == 0
    return out


def test_each_result_is_what_generate_prints_whatever_the_batch_size(tmp_path, capsys):
    """Greedy lines, a seeded sampled line and a line with a stop string: prompt + text is `npllm generate`'s
    output, with batch sizes 1 and 3 alike (the runs' files are identical)."""
    rows = [{"id": i, "prompt": p, "max_tokens": 20 + 7 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    rows.append({"id": "seeded", "prompt": "The cat", "max_tokens": 30, "temperature": 0.8, "top_p": 1, "seed": 5})
    rows.append({"id": "stop", "prompt": "A bird", "max_tokens": 30, "temperature": 0, "stop": ["."]})
    write_jsonl(tmp_path / "in.jsonl", rows)
    for size in ("1", "3"):
        status, out, err = npllm(capsys, "batch", "--input", str(tmp_path / "in.jsonl"), "--output",
                                 str(tmp_path / f"out{size}.jsonl"), "--batch-size", size)
        assert (status, out) == (0, "")
        assert f"{len(rows)} results written" in err and "0 bad lines" in err
    assert (tmp_path / "out1.jsonl").read_text() == (tmp_path / "out3.jsonl").read_text()
    results = read_jsonl(tmp_path / "out3.jsonl")
    assert [r["id"] for r in results] == [r["id"] for r in rows]  # input order
    for row, result in zip(rows[:len(PROMPTS)], results):
        assert row["prompt"] + result["text"] + "\n" == generated(capsys, row["prompt"], row["max_tokens"],
                                                                  "--temperature", "0")
        assert result["finish_reason"] == "length" and len(result["tokens"]) == row["max_tokens"]
        assert result["usage"]["completion_tokens"] == row["max_tokens"]
    seeded, stop = results[-2:]
    assert "The cat" + seeded["text"] + "\n" == generated(capsys, "The cat", 30, "--temperature", "0.8",
                                                          "--top-p", "1", "--seed", "5")
    assert "A bird" + stop["text"] + "\n" == generated(capsys, "A bird", 30, "--temperature", "0", "--stop", ".")
    assert stop["finish_reason"] == "stop" and "." not in stop["text"]


def test_bad_lines_go_to_the_errors_file_and_the_run_goes_on(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Once", "max_tokens": 5, "temperature": 0},
        "not json",
        {"prompt": "no id"},
        {"id": 2, "prompt": "Too hot", "temperature": 3},
        {"id": 1, "prompt": "again"},
        {"id": 3, "messages": [{"role": "user", "content": "Hi"}]},
        {"id": [4], "prompt": "a list as id"},
        {"id": 5, "prompt": "Twice", "messages": []},
        {"id": 6, "prompt": "Last", "max_tokens": 3, "temperature": 0},
    ])
    status, out, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert (status, out) == (0, "")
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 6]
    errors = {e["line"]: e for e in read_jsonl(tmp_path / "out.errors.jsonl")}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7, 8]
    assert "not JSON" in errors[2]["error"] and 'no "id"' in errors[3]["error"]
    assert errors[4]["id"] == 2 and "temperature" in errors[4]["error"]
    assert errors[5]["error"] == "id 1 repeats line 1"
    assert errors[6]["id"] == 3 and "--chat-template" in errors[6]["error"]  # stories260K ships no chat template
    assert '"id" must be' in errors[7]["error"] and "either" in errors[8]["error"]
    assert "7 bad lines" in err
    # with a template the chat line runs; the errors file then holds only this run's bad lines
    status, _, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           "--chat-template", "chatml")
    assert status == 0 and "1 results written" in err and "2 already there" in err
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 6, 3]
    assert 6 not in {e["line"] for e in read_jsonl(tmp_path / "out.errors.jsonl")}


def test_a_torn_last_line_is_cut_and_a_foreign_output_is_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "Once", "max_tokens": 3} for i in range(3)])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 0, "text": "x", "tokens": [], "finish_reason": "stop", "usage": {}}\n{"id": 1, "te')
    status, _, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out))
    assert status == 0 and "2 results written" in err
    assert [r["id"] for r in read_jsonl(out)] == [0, 1, 2]
    out.write_text("a file that is not a batch output\n")
    status, stdout, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out))
    assert (status, stdout) == (2, "") and "line 1 is not a result of npllm batch" in err
    assert out.read_text() == "a file that is not a batch output\n"


@pytest.mark.parametrize("argv, message", [
    (["-i", "{missing}", "-o", "{tmp}/out.jsonl"], "--input"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"], "are the same file"),
    (["-i", "{tmp}/in.jsonl", "-o", ""], "names no file"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/."], "not a regular file (a folder)"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/out.jsonl", "--workers", "2"], "--workers needs --ray"),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/out.jsonl", "--chat-template", "no-such-template"], "no-such-template"),
])
def test_bad_files_and_options_are_one_error_line(tmp_path, capsys, argv, message):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Once"}])
    argv = [a.format(tmp=tmp_path, missing=tmp_path / "missing.jsonl") for a in argv]
    status, out, err = npllm(capsys, "batch", *argv)
    assert (status, out) == (2, "")
    assert err.startswith("npllm: error:") and message in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_killed_run_resumed_has_every_id_exactly_once(tmp_path, capsys):
    """A real kill (SIGKILL) of `npllm batch` while it writes, then a second run: every id once, each result the
    one an uninterrupted run gives."""
    rows = [{"id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i % 3), "max_tokens": 300,
             "temperature": 0 if i % 2 else 0.9, "seed": i} for i in range(40)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    argv = ["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--batch-size", "1"]
    child = subprocess.Popen([sys.executable, "-m", "npllm", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    out = tmp_path / "out.jsonl"
    deadline = time.monotonic() + 240
    while (not out.exists() or out.read_text().count("\n") < 2) and time.monotonic() < deadline:
        assert child.poll() is None, "npllm batch ended before it was killed"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    written = out.read_text().count("\n")
    assert 2 <= written < len(rows), "the kill did not land halfway"
    status, _, err = npllm(capsys, *argv)
    assert status == 0 and f"{written} already there" in err
    results = read_jsonl(out)
    assert [r["id"] for r in results] == [r["id"] for r in rows]
    npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "whole.jsonl"), "--batch-size", "8")
    assert results == read_jsonl(tmp_path / "whole.jsonl")


def test_npllm_imports_and_runs_without_ray():
    """npllm, npllm.batch and npllm.ray import with Ray absent; --ray then is one error line naming the extra."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import npllm, npllm.batch, npllm.ray, npllm.cli\n"
            "sys.exit(npllm.cli.main(['batch', '-i', sys.argv[1], '-o', sys.argv[1] + '.out', '--ray']))\n")
    done = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("npllm: error:") and ".[ray]" in done.stderr


# ----------------------------------------------------------------------------------------------------------------
# Bad input lines, output files and write failures (the third bad-input campaign): one error line or one
# `npllm: error:` line each, never a traceback, a hang or a job that dies on a line
# ----------------------------------------------------------------------------------------------------------------


def batch(capsys, tmp_path, *extra) -> tuple[int, str]:
    status, out, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                             *extra)
    assert out == "" and "Traceback" not in err
    return status, err


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def test_a_line_over_the_limit_is_an_error_line_read_past_in_pieces(tmp_path, capsys):
    """A 10 MB request line (a valid request, but past the default 4 MiB) is an error line and the lines after it
    run; the reading never holds it whole (the peak of what Python allocated stays under it)."""
    import tracemalloc

    from npllm.batch import plan

    huge = json.dumps({"id": "huge", "prompt": "x" * (10 << 20)})
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Once", "max_tokens": 3}, huge,
                                        {"id": 2, "prompt": "The cat", "max_tokens": 3}])
    tracemalloc.start()
    try:
        work = plan(tmp_path / "in.jsonl", tmp_path / "out.jsonl")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [line.id for line in work.pending] == [1, 2] and peak < (10 << 20)
    assert work.errors == [{"line": 2, "id": None, "error": f"the line is longer than --max-line-bytes ({4 << 20} "
                                                            f"bytes)"}]
    status, err = batch(capsys, tmp_path, "--max-line-bytes", "1000")
    assert status == 0 and "2 results written" in err and "1 bad lines" in err
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 2]
    assert "--max-line-bytes (1000 bytes)" in read_jsonl(tmp_path / "out.errors.jsonl")[0]["error"]


def test_lines_nested_too_deep_are_error_lines_and_the_job_goes_on(tmp_path, capsys):
    """5,000 nested lists (past the JSON parser's recursion), and a message with an unknown field nested 100 and
    700 deep (past the chat template's value conversion): error lines, the others run, a resume too."""
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Once", "max_tokens": 3},
        '{"id": 2, "prompt": "x", "extra": ' + "[" * 5000 + "]" * 5000 + "}",
        {"id": 3, "messages": [{"role": "user", "content": "Hi", "extra": nested(700)}]},
        {"id": 4, "messages": [{"role": "user", "content": "Hi", "extra": nested(100)}]},
        {"id": 5, "messages": [{"role": "user", "content": "Hi", "extra": nested(3)}], "max_tokens": 3},
    ])
    for _ in range(2):
        status, err = batch(capsys, tmp_path, "--chat-template", "chatml")
        assert status == 0 and "3 bad lines" in err
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [1, 5]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [e["line"] for e in errors] == [2, 3, 4] and all("nested" in e["error"] for e in errors)


def test_a_byte_order_mark_before_the_first_line_is_dropped(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": 1, "prompt": "Once", "max_tokens": 3})
                                        .encode() + b"\n")
    status, err = batch(capsys, tmp_path)
    assert status == 0 and "1 results written" in err and "0 bad lines" in err


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two runs at once on one output: the second is one error line at once, and the first writes every id once."""
    rows = [{"id": i, "prompt": PROMPTS[i % 4], "max_tokens": 200, "temperature": 0} for i in range(30)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "npllm", "batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                              str(out), "--batch-size", "1", "--backend", "numpy"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or not out.read_text()) and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read().decode()
            time.sleep(0.01)
        assert first.poll() is None, "the first run ended before the second started"
        status, err = batch(capsys, tmp_path)
        assert status == 2 and err.startswith("npllm: error: --output") and "another npllm batch" in err
        assert first.wait(240) == 0
    finally:
        first.kill()
        first.wait()
    assert [r["id"] for r in read_jsonl(out)] == list(range(30))
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_an_output_with_a_repeated_id_is_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "Once", "max_tokens": 3} for i in range(3)])
    result = {"text": "x", "tokens": [], "finish_reason": "stop", "usage": {}}
    write_jsonl(tmp_path / "out.jsonl", [{"id": 0, **result}, {"id": 1, **result}, {"id": 0, **result}])
    before = (tmp_path / "out.jsonl").read_text()
    status, err = batch(capsys, tmp_path)
    assert status == 2 and err.startswith("npllm: error:") and "line 3 repeats the id 0 of line 1" in err
    assert (tmp_path / "out.jsonl").read_text() == before


def test_an_output_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    """A FIFO (which would block the reading of the output forever) and a link to /dev/zero (endless): refused before
    anything is read, in a child with a bounded address space and a deadline."""
    import resource

    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Once"}])
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for output, kind in (("fifo.jsonl", "a FIFO"), ("zero.jsonl", "a device")):
        done = subprocess.run([sys.executable, "-m", "npllm", "batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                               str(tmp_path / output)], capture_output=True, text=True, timeout=60, preexec_fn=limit)
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr.startswith("npllm: error: --output") and f"not a regular file ({kind}" in done.stderr
    assert (tmp_path / "fifo.jsonl").is_fifo() and (tmp_path / "zero.jsonl").is_symlink()


def test_a_full_disk_is_one_error_line_and_leaves_no_half_line(tmp_path, capsys, monkeypatch):
    """The second result's write fails half-way with ENOSPC: one error line, the output holds the first result
    alone (the half line is taken back), and a run started again completes it. An errors file on /dev/full: the
    same error line."""
    import errno

    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "Once", "max_tokens": 3} for i in range(3)] + ["bad"])
    real_write, results = os.write, []

    def full_disk(fd, data):
        if bytes(data).startswith(b'{"id"'):
            results.append(data)
            if len(results) == 2:
                real_write(fd, data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    status, err = batch(capsys, tmp_path)
    monkeypatch.undo()
    last = err.splitlines()[-1]  # after the progress bar
    assert status == 2 and last.startswith("npllm: error: --output") and "No space left on device" in last
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [0]
    status, err = batch(capsys, tmp_path)
    assert status == 0 and "2 results written" in err and "1 already there" in err
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [0, 1, 2]
    if os.path.exists("/dev/full"):
        status, err = batch(capsys, tmp_path, "--errors", "/dev/full")
        last = err.splitlines()[-1]
        assert status == 2 and last.startswith("npllm: error: --errors /dev/full") and "No space left" in last


def test_a_ray_json_column_that_breaks_the_parser_is_a_bad_row():
    """Predictor(json_column=...) reads each row's JSON by the same rules: 5,000 nested lists are the row's error
    (were a RecursionError that ended the actor's batch), as is a cell that is not text."""
    from types import SimpleNamespace

    from npllm.batch import BadRequest
    from npllm.ray import Predictor

    host = SimpleNamespace(json_column="body")
    for cell, says in (("[" * 5000, "nested too deeply"), ("{", "not JSON"), (None, "not JSON text")):
        got = Predictor._body(host, {"body": cell})
        assert isinstance(got, BadRequest) and says in str(got), got
    assert Predictor._body(host, {"body": '{"prompt": "Once"}'}) == {"prompt": "Once"}


def test_a_line_asking_for_several_choices_or_an_unserved_field_is_an_error_line(tmp_path, capsys):
    """A result line holds one text: n > 1 is refused per line (give n lines), as is a field that would change the
    answer and is not served; the engine's fields other servers name (top_k, stop_token_ids...) are taken."""
    write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Once", "max_tokens": 5, "temperature": 0, "n": 2},
        {"id": 2, "prompt": "Once", "max_tokens": 5, "guided_regex": "a+"},
        {"id": 3, "prompt": "Once", "max_tokens": 5, "temperature": 1, "top_k": 1, "ignore_eos": True},
    ])
    status, _, err = npllm(capsys, "batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert status == 0 and "2 bad lines" in err
    errors = {e["id"]: e["error"] for e in read_jsonl(tmp_path / "out.errors.jsonl")}
    assert "n must be 1" in errors[1] and "guided_regex" in errors[2]
    [result] = read_jsonl(tmp_path / "out.jsonl")
    assert result["id"] == 3 and result["usage"]["completion_tokens"] == 5
