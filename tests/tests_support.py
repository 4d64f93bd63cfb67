"""Helpers shared by test modules (imported by name: pytest puts tests/ on sys.path)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "npllm" / "data"  # reference files the package itself ships (stories260K)


def weights_root() -> Path:
    """Where reference weights are: $NPLLM_WEIGHTS, else the repo's weights/ folder."""
    return Path(os.environ["NPLLM_WEIGHTS"]) if os.environ.get("NPLLM_WEIGHTS") else REPO / "weights"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def embedded_copy(relative: str) -> Path | None:
    """The copy of a reference file that ships inside the package (npllm/data: stories260K's checkpoint and
    tokenizers), or None."""
    path = EMBEDDED / relative
    return path if path.is_file() else None


def weights_with_embedded(root: Path, scratch: Path) -> Path:
    """A weights folder that holds root's files and, where root lacks them, the package's embedded copies: root
    itself when it lacks none, else `scratch` filled with links to both (a fresh clone has no weights/ at all)."""
    shipped = [f.relative_to(EMBEDDED) for f in sorted(EMBEDDED.rglob("*")) if f.is_file() and f.name != "NOTICE"]
    if all((root / f).exists() for f in shipped):
        return root
    scratch.mkdir(parents=True, exist_ok=True)
    merged = {f.parts[0] for f in shipped}  # folders (stories260K) made here, their entries linked one by one
    for folder in (root / name for name in merged):
        (scratch / folder.name).mkdir()
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            (scratch / folder.name / entry.name).symlink_to(entry)
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name not in merged:
            (scratch / entry.name).symlink_to(entry)
    for relative in shipped:
        if not (scratch / relative).exists():
            (scratch / relative).symlink_to(EMBEDDED / relative)
    return scratch


def require(relative: str) -> Path:
    """The reference file at weights_root()/relative, else the package's embedded copy of it; absent, the test
    skips (fails under CI)."""
    path = weights_root() / relative
    if not path.exists() and embedded_copy(relative) is not None:
        return embedded_copy(relative)
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
