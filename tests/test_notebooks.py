"""The notebooks in notebooks/ run top to bottom without an error, and match their sources in notebooks/src/.

Each notebook checks its own numbers with asserts (the seed tables, npllm's functions against each other), so a
notebook that runs is a notebook whose figures and numbers still hold. They run as on a fresh clone, with nothing
but the package (no weights folder: the stories260K it embeds), and the notebooks that also read reference files
the package lacks run once more with them. Needs the `notebooks` extra (nbclient, nbformat, ipykernel,
matplotlib); skipped, saying which, without it.
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
# The reference files beyond the package some notebooks read where they are at hand, relative to the weights folder,
# and the start of the note each prints without them (which goes on to say where to get them).
OPTIONAL = {
    "01_tokenization": (["llama2-tokenizer/tokenizer.model", "llama2-tokenizer/tokenizer.bin"],
                        "Llama 2's tokenizer is not here"),
    "06_generation_kv_cache": (["stories260K/greedy_200.txt"], "greedy_200.txt not found"),
}


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


def run_notebook(source, cwd):
    nb = nbformat.read(build.target(source), as_version=4)
    build.execute(nb, cwd=cwd)  # raises CellExecutionError, with the failing cell and its traceback, if any cell fails
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes_with_nothing_but_the_package(source, tmp_path, monkeypatch):
    """As on a fresh clone: no weights folder ($NPLLM_WEIGHTS empty, no ../weights beside the working directory, an
    empty download cache). A reference file the package lacks is named, with how to get it, in the output."""
    monkeypatch.setenv("NPLLM_WEIGHTS", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "notebooks").mkdir()
    printed = run_notebook(source, cwd=tmp_path / "notebooks")
    if source.stem in OPTIONAL:
        assert OPTIONAL[source.stem][1] in printed  # the note that says what is left out and where to get it


@pytest.mark.parametrize("source", [s for s in SOURCES if s.stem in OPTIONAL], ids=lambda p: p.stem)
def test_notebook_executes_with_its_reference_files(source, weights_dir, monkeypatch):
    for name in OPTIONAL[source.stem][0]:
        require(name)  # skips (fails under CI) naming the first absent reference file
    monkeypatch.setenv("NPLLM_WEIGHTS", str(weights_dir))
    printed = run_notebook(source, cwd=build.NOTEBOOKS)
    assert OPTIONAL[source.stem][1] not in printed  # every part ran
