"""The package's shape, held: no module over 1,000 lines, no function outside npllm/kernels over 50 lines, none
anywhere over 12 parameters except the CUDA kernels and device functions of npllm/kernels/cuda.py (@cuda.jit:
numba.cuda's launch takes arguments one by one, and a device function's are what it shares with its kernel).

Read with `ast` from the source files, so a new offender fails here by name. The ALLOWED lists are today's
offenders outside the forward pass, each to be fixed where its own work happens (the split of quant.py and
kernels/quant.py, SamplingParams end to end, ...): an entry that no longer offends fails too, so the lists only
shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "npllm"
MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 50  # outside npllm/kernels, whose compiled kernels are unrolled by hand
MAX_PARAMETERS = 12

# (module, lines) over MAX_MODULE_LINES
ALLOWED_MODULES: set = set()
# (module, function) over MAX_FUNCTION_LINES
ALLOWED_LONG: set = set()
# (module, function) over MAX_PARAMETERS
ALLOWED_PARAMETERS: set = set()


def modules():
    """(path relative to the repository, source text, syntax tree) of every module of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        yield path.relative_to(PACKAGE.parent).as_posix(), text, ast.parse(text)


def functions(tree):
    """Every function and method of a module, nested ones included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def parameters(f) -> int:
    a = f.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def lines(f) -> int:
    """Lines from the def to the end of the body (decorators not counted)."""
    return f.end_lineno - f.lineno + 1


def cuda_jit(f) -> bool:
    """Whether f is decorated @cuda.jit or @cuda.jit(...)."""
    for decorator in f.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", None) == "cuda":
            return True
    return False


def offenders():
    """{"modules": {path}, "long": {(path, name)}, "parameters": {(path, name)}} as the package stands."""
    found = {"modules": set(), "long": set(), "parameters": set()}
    for path, text, tree in modules():
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found["modules"].add(path)
        for f in functions(tree):
            if not path.startswith("npllm/kernels/") and lines(f) > MAX_FUNCTION_LINES:
                found["long"].add((path, f.name))
            if parameters(f) > MAX_PARAMETERS and not (path == "npllm/kernels/cuda.py" and cuda_jit(f)):
                found["parameters"].add((path, f.name))
    return found


def check(found: set, allowed: set, what: str) -> None:
    new, fixed = sorted(found - allowed), sorted(allowed - found)
    assert not new, f"{what}: {new} (split them up, or group arguments in records)"
    assert not fixed, f"{what}: {fixed} no longer offend: take them off the allow-list in tests/test_code_shape.py"


def test_no_module_over_1000_lines():
    check(offenders()["modules"], ALLOWED_MODULES, f"modules over {MAX_MODULE_LINES} lines")


def test_no_function_outside_the_kernels_over_50_lines():
    check(offenders()["long"], ALLOWED_LONG, f"functions over {MAX_FUNCTION_LINES} lines")


def test_no_function_over_12_parameters_but_the_cuda_kernels():
    check(offenders()["parameters"], ALLOWED_PARAMETERS, f"functions over {MAX_PARAMETERS} parameters")


def test_the_checks_see_what_they_measure():
    """The measures on known functions: a CUDA kernel is told apart, nested functions are seen, a method's self
    counts, lines run from def to the end of the body."""
    tree = ast.parse("@cuda.jit(max_registers=128)\ndef k(a, b, *c, d, **e):\n    pass\n\n"
                     "class C:\n    def m(self, x):\n        def inner(y):\n            return y\n"
                     "        return inner(x)\n")
    found = {f.name: f for f in functions(tree)}
    assert set(found) == {"k", "m", "inner"}
    assert (parameters(found["k"]), parameters(found["m"]), parameters(found["inner"])) == (5, 2, 1)
    assert cuda_jit(found["k"]) and not cuda_jit(found["m"])
    assert (lines(found["k"]), lines(found["m"])) == (2, 4)


def test_one_layer_loop_per_backend():
    """One forward pass per backend: the reference's Transformer.forward, Numba's _forward (float32 panels and
    weights in their file types alike), and for CUDA one kernel body that walks the layers (_forward_kernel's
    schedule of steps), which both ways of running it launch: models/cuda.py loops over layers only to upload them
    (its step-by-step fallback loops over the kernel's steps, not over layers of its own)."""
    sources = {path: tree for path, _, tree in modules()}
    numba_forwards = [f.name for f in functions(sources["npllm/models/numba.py"]) if "forward" in f.name]
    assert sorted(numba_forwards) == ["_forward", "forward"], numba_forwards
    cuda_kernels = [f for f in functions(sources["npllm/kernels/cuda.py"]) if f.name == "kernel" and
                    any(isinstance(node, ast.Name) and node.id == "layer" for node in ast.walk(f))]
    assert len(cuda_kernels) == 1, [f.lineno for f in cuda_kernels]
    model_loops = [(f.name, ast.unparse(node.target)) for f in functions(sources["npllm/models/cuda.py"])
                   for node in ast.walk(f) if isinstance(node, ast.For) and "layer" in ast.unparse(node)]
    assert {name for name, _ in model_loops} == {"_upload", "stacked"}, model_loops  # stacked: _upload's helper
