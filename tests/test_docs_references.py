"""What the docs point a reader to exists: every test they cite (`tests/test_x.py`, `test_x.py::test_name`, a bare
`test_name`) is a file in tests/ with that function, and every extra they tell the user to install holds what
they then tell the user to run."""

import re

import pytest

from tests_support import REPO

DOCS = sorted([REPO / "README.md", REPO / "scripts" / "README.md", *(REPO / "docs").glob("*.md")])
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# tests/test_x.py, test_x.py, either with ::test_name (or ::Class::test_name); parametrized ids ([...]) dropped
FILE_REFERENCE = re.compile(r"(?<![\w/.-])(?:tests/)?(test_\w+\.py)((?:::\w+)*)")
# a bare test function named in inline code: `test_name` (outside fenced blocks, where examples define their own)
NAME_REFERENCE = re.compile(r"`(test_\w+)(?:\[[^`\]]*\])?`")


def references(text: str) -> list[tuple[str, str | None]]:
    """(file or None, function or None) for each test reference in a Markdown text."""
    found = [(m[1], (m[2].rsplit("::", 1)[-1] or None)) for m in FILE_REFERENCE.finditer(text)]
    found += [(None, m[1]) for m in NAME_REFERENCE.finditer(FENCE.sub("", text))]
    return found


def defined_tests(path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M))


TEST_FILES = {p.name: defined_tests(p) for p in sorted((REPO / "tests").glob("test_*.py"))}
EVERY_TEST = set().union(*TEST_FILES.values())


def test_the_reference_finder_sees_each_form():
    text = ("see tests/test_a.py, `test_b.py::test_c`, tests/test_d.py::Klass::test_e and `test_f[x-1]`.\n"
            "```python\ndef test_mine():\n    `test_g`\n```\n")
    assert references(text) == [("test_a.py", None), ("test_b.py", "test_c"), ("test_d.py", "test_e"),
                                (None, "test_f")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_the_docs_cite_exists(doc):
    missing = []
    for file, function in references(doc.read_text(encoding="utf-8")):
        if file is not None and file not in TEST_FILES:
            missing.append(f"tests/{file}")
        elif function is not None and function not in (TEST_FILES[file] if file else EVERY_TEST):
            missing.append(f"{f'tests/{file}::' if file else ''}{function}")
    assert not missing, f"{doc.relative_to(REPO)} cites tests that do not exist: {sorted(set(missing))}"


# ---- the notebooks extra holds what docs/notebooks.md tells the user to run after installing it -----------------

# A command docs/notebooks.md shows -> the distributions it needs.
NOTEBOOK_COMMANDS = {
    "jupyter lab": ["jupyterlab"],
    "scripts/build_notebooks.py": ["nbformat", "nbclient", "ipykernel", "matplotlib"],
}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() for r in requirements}


def test_the_notebooks_extra_holds_what_docs_notebooks_md_runs():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    doc = (REPO / "docs" / "notebooks.md").read_text(encoding="utf-8").split("\n## ")[0]  # the notebooks' section
    commands = [line.split("#")[0].strip() for block in re.findall(r"^```bash\n(.*?)^```", doc, re.S | re.M)
                for line in block.splitlines() if line.strip()]
    assert 'pip install -e ".[notebooks]"' in commands
    shown = [c for c in commands if not c.startswith("pip install")]
    assert shown
    for command in shown:
        needs = [n for key, names in NOTEBOOK_COMMANDS.items() if key in command for n in names]
        assert needs, f"docs/notebooks.md runs {command!r}: say in NOTEBOOK_COMMANDS what it needs"
        absent = set(needs) - requirement_names(extras["notebooks"])
        assert not absent, f"docs/notebooks.md runs {command!r} after installing [notebooks], which lacks {absent}"
    assert "jupyterlab" not in requirement_names(extras["test"])  # CI installs `test`: no JupyterLab there
