"""The notebooks in notebooks/ run top to bottom without an error, and match their sources in notebooks/src/.

Each notebook checks its own numbers with asserts (the seed tables, npllm's functions against each other), so a
notebook that runs is a notebook whose figures and numbers still hold. Needs the `notebooks` extra (nbclient,
nbformat, ipykernel, matplotlib) and the reference weights; skipped, saying which, without them.
"""

import importlib.util
import os

import pytest

from tests_support import REPO, require

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed (pip install -e '.[notebooks]')")
pytest.importorskip("nbclient", reason="the notebooks extra is not installed (pip install -e '.[notebooks]')")
pytest.importorskip("ipykernel", reason="the notebooks extra is not installed (pip install -e '.[notebooks]')")
pytest.importorskip("matplotlib", reason="the notebooks extra is not installed (pip install -e '.[notebooks]')")


def load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", REPO / "scripts" / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_builder()
SOURCES = build.sources()
# What the notebooks read, relative to the weights folder.
NEEDED = ["stories260K/stories260K.bin", "stories260K/tok512.bin", "stories260K/tok512.model",
          "stories260K/greedy_200.txt", "llama2-tokenizer/tokenizer.model", "llama2-tokenizer/tokenizer.bin"]


def test_every_notebook_has_a_source_and_a_committed_notebook():
    assert [s.stem for s in SOURCES] == sorted(p.stem for p in build.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert len(SOURCES) >= 1


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_committed_notebook_matches_its_source(source):
    """Editing a source without regenerating (python scripts/build_notebooks.py) fails here."""
    committed = nbformat.read(build.target(source), as_version=4)
    fresh = build.notebook_from_source(source)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in fresh.cells]
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "the committed notebook was written without its outputs"
    assert any(o.get("data", {}).get("image/png") for c in code for o in c.outputs), "no figure in the outputs"
    assert not any(o.output_type == "error" for c in code for o in c.outputs)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes(source, weights_dir, monkeypatch):
    for name in NEEDED:
        require(name)  # skips (fails under CI) naming the first absent reference file
    monkeypatch.setenv("NPLLM_WEIGHTS", str(weights_dir))
    nb = nbformat.read(build.target(source), as_version=4)
    build.execute(nb)  # raises CellExecutionError, with the failing cell and its traceback, if any cell fails
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
