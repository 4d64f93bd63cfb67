"""Write notebooks/*.ipynb from their Python sources in notebooks/src/ and execute them, keeping the outputs.

    python scripts/build_notebooks.py              # every notebook
    python scripts/build_notebooks.py 03 05        # the notebooks whose names start with 03 or 05
    python scripts/build_notebooks.py --no-execute # write the cells only (no outputs)

A source is a plain Python file in the "percent" layout, so a review reads it as code:

    # %% [markdown]
    # # A title
    # Text in Markdown, each line behind "# ".

    # %%
    code = "a code cell"

The notebooks run in notebooks/ with this checkout of npllm first on the path. They need nothing but npllm: the
stories260K they read ships inside the package. A few cells also use reference files that do not (the Llama 2
tokenizer, llama2.c's greedy_200.txt): they read them from $NPLLM_WEIGHTS (else ../weights relative to the
notebook) where present, and otherwise print where to get them and leave that part out. Build with them at hand
(NPLLM_WEIGHTS=/path/to/weights) so that the committed outputs show every part. Needs the `notebooks` extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
SOURCES = NOTEBOOKS / "src"
CELL_TIMEOUT_S = 120  # one cell; a whole notebook is meant to take well under a minute
CELL_MARK = "# %%"


def sources(prefixes: list[str] | None = None) -> list[Path]:
    """The notebook sources, in order; with prefixes, only those whose names start with one of them."""
    found = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if prefixes:
        found = [p for p in found if any(p.name.startswith(x) for x in prefixes)]
    return found


def target(source: Path) -> Path:
    return NOTEBOOKS / (source.stem + ".ipynb")


def split_cells(text: str) -> list[tuple[str, str]]:
    """Percent-layout text -> [(kind, text)] with kind "markdown" or "code"; blank lines around cells dropped."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(CELL_MARK):
            kind = "markdown" if "[markdown]" in line[len(CELL_MARK):] else "code"
            cells.append((kind, []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"text before the first '{CELL_MARK}' line: {line!r}")
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [markdown_line(l) for l in lines]
        body = "\n".join(lines).strip("\n")
        if body:
            out.append((kind, body))
    return out


def markdown_line(line: str) -> str:
    """'# text' -> 'text', '#' -> '' (a Markdown cell is written as comments in the source)."""
    if line.startswith("# "):
        return line[2:]
    if line.rstrip() == "#" or not line.strip():
        return ""
    raise ValueError(f"a Markdown line must start with '# ': {line!r}")


def notebook_from_source(source: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for kind, body in split_cells(source.read_text(encoding="utf-8")):
        nb.cells.append(nbformat.v4.new_markdown_cell(body) if kind == "markdown" else nbformat.v4.new_code_cell(body))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    # Cell ids are random by default; number them so that regenerating a notebook changes only its outputs.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def kernel_environment() -> dict[str, str]:
    """The notebooks import this checkout's npllm even where another copy is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The notebooks run small models: one BLAS thread is faster for them and keeps their run time steady on a busy
    # 2-core machine, where spinning BLAS threads can make a 128-token forward 30x slower.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def execute(nb: nbformat.NotebookNode, timeout: int = CELL_TIMEOUT_S, cwd: Path = NOTEBOOKS) -> nbformat.NotebookNode:
    """Run every cell in cwd (notebooks/, the notebooks' working directory, unless a test runs them elsewhere);
    raises CellExecutionError on a failing cell."""
    from nbclient import NotebookClient

    saved = dict(os.environ)
    os.environ.update(kernel_environment())  # the kernel process inherits this environment
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(cwd)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="name prefixes of the notebooks to build (default: all)")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    args = parser.parse_args(argv)
    chosen = sources(args.only)
    if not chosen:
        print(f"no notebook source in {SOURCES} matches {args.only}", file=sys.stderr)
        return 2
    for source in chosen:
        nb = notebook_from_source(source)
        start = time.perf_counter()
        if not args.no_execute:
            execute(nb)
        nbformat.validate(nb)
        nbformat.write(nb, target(source))
        took = "" if args.no_execute else f" (ran in {time.perf_counter() - start:.1f} s)"
        print(f"wrote {target(source).relative_to(REPO)}{took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
