"""npllm's modules import downward only: the import graph has no cycle, and every import goes from a layer to the same
layer or to one the layer table below allows, so an upward import added later fails here.

The graph is read from the source with `ast`, not from what Python happens to import: every `import` and
`from ... import` statement of a module counts, at module level or inside a function (a deferred import is still a
dependency, and a cycle through one only waits for the call that closes it), `if TYPE_CHECKING:` blocks included.
An edge goes to the module named, or to the package whose attribute is imported (`from .. import load` in cli/shared.py
is an edge to npllm itself); importing a submodule does not count as an import of the package it sits in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "npllm"

# The layers, lowest first, and which lower layers each may import (its own layer always). A module belongs to the
# layer of the longest entry naming it or a package above it; the root package `npllm` (the API's re-exports) is
# named on its own and is nobody's parent here, so a new module that no entry covers fails the test until placed.
LAYERS = {
    "core": ("npllm.errors", "npllm.config", "npllm.hub", "npllm.device", "npllm._sampling_fast", "npllm.testing",
             "npllm.settings", "npllm.versions"),
    "numerics": ("npllm.quant", "npllm.ops", "npllm.tensors", "npllm.sampling", "npllm.constraint", "npllm.cache",
                 "npllm.prefix_cache"),
    "kernels": ("npllm.kernels",),
    "formats": ("npllm.formats",),
    "tokenizer": ("npllm.tokenizer",),
    "models": ("npllm.models",),
    "generation": ("npllm.generate", "npllm.report", "npllm.batching", "npllm.context", "npllm.search",
                   "npllm.speculative", "npllm.explain", "npllm.evaluate", "npllm.stop", "npllm.embed"),
    "chat": ("npllm.chat",),
    "api": ("npllm", "npllm.llm", "npllm.convert", "npllm.bench", "npllm.info"),
    "front ends": ("npllm.chat.repl", "npllm.serve", "npllm.batch", "npllm.ray"),
    "cli": ("npllm.cli", "npllm.__main__"),
}
MAY_IMPORT = {
    "core": (),
    "numerics": ("core",),
    "kernels": ("core", "numerics"),
    "formats": ("core", "numerics"),  # never the tokenizer, never the models
    "tokenizer": ("core", "formats"),  # a GGUF file's embedded vocabulary
    "models": ("core", "numerics", "kernels"),  # never the formats: canonical weights come from npllm.tensors
    "generation": ("core", "numerics"),  # a model is passed in
    "chat": ("core", "numerics", "formats", "tokenizer", "generation"),
    "api": ("core", "numerics", "kernels", "formats", "tokenizer", "models", "generation", "chat"),
    "front ends": ("core", "numerics", "generation", "chat", "api"),  # beside the CLI, never under it
    "cli": ("core", "numerics", "kernels", "formats", "tokenizer", "models", "generation", "chat", "api",
            "front ends"),
}


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (source file, is a package) of every module under `package`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _known(name: str, known) -> str | None:
    """The longest prefix of dotted `name` that is a known module (an attribute's module), or None."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, source: str, is_package: bool, known) -> set[str]:
    """The known modules a module's source imports, anywhere in it."""
    here = name if is_package else name.rpartition(".")[0]  # what `from .` means in this module
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (base + ("." + node.module if node.module else "")) if node.level else node.module
            for alias in node.names:  # `from pkg import sub` imports the submodule sub, else an attribute of pkg
                full = f"{target}.{alias.name}"
                found.add(full if full in known else _known(target, known))
    return {m for m in found if m is not None and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the npllm modules it imports."""
    known = modules(package)
    return {name: imports_of(name, path.read_text(encoding="utf-8"), is_package, known)
            for name, (path, is_package) in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def layer_of(module: str) -> str | None:
    """The layer of the longest LAYERS entry that is `module` or a package above it (the root only as itself)."""
    best, layer = "", None
    for name, entries in LAYERS.items():
        for entry in entries:
            covers = module == entry or (entry != "npllm" and module.startswith(entry + "."))
            if covers and len(entry) > len(best):
                best, layer = entry, name
    return layer


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import the layer table does not allow, as 'a (layer) -> b (layer)'."""
    bad = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = layer_of(source), layer_of(target)
            if a != b and b not in MAY_IMPORT[a]:
                bad.append(f"{source} ({a}) -> {target} ({b})")
    return bad


def test_the_layer_table_is_an_order():
    """Each layer may import only layers listed before it: the table itself has no way back up."""
    order = list(LAYERS)
    assert list(MAY_IMPORT) == order
    for position, layer in enumerate(order):
        assert set(MAY_IMPORT[layer]) <= set(order[:position]), layer


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    assert upward(import_graph()) == []


def test_the_graph_sees_deferred_relative_and_attribute_imports():
    """The graph is what the checks above rely on: a function-level import, a relative one from a package and one
    of a package's attribute are all edges (cli/shared.py's `from .. import load` is an edge to npllm itself)."""
    graph = import_graph()
    assert "npllm" in graph["npllm.cli.shared"]  # from .. import load, inside a function
    assert "npllm.formats.hf" in graph["npllm.formats"]  # from .hf import read_hf, inside read_checkpoint
    assert "npllm.tokenizer.base" in graph["npllm.tokenizer"]  # a package's relative import


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from ..cli import main\n", {"pkg.cli"}),
    ("from . import sub\n", {"pkg.sub.sub"}),
    ("from .sub import thing\n", {"pkg.sub.sub"}),
    ("from .. import sub, thing\n", {"pkg.sub", "pkg"}),
    ("import pkg.cli as c\n", {"pkg.cli"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import cli\n", {"pkg.cli"}),
])
def test_each_kind_of_import_is_an_edge(source, expected):
    known = {"pkg", "pkg.cli", "pkg.sub", "pkg.sub.sub", "pkg.sub.mod"}
    assert imports_of("pkg.sub.mod", source, False, known) == expected


def test_a_cycle_and_an_upward_import_are_caught():
    """The checks can fail: a cycle through three modules is one component, and an import of the CLI from the
    formats, or of the formats from the models, is reported."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert upward({"npllm.formats.gguf": {"npllm.cli", "npllm.quant"}, "npllm.models.numba": {"npllm.formats"}}) == [
        "npllm.formats.gguf (formats) -> npllm.cli (cli)",
        "npllm.models.numba (models) -> npllm.formats (formats)",
    ]
