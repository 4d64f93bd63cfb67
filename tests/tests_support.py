"""Helpers shared by test modules (imported by name: pytest puts tests/ on sys.path)."""

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def weights_root() -> Path:
    """Where reference weights are: $NPLLM_WEIGHTS, else the repo's weights/ folder."""
    return Path(os.environ["NPLLM_WEIGHTS"]) if os.environ.get("NPLLM_WEIGHTS") else REPO / "weights"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(relative: str) -> Path:
    """The reference file at weights_root()/relative; absent, the test skips (fails under CI)."""
    path = weights_root() / relative
    if not path.exists():
        message = f"reference file {path} is absent (set NPLLM_WEIGHTS or fill weights/)"
        if under_ci():
            pytest.fail(message + " and CI=true: a CI run needs every reference file", pytrace=False)
        pytest.skip(message)
    return path


def mapping_resident_kb(path) -> int:
    """Resident kB of this process's mappings of the file `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0] and ":" not in line.split()[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped, does not). Linux's /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pid: int, seconds: float) -> bool:
    """Whether process `pid` has ended within `seconds`."""
    deadline = time.monotonic() + seconds
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid)


def template_worker_of(parent: int, seconds: float) -> int:
    """The pid of process `parent`'s chat template worker (npllm/chat/worker.py), once it runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and b"sandbox.py" in command:
                return int(entry)
        time.sleep(0.1)
    raise AssertionError(f"process {parent} started no chat template worker within {seconds} s")
