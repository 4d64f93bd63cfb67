"""Issue 41's first-use items: the suite on a fresh clone, `npllm --version`, `npllm bench`'s honesty about what it
measured, and the error for a text file given as --model."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from npllm.cli import main
from tests_support import REPO, require, weights_with_embedded

EMBEDDED = REPO / "npllm" / "data" / "stories260K"


# ---- 13: a fresh clone runs the stories260K tests from the package's own copy ------------------------------------


def test_require_falls_back_to_the_embedded_copy_and_only_for_embedded_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "empty"))
    for name in ("stories260K.bin", "tok512.bin", "tok512.model"):
        try:
            assert require(f"stories260K/{name}") == EMBEDDED / name
        except pytest.skip.Exception:
            pytest.fail(f"stories260K/{name} ships inside the package, yet require() skipped")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="greedy_200.txt"):
        require("stories260K/greedy_200.txt")  # not shipped: skipped ...
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require("stories260K/greedy_200.txt")  # ... and under CI a failure, as before
    assert require("stories260K/tok512.bin") == EMBEDDED / "tok512.bin"  # embedded: found under CI too


def test_the_weights_folder_fixture_is_completed_by_the_embedded_files(tmp_path):
    root = tmp_path / "root"
    (root / "stories260K").mkdir(parents=True)
    (root / "stories260K" / "greedy_200.txt").write_text("story")
    (root / "llama2-tokenizer").mkdir()
    merged = weights_with_embedded(root, tmp_path / "merged")
    assert (merged / "stories260K" / "greedy_200.txt").read_text() == "story"
    assert (merged / "stories260K" / "tok512.model").read_bytes() == (EMBEDDED / "tok512.model").read_bytes()
    assert (merged / "llama2-tokenizer").is_dir()
    fresh = weights_with_embedded(tmp_path / "absent", tmp_path / "fresh")  # a clone without weights/
    assert sorted(p.name for p in (fresh / "stories260K").iterdir()) == ["stories260K.bin", "tok512.bin",
                                                                         "tok512.model"]
    complete = weights_with_embedded(fresh, tmp_path / "unused")
    assert complete == fresh and not (tmp_path / "unused").exists()


def test_a_fresh_clone_runs_the_stories260k_tests(tmp_path):
    """With no reference weights at all, a test that needs stories260K's files runs instead of skipping."""
    env = {k: v for k, v in os.environ.items() if k not in ("NPLLM_WEIGHTS", "CI")}
    env["NPLLM_WEIGHTS"] = str(tmp_path / "no-weights")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                          "tests/test_tokenizer.py::test_truncated_model", "tests/test_bad_files.py::"
                          "test_sentencepiece_pieces_not_utf8_or_scores_not_finite_are_refused_at_load"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


# ---- 12: npllm --version -------------------------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"npllm {version('npllm-engine')}\n"


# ---- 15: npllm bench says what it measured; generate's timing line without a rate ------------------------------


BENCH = ["bench", "--batch", "1", "--prompt-len", "8", "--gen-len", "2", "--repeat", "1", "--bandwidth-mib", "8"]


def test_bench_on_a_known_name_not_on_disk_says_it_measured_random_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main([*BENCH, "--model", "stories15M"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("stories15M (random weights") and line.count("\n") == 1


def test_bench_on_a_checkpoint_does_not_claim_random_weights(capsys):
    assert main([*BENCH, "--model", "stories260K"]) == 0  # the embedded checkpoint
    assert "random" not in capsys.readouterr().out


def test_bench_prompt_far_past_the_context_is_one_error_line(capsys):
    assert main([*BENCH[:4], "5000", *BENCH[5:], "--model", "stories260K"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("npllm: error: --prompt-len 5000") and "context of 512" in captured.err


@pytest.mark.parametrize("tokens", ["0", "1"])
def test_generate_without_a_rate_to_give_prints_no_nan(tokens, capsys):
    assert main(["generate", "Once", "--max-new-tokens", tokens, "--temperature", "0"]) == 0
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"[npllm] 2 prompt + {tokens} new tokens") and "nan" not in err and "tok/s" not in err


def test_the_timing_line_gives_the_rate_after_the_first_token():
    from npllm.cli import timing_line

    assert timing_line(3, 5, 10.0, 10.5, 12.5) == ("[npllm] 3 prompt + 5 new tokens; first token 500.0 ms; "
                                                   "2.0 tok/s after it")
    assert timing_line(3, 0, 10.0, None, 10.25) == "[npllm] 3 prompt + 0 new tokens in 250.0 ms"


# ---- 16: the docs agree with the code; a text file as --model ----------------------------------------------------


def test_a_text_file_as_model_is_said_to_be_no_checkpoint_not_to_lack_a_tokenizer(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello world, these are my notes\n")
    assert main(["generate", "--model", str(notes)]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer" not in err and "not a llama2.c .bin file (the file begins like text)" in err
    lone = tmp_path / "alone" / "stories260K.bin"  # a real checkpoint with no tokenizer beside it: asked for one
    lone.parent.mkdir()
    lone.write_bytes((EMBEDDED / "stories260K.bin").read_bytes())
    assert main(["generate", "--model", str(lone)]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err


def tracked_text_files():
    listed = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.toml"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.stdout.split()]


def test_install_hints_name_what_works_from_a_clone():
    """npllm is not published: `pip install "npllm-engine[...]"` would fail; the hints say pip install -e."""
    this = Path(__file__).resolve()
    found = [f"{path.relative_to(REPO)}" for path in tracked_text_files() if path.resolve() != this
             and path.exists() and "npllm-engine[" in path.read_text(encoding="utf-8")]
    assert found == []


def test_the_readme_counts_the_notebooks_it_lists():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    words = {"eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
    said = re.search(r"\b(\w+) notebooks, one per stage", readme)
    listed = set(re.findall(r"\(notebooks/(\d\d_\w+)\.ipynb\)", readme))
    assert said and words[said.group(1)] == len(listed) == len(list((REPO / "notebooks").glob("*.ipynb")))


def test_the_weights_readme_agrees_with_where_models_are_looked_up(tmp_path, monkeypatch):
    """The README (and npllm.hub) say: $NPLLM_WEIGHTS, then the user cache; downloads go to the cache."""
    from npllm import hub

    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "w"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert hub.weights_dirs() == [tmp_path / "w", tmp_path / "c" / "npllm"]
    text = " ".join((REPO / "weights" / "README.md").read_text(encoding="utf-8").split())
    assert "`$NPLLM_WEIGHTS/<name>/`, else the user cache" in text and "downloaded into the user cache" in text
    assert "into `weights/<name>/`" not in text and "then in `weights/" not in text
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "NPLLM_HUB_URL" in readme and "NPLLM_HUB_URL" in hub.__doc__
