"""The compiler's pages, handed back once a model's code is loaded.

Numba compiles through LLVM, which lives in this process as one large shared library (llvmlite's libllvmlite.so,
~150 MB mapped). Loading a model's kernels, even from Numba's cache, runs parts of it (Numba builds its runtime
module with LLVM once a process; cached object code is linked by LLVM's JIT), and every page of LLVM code and
constants it touched stays in the process's resident memory: 60-70 MB once a quantized model's forward is loaded,
a third of a Q4_0 110M model's peak (docs/quant.md, "The compiler's pages, then the weights"). Once the model's
code is loaded none of it runs again, unless something new is compiled.

release_compiler_pages() takes those pages out of the process (madvise MADV_DONTNEED) wherever that loses nothing:
only read-only mappings of the library whose resident pages are all the file's own bytes (no page of private,
relocated data: /proc/self/smaps says "Anonymous: 0 kB"). The pages stay in the OS's page cache, so a later
compile maps them back at the cost of a minor fault each. Elsewhere (no /proc, no madvise) it does nothing.

release_linking_modules() hands back the heap that LLVM's modules for linking hold. Numba keeps, beside each
compiled function's machine code, an LLVM module of its code (parsed from the cache's bitcode when the code came
from there), so that a function compiled later that calls it can link its code in: 18 MiB of heap for a quantized
model's forward and products. Kept as its bitcode instead (~10x smaller) and parsed again only when a later compile
links it, it costs 1-2 MiB. Then malloc_trim gives the heap's free pages back to the OS (glibc; elsewhere a no-op).

A compile itself leaves far more behind: LLVM keeps the IR of every module it compiled (its JIT owns them) for the
life of the process, ~430 MiB after a quantized model's first compile. So a model whose code is not in Numba's cache
yet is compiled by a child process that fills the cache (models/numba.py: link_ahead), and this process only loads
the code; cached_here(dispatcher) tells which case it is.

release_linking_modules() and cached_here() reach into Numba's internals (a code library's _shared_module and
_final_module, how finalize() links them, the cache index behind a dispatcher's _cache), which Numba may change in
any release. They are used only with a Numba in TESTED_NUMBA, the range pyproject.toml allows: those parts of
Numba's source are the same in 0.59.1 and 0.68.1 (read side by side), and the suite runs on 0.68.1. With any other
Numba, one notice on stderr says so (once a process) and Numba's plain behaviour stays: the modules for linking are
kept as Numba keeps them, and a model's code not yet cached is compiled in this process, as Numba does.

A run may also go on without the code while a detached process compiles it behind it (models/__init__.py:
compile_behind): start_detached() starts that process, which outlives the run, lowers its priority (BACKGROUND_NICE)
and holds a lock file in the cache's directory (cache_lock(dispatcher)) while it compiles, so that one compile at a
time fills a cache directory; compiling_elsewhere(lock), compiling(lock) (what it compiles) and wait_for_lock(lock)
read the lock. The lock is the
kernel's (flock): it goes with the process however it ends, and Numba writes each cache file beside its place and
renames it there, so a compile killed half-way leaves no broken file (at worst an index entry whose data is missing,
which Numba treats as not cached). Where there is no flock (Windows), no detached compile is started.

stamp_package_caches() makes every cached npllm function's cache entry depend on the whole package's source, not
only its own file's: Numba checks just the file the function is in, so a cached function that calls code of another
file (models/numba_products.py's products calling kernels/quant's tiles) kept the old code of that file after it
changed — measured: a checkout's new prefill tiles (kernels/quant) ran at the old tiles' 10.7 ps per multiply-add
inside the model, whose cached products_into still held them, and at 6.9 with that cache cleared. A changed kernel
must never run as its old self (a changed block layout would give wrong numbers silently), so any change to a .py
file of npllm recompiles every npllm function, once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so no detached compile
    fcntl = None

import numba
from llvmlite import binding as llvm
from numba.core.codegen import CPUCodeLibrary
from numba.core.dispatcher import Dispatcher

from ..versions import Fence

LIBRARIES = ("libllvmlite", "libLLVM")  # llvmlite's own build links LLVM in; some distributions share libLLVM
# The Numba versions the internals used here are known in: [first, first not), as (major, minor).
TESTED_NUMBA = ((0, 59), (0, 69))
NUMBA_VERSION = numba.__version__  # the version internals_tested() checks
NUMBA_FENCE = Fence("numba", TESTED_NUMBA, "compiler tweaks",
                    "Numba's own behaviour is kept (no compile in a child process, LLVM's modules for linking kept), "
                    "so loading a model may take more memory")


def internals_tested() -> bool:
    """Whether this process's Numba (NUMBA_VERSION) lies in TESTED_NUMBA. Outside it (or where the version cannot
    be read), the first call prints one notice on stderr, and the callers keep to Numba's plain behaviour."""
    return NUMBA_FENCE.holds(NUMBA_VERSION)


def compiler_mappings(smaps: str) -> list[tuple[int, int]]:
    """(start, length) of each mapping in a /proc/PID/smaps text that can be dropped losing nothing: a mapping of
    one of LIBRARIES, not writable, with no anonymous (copied-on-write) page."""
    found, current = [], None
    for line in smaps.splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            name = os.path.basename(fields[5]) if len(fields) >= 6 else ""
            keep = name.startswith(LIBRARIES) and "w" not in fields[1]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            current = [start, end - start] if keep else None
            if keep:
                found.append(current)
        elif current is not None and fields[:1] == ["Anonymous:"] and fields[1] != "0":
            found.remove(current)
            current = None
    return [tuple(m) for m in found]


def release_compiler_pages() -> int:
    """Drop LLVM's resident pages from this process (see the module's docstring); returns the bytes of the
    mappings advised (0 where nothing could be)."""
    madvise = _madvise()
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except OSError:
        return 0
    if madvise is None:
        return 0
    advised = 0
    for start, length in compiler_mappings(smaps):
        if madvise(start, length, mmap.MADV_DONTNEED) == 0:
            advised += length
    return advised


def _madvise():
    """libc's madvise(addr, length, advice), or None where there is none to call."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class LinkingBitcode:
    """A compiled library's module for linking, kept as bitcode: Numba asks its linking module for clone() (to link
    a copy into a new caller) and as_bitcode() (to write its cache), and nothing else."""

    def __init__(self, bitcode: bytes):
        self.bitcode = bitcode

    def clone(self):
        return llvm.parse_bitcode(self.bitcode)

    def as_bitcode(self) -> bytes:
        return self.bitcode


def release_linking_modules(package: str = "npllm") -> int:
    """Replace the linking module of every compiled function of `package`'s modules by its bitcode (see the
    module's docstring), then trim the heap; returns how many modules were released (none, touching nothing,
    with a Numba outside TESTED_NUMBA)."""
    if not internals_tested():
        return 0
    released = 0
    for library in _libraries(package):
        module = getattr(library, "_shared_module", None)
        # A library with nothing to re-link shares its final module, which the JIT owns: that one stays
        if isinstance(module, llvm.ModuleRef) and module is not getattr(library, "_final_module", None):
            library._shared_module = LinkingBitcode(module.as_bitcode())
            module.close()
            released += 1
    _malloc_trim()
    return released


def _libraries(package: str):
    """The CPU code libraries of every compiled overload of the Numba functions that `package`'s modules define
    (a CUDA kernel's dispatcher is a Dispatcher too, but its overloads are kernels, with no CPU library)."""
    for name, module in list(sys.modules.items()):
        if name == package or name.startswith(package + "."):
            for value in list(vars(module).values()):
                if isinstance(value, Dispatcher):
                    for result in list(value.overloads.values()):
                        if isinstance(getattr(result, "library", None), CPUCodeLibrary):
                            yield result.library


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): the heap's free pages back to the OS. Other C libraries have none: nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # TypeError: Windows, whose CDLL needs a library's name
        pass


def cached_here(dispatcher, accepts=lambda signature: True) -> bool:
    """Whether Numba's cache holds code of `dispatcher` (a cache=True function) compiled for this CPU from its
    current source, for a signature (a tuple of Numba types) that `accepts` takes (any that the caller cannot tell
    apart: a miss on another one only means the old path, a compile in this process). Numba's cache index is read
    as Numba reads it; where it cannot be read, or with a Numba outside TESTED_NUMBA, True (nothing is gained by
    guessing: the code is compiled here, if it must be, as Numba does)."""
    if not internals_tested():
        return True
    try:
        index = dispatcher._cache._cache_file._load_index()  # {} when missing or stale (the source changed)
        magic = dispatcher.targetctx.codegen().magic_tuple()  # (target triple, CPU name, CPU features)
    except Exception:  # a Numba whose cache is laid out otherwise
        return True
    return any(key[1] == magic and accepts(key[0]) for key in index)


# --------------------------------------------------------------------------------------------------------------------
# Compiling behind a run: a detached process fills Numba's cache while the run goes on without the compiled code.

LOCK_NAME = "npllm-compile.lock"  # in the cache directory: holds the pid of the process compiling into it
BACKGROUND_NICE = 10  # how much a detached compile lowers its priority: the run in front keeps the cores it needs


def cache_lock(dispatcher) -> Path | None:
    """The lock file of detached compiles into the cache directory of `dispatcher` (a cache=True function), that
    directory made if missing; None where no detached compile can run: no flock, a Numba outside TESTED_NUMBA or
    whose cache is laid out otherwise, a directory that cannot be made."""
    if fcntl is None or not internals_tested():
        return None
    try:
        folder = Path(dispatcher._cache._cache_path)
        folder.mkdir(parents=True, exist_ok=True)
    except Exception:  # a Numba whose cache is laid out otherwise, or a directory that cannot be made
        return None
    return folder / LOCK_NAME


def compiling_elsewhere(lock: Path) -> bool:
    """Whether a process holds `lock` (a detached compile into its directory is running); compiling(lock) says what
    it compiles."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # no lock file: no compile has ever been started there
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:  # held
        return True
    finally:
        os.close(fd)  # drops the shared lock, if it was taken


def compiling(lock: Path) -> str | None:
    """The label of the detached compile holding `lock` (start_detached's), or None where none holds it."""
    if not compiling_elsewhere(lock):
        return None
    try:
        return lock.read_text().partition(" ")[2].strip()
    except OSError:
        return ""


def wait_for_lock(lock: Path, timeout: float, poll: float = 0.2) -> bool:
    """Wait until no process holds `lock`, at most `timeout` seconds; returns whether it was released."""
    deadline = time.monotonic() + timeout
    while compiling_elsewhere(lock):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def start_detached(code: str, env: dict, lock: Path, label: str = "") -> bool:
    """Run Python `code` in a detached process that holds `lock` while it runs, `label` written there after its pid
    (hold_lock; the process exits at once where another holds the lock), at BACKGROUND_NICE, in its own session (a Ctrl-C of the terminal does not reach it), with no
    stdin, stdout or stderr, outliving this process. Returns whether the process was started.

    The process started here forks and exits at once, so the one that runs `code` is nobody's child to wait for
    (no zombie in a long-lived caller, no "still running" warning): this waits only for that fork."""
    launcher = ("import os, sys\n"
                "if os.fork(): os._exit(0)\n"
                "from npllm.kernels.compiler import hold_lock\n"
                f"hold_lock({str(lock)!r}, {label!r}) or sys.exit(0)\n") + code
    try:
        subprocess.run([sys.executable, "-c", launcher], env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, timeout=60,
                       check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


_held_lock = None  # the descriptor hold_lock locked: open, and so locked, for the rest of the process


def hold_lock_waiting(path: str, label: str = "") -> None:
    """In a compile a run waits for (models/numba.py: compile_in_child): lock `path` for the rest of this process,
    first waiting while another process holds it, and write this pid and `label` there. One compile at a time into
    a cache directory: Numba's cache index has no lock of its own, and two processes saving entries of one index at
    once can each give its entry the same data file, leaving one key naming the other's code. The one that waited
    then finds the code cached and loads it."""
    global _held_lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {label}\n".encode())
    _held_lock = fd


def hold_lock(path: str, label: str = "") -> bool:
    """In a detached compile (start_detached): lock `path` for the rest of this process, write its pid and `label`
    there and lower its priority; False, touching nothing, where another process holds the lock."""
    global _held_lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {label}\n".encode())
    _held_lock = fd
    os.nice(BACKGROUND_NICE)
    return True


# ---------------------------------------------------------------------------------------------- the cache's stamp

PACKAGE = Path(__file__).resolve().parents[1]  # npllm/


@functools.cache
def package_stamp() -> str:
    """sha256 over every .py file of the package (its path under npllm/, then its bytes): ~1 MB, a few ms, once."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class _PackageStamped:
    """A Numba cache locator for the package's functions whose source stamp is (the file's, package_stamp()); None
    (the next locator) for any other function."""

    def get_source_stamp(self):
        return super().get_source_stamp(), package_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        inside = Path(py_file).resolve().is_relative_to(PACKAGE)
        return super().from_function(py_func, py_file) if inside else None


def stamp_package_caches() -> None:
    """Puts a _PackageStamped form of each of Numba's file-backed locators (the NUMBA_CACHE_DIR one, the
    __pycache__ one, the user-wide one) ahead of Numba's own, before any cached npllm function is made (kernels/
    __init__.py calls it). With a Numba outside TESTED_NUMBA, its plain behaviour stays (internals_tested)."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")  # 0.59 named it with a "_"
    if not internals_tested() or any(issubclass(c, _PackageStamped) for c in impl._locator_classes):
        return
    stamped = []
    for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"):
        base = getattr(caching, name, None) or getattr(caching, "_" + name)  # 0.59 named them with a "_"
        stamped.append(type("Package" + name, (_PackageStamped, base), {}))
    impl._locator_classes[:0] = stamped
