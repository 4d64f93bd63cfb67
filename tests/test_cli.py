"""The command line: `npllm info`, and errors printed as one clear line with a non-zero exit."""

import subprocess
import sys

from tests_support import REPO


def npllm(*args):
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_info_describes_stories260k(stories260k):
    result = npllm("info", str(stories260k))
    assert result.returncode == 0, result.stderr
    assert "5 layers, dim 64" in result.stdout and "260,032" in result.stdout and "tok512.bin" in result.stdout


def test_errors_are_one_line_not_a_traceback(stories260k, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x00\x00\x00" * 3)
    for args in (["info", str(bad)], ["generate", "--model", str(tmp_path / "absent.bin")],
                 ["generate", "hi", "--model", str(stories260k), "--temperature", "-1"],
                 ["generate", "hi", "--model", str(stories260k), "--top-p", "1.5"]):
        result = npllm(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("npllm: error:") and "Traceback" not in result.stderr, result.stderr
