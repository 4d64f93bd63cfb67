"""The compiler's pages and LLVM's modules for linking leave the process once a model's code is loaded
(kernels/compiler.py), and make_model loads that code before the weights (models/numba.py: link_ahead) for exactly
the types the model's calls then use.

Each check that needs a fresh process (what is compiled, what is resident) runs in a child: this test process has
compiled and loaded much already.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numba
import numpy as np
import pytest

from npllm.kernels import compiler
from npllm.kernels.compiler import compiler_mappings

needs_proc = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="resident pages are read from /proc")

SMAPS = """\
7f0000000000-7f0000365000 r--p 00000000 fe:00 11 /venv/llvmlite/binding/libllvmlite.so
Size:               3476 kB
Rss:                1200 kB
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000365000-7f0005394000 r-xp 00365000 fe:00 11 /venv/llvmlite/binding/libllvmlite.so
Rss:               44000 kB
Anonymous:             0 kB
7f0005394000-7f0009677000 r--p 05394000 fe:00 11 /venv/llvmlite/binding/libllvmlite.so
Rss:                9000 kB
Anonymous:           700 kB
7f0009677000-7f000983c000 rw-p 09677000 fe:00 11 /venv/llvmlite/binding/libllvmlite.so
Rss:                1800 kB
Anonymous:             0 kB
7f000a000000-7f000a100000 r-xp 00000000 fe:00 12 /usr/lib/libLLVM-14.so
Anonymous:             0 kB
7f000b000000-7f000b100000 r-xp 00000000 fe:00 13 /venv/numpy/core/_multiarray_umath.so
Anonymous:             0 kB
7f000c000000-7f000c100000 rw-p 00000000 00:00 0
Anonymous:          1024 kB
"""


def test_only_read_only_compiler_mappings_holding_the_files_own_bytes_are_dropped():
    """A mapping with copied-on-write pages (relocated data: Anonymous > 0) or that may be written would lose its
    contents to MADV_DONTNEED; other libraries' code is not the compiler's."""
    assert compiler_mappings(SMAPS) == [(0x7f0000000000, 0x365000), (0x7f0000365000, 0x502f000),
                                        (0x7f000a000000, 0x100000)]


RELEASE = r"""
import json, sys
from pathlib import Path
import numba
from npllm.kernels.compiler import LIBRARIES, release_compiler_pages
sys.path.insert(0, sys.argv[1])
from tests_support import mapping_resident_kb

def compiler_resident_kb():
    maps = (line.split() for line in Path("/proc/self/maps").read_text().splitlines())
    libraries = {f[5] for f in maps if len(f) >= 6 and Path(f[5]).name.startswith(LIBRARIES)}
    return sum(mapping_resident_kb(path) for path in libraries)

@numba.njit(cache=False)
def square(x):
    return x * x

square(3.0)
before = compiler_resident_kb()
advised = release_compiler_pages()
after = compiler_resident_kb()

@numba.njit(cache=False)
def cube(x):
    return x * x * x

print(json.dumps({"before": before, "after": after, "advised": advised, "cube": cube(3.0), "square": square(4.0)}))
"""


@needs_proc
def test_releasing_the_compilers_pages_leaves_most_of_them_out_and_compiling_still_works():
    out = json.loads(subprocess.run([sys.executable, "-c", RELEASE, str(Path(__file__).parent)], capture_output=True,
                                    text=True, check=True).stdout.splitlines()[-1])
    assert out["advised"] > 0
    assert out["before"] > 20_000, out  # kB: a compile leaves tens of MB of LLVM resident
    assert out["after"] < 0.5 * out["before"], out
    assert (out["square"], out["cube"]) == (16.0, 27.0)  # the pages come back when LLVM runs again


CALLEE = """\
import numba

@numba.njit(cache=True)
def double(x):
    return 2.0 * x

@numba.njit(cache=True)
def first_caller(x):
    return double(x) + 1.0

@numba.njit(cache=True)
def second_caller(x):
    return double(x) + 2.0
"""

LINKING = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import callee
from npllm.kernels.compiler import release_linking_modules

out = {}
if sys.argv[2] != "callers alone":
    callee.double(1.0)
    out["released"] = release_linking_modules("callee")
    (result,) = callee.double.overloads.values()
    out["kept"] = type(result.library._shared_module).__name__
caller = callee.first_caller if sys.argv[2] == "compile one" else callee.second_caller
out["caller"] = caller(3.0)  # compiled now: double's code is linked in from the bitcode kept in place of its module
if sys.argv[2] == "callers alone":  # from the cache, double never compiled nor loaded: its code must be inside
    out["caller"] = [callee.first_caller(3.0), callee.second_caller(3.0), len(callee.double.overloads)]
print(json.dumps(out))
"""


def test_a_released_linking_module_still_links_into_a_later_compile(tmp_path):
    """A function compiled after double's module for linking was replaced by its bitcode still links double's code
    in, whether double was just compiled or came from Numba's cache: each caller, loaded from the cache in a
    process where double never ran, works on its own."""
    (tmp_path / "callee.py").write_text(CALLEE)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    outs = [json.loads(subprocess.run([sys.executable, "-c", LINKING, str(tmp_path), step], capture_output=True,
                                      text=True, check=True, env=env).stdout.splitlines()[-1])
            for step in ("compile one", "compile the other", "callers alone")]
    assert outs[0] == {"released": 1, "kept": "LinkingBitcode", "caller": 7.0}, outs
    assert outs[1] == {"released": 1, "kept": "LinkingBitcode", "caller": 8.0}, outs
    assert outs[2] == {"caller": [7.0, 8.0, 0]}, outs


def test_only_cpu_code_libraries_are_released(monkeypatch):
    """The release walks every Numba dispatcher of a package's modules; a CUDA kernel's dispatcher is one too, but
    its overloads are kernels without a CPU code library: they are passed over, not an AttributeError at load."""
    module = types.ModuleType("npllm_fake_kernels")

    @numba.njit(cache=False)
    def cpu_function(x):
        return x + 1

    @numba.njit(cache=False)
    def kernel_like(x):
        return x

    cpu_function(1)
    module.cpu_function, module.kernel_like = cpu_function, kernel_like
    monkeypatch.setitem(sys.modules, module.__name__, module)
    kernel_like.overloads[(numba.types.float32,)] = types.SimpleNamespace(regs_per_thread=32)  # a kernel: no .library
    try:
        assert list(compiler._libraries(module.__name__)) == [cpu_function.overloads[(numba.types.int64,)].library]
        compiler.release_linking_modules(module.__name__)
    finally:  # Numba's own clean-up of the dispatcher expects real overloads
        kernel_like.overloads.clear()


LINKED = r"""
import json, sys
import numpy as np
from llvmlite.binding import ModuleRef
from npllm.formats import read_checkpoint
from npllm.kernels import compiler, cpu
from npllm.models import make_model
from npllm.models import numba as nm
from npllm.quant import QuantizedMatrix, quantize

DISPATCHERS = {"forward": nm._forward, "products": nm.products_into,
               "lm_head": cpu.lm_head, "sample": cpu.sample_rows, "group": nm._group_by_slot}

def compiled():
    return {name: len(d.signatures) for name, d in DISPATCHERS.items()}

def modules_held():  # LLVM modules for linking still parsed in the heap
    return sum(isinstance(lib._shared_module, ModuleRef) and lib._shared_module is not lib._final_module
               for lib in compiler._libraries("npllm"))

def q4_0(w):  # the matrices whose rows are whole blocks (stories260K's FFN width, 172, is not)
    return QuantizedMatrix(quantize(w, "Q4_0").reshape(len(w), -1), "Q4_0", w.shape) if w.shape[-1] % 32 == 0 else w

runs = []
# (a Q4_0 model on a float16 cache would check the same path at the cost of ~90 s more of compiling on a cold cache)
for kv, quantized in ((None, False), (None, True), ("float16", False)):
    config, weights = read_checkpoint(sys.argv[1])
    if quantized:
        weights = {name: q4_0(w) if w.ndim == 2 else w for name, w in weights.items()}
    model = make_model(config, weights, "numba", kv_dtype=kv)
    linked, held = compiled(), modules_held()
    cache = model.new_cache(8, slots=2)
    h = model.forward([1, 5, 9, 1], [0, 1, 2, 0], cache, slots=[0, 0, 0, 1])
    ids = model.sample(h[[2, 3]], temperature=[0.0, 0.8], uniforms=[0.5, 0.5])
    model.lm_head(model.forward(ids, [3, 1], cache, slots=[0, 1]))
    runs.append({"kv": kv, "quantized": quantized, "linked": linked, "after": compiled(), "held": held})
print(json.dumps(runs))
"""


@needs_proc
def test_make_model_loads_exactly_the_code_its_models_calls_then_use(stories260k):
    """link_ahead ran the model's calls on a tiny model before the weights were copied in: a real prefill, batch,
    sampler and LM head of a float32 and a Q4_0 model on a float32 cache, and of the float32 one on a float16 cache,
    compile nothing more (each type a call took that the tiny model's did not would load a second copy of the code
    after the weights); and no module for linking is left parsed in the heap."""
    runs = json.loads(subprocess.run([sys.executable, "-c", LINKED, str(stories260k)],
                                     capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    for run in runs:
        assert run["after"] == run["linked"], run
        assert run["held"] == 0, run
    assert runs[-1]["after"]["forward"] == 2  # float32 and Q4_0 weights (one record) on a float32 cache, on float16


COLD = r"""
import json, sys
from pathlib import Path
from numba.core import event
from npllm.formats import read_checkpoint
from npllm.models import make_model
from npllm.models import numba as nm

with event.install_recorder("numba:compile") as recorder:
    model = make_model(*read_checkpoint(sys.argv[1]), "numba")
status = Path("/proc/self/status").read_text().splitlines()
print(json.dumps({"events": [ev.data["dispatcher"].py_func.__name__ for _, ev in recorder.buffer if ev.is_start],
                  "misses": sum(nm._forward.stats.cache_misses.values()),
                  "hits": sum(nm._forward.stats.cache_hits.values()),
                  "peak_mb": int(next(l for l in status if l.startswith("VmHWM:")).split()[1]) // 1024}))
"""


@needs_proc
def test_a_model_not_in_numbas_cache_is_compiled_by_a_child_and_loaded_here(stories260k, tmp_path):
    """On an empty Numba cache, make_model has a child process compile the model's code into the cache and loads it
    from there: this process compiles nothing (so LLVM's IR of the compile does not stay in it), and raises one
    "numba:compile" event for the child's compile (the CLI's notice)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    out = json.loads(subprocess.run([sys.executable, "-c", COLD, str(stories260k)], capture_output=True, text=True,
                                    check=True, env=env).stdout.splitlines()[-1])
    assert out["events"] == ["_forward"], out
    assert (out["misses"], out["hits"] > 0) == (0, True), out
    assert out["peak_mb"] < 200, out  # 134 here; 287 with the compile in this process


class CacheProbe:
    """A dispatcher stand-in that records whether cached_here read Numba's cache internals (it has none)."""

    touched = False

    @property
    def _cache(self):
        CacheProbe.touched = True
        raise AttributeError("_cache")


def test_outside_the_tested_numba_its_plain_behaviour_stays_with_one_notice(monkeypatch, capsys, stories260k):
    """With a Numba version outside TESTED_NUMBA, nothing reads or patches its internals: no module for linking is
    replaced, no cache index is read, no child compiles (the code is compiled or loaded here, as Numba does); one
    notice on stderr says so however often the check runs; and the model's logits are those of the patched path."""
    from npllm.formats import read_checkpoint
    from npllm.models import make_model
    from npllm.models import numba as nm

    config, weights = read_checkpoint(stories260k)
    ids = [1, 403, 407, 261, 378]
    patched = make_model(config, weights, "numba").logits(ids)
    assert compiler.internals_tested() and capsys.readouterr().err == ""
    CacheProbe.touched = False
    compiler.cached_here(CacheProbe())
    assert CacheProbe.touched  # in the tested range, the probe is read

    def forbidden(*args):
        raise AssertionError("Numba's internals were used outside the tested range")

    monkeypatch.setattr(compiler, "NUMBA_VERSION", "0.70.0")
    monkeypatch.setattr(compiler.NUMBA_FENCE, "noticed", False)
    monkeypatch.setattr(compiler, "LinkingBitcode", forbidden)
    monkeypatch.setattr(nm, "compile_in_child", forbidden)
    monkeypatch.setattr(nm, "_LINKED", set())  # link_ahead runs again, as in a fresh process
    CacheProbe.touched = False
    assert compiler.cached_here(CacheProbe()) is True and not CacheProbe.touched
    assert compiler.release_linking_modules() == 0
    plain = make_model(*read_checkpoint(stories260k), "numba").logits(ids)
    np.testing.assert_array_equal(plain, patched)
    notices = capsys.readouterr().err.splitlines()
    assert notices == [line for line in notices if "numba 0.70.0 is outside" in line] and len(notices) == 1, notices
    monkeypatch.setattr(compiler, "NUMBA_VERSION", "0.58.2")
    assert not compiler.internals_tested() and capsys.readouterr().err == ""  # once a process


STAMPED = r"""
import json, sys
import numpy as np
import npllm
from npllm.kernels import cpu

assert npllm.__file__.startswith(sys.argv[1]), npllm.__file__  # the copy, not the checkout
x, out = np.ones((1, 8), np.float32), np.empty((1, 8), np.float32)
cpu.rms_norm_into(x, np.ones(8, np.float32), 1e-5, out, 1)
stats = cpu.rms_norm_into.stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


def test_a_change_to_any_file_of_the_package_recompiles_its_cached_functions(tmp_path):
    """Numba checks only a cached function's own file; npllm's cache entries follow the whole package (compiler.
    stamp_package_caches), so a function that calls code of a changed file never runs that code's old version. In a
    copy of the package: compiled once, loaded from the cache by the next process, compiled again after a comment is
    added to another file (cli/__init__.py), loaded again after that."""
    import shutil

    import npllm

    copy = tmp_path / "copy"
    shutil.copytree(Path(npllm.__file__).parent, copy / "npllm", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(copy), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run():  # [cache hits, cache misses] of one process's call
        out = subprocess.run([sys.executable, "-c", STAMPED, str(copy)], capture_output=True, text=True,
                             check=True, env=env, cwd=tmp_path).stdout
        return json.loads(out.splitlines()[-1])

    assert run() == [0, 1]
    assert run() == [1, 0]
    with open(copy / "npllm" / "cli" / "__init__.py", "a") as f:
        f.write("# a comment: the package's source changed\n")
    assert run() == [0, 1]
    assert run() == [1, 0]
