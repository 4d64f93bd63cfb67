"""Issue 41's first-use items: the suite on a fresh clone, `npllm --version`, `npllm bench`'s honesty about what it
measured, and the error for a text file given as --model."""

import os
import subprocess
import sys

import pytest

from npllm.cli import main
from tests_support import REPO, require, weights_with_embedded

EMBEDDED = REPO / "npllm" / "data" / "stories260K"


# ---- 13: a fresh clone runs the stories260K tests from the package's own copy ------------------------------------


def test_require_falls_back_to_the_embedded_copy_and_only_for_embedded_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "empty"))
    for name in ("stories260K.bin", "tok512.bin", "tok512.model"):
        assert require(f"stories260K/{name}") == EMBEDDED / name
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
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "tests/test_tokenizer.py::test_truncated_model", "tests/test_bad_files.py::"
                          "test_sentencepiece_pieces_not_utf8_or_scores_not_finite_are_refused_at_load"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
