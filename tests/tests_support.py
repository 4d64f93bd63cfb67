"""Helpers shared by test modules (imported by name: pytest puts tests/ on sys.path)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# How long a test waits for an `npllm` child that runs a model: the first such child of a run may compile the Numba
# model's code first (every block type's kernels: 2-4 minutes on 2 cores); a bound well under pytest-timeout's 600 s
# that still catches a hang.
COMPILE_TIMEOUT = 540
EMBEDDED = REPO / "npllm" / "data"  # reference files the package itself ships (stories260K)


def bench_script(name: str):
    """scripts/bench/<name>.py imported as a module (the scripts are not a package), registered under its name in
    sys.modules (dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def template_workers(parent: int) -> list[int]:
    """The pids of process `parent`'s live chat template workers (npllm/chat/worker.py; a dead, unreaped one has
    no command line)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"sandbox.py" in command:
            found.append(int(entry))
    return found


def template_worker_of(parent: int, seconds: float) -> int:
    """The pid of process `parent`'s chat template worker, once it runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = template_workers(parent)
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"process {parent} started no chat template worker within {seconds} s")


def load_campaign():
    """scripts/bad_inputs.py (the bad-input campaign) as a module, loaded once."""
    if "bad_inputs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bad_inputs", REPO / "scripts" / "bad_inputs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bad_inputs"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["bad_inputs"]


def pad_vocabulary(config, weights: dict, loud_ids, scale: float = 50.0):
    """(config, weights) with len(loud_ids) padding ids past the vocabulary, as Qwen2 pads its own: the LM head's
    padding row i is `scale` times the row of loud_ids[i] (so that, unmasked, a padding id outscores every real
    one where loud_ids' ids lead), the embedding's padding rows likewise, and config.usable_vocab the old size."""
    import numpy as np

    V = config.vocab_size
    padded = dict(weights)
    for name in ("tok_embeddings",) + (() if config.tied_embeddings else ("output",)):
        rows = np.asarray(weights[name])
        padded[name] = np.concatenate([rows, scale * rows[np.asarray(loud_ids)]])
    return config.replace(vocab_size=V + len(loud_ids), usable_vocab=V), padded


# Draws through the compiled samplers (the first four) and through the host's sample_with (a penalty).
PADDING_SAMPLINGS = ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 45, "top_p": 0.95},
                     {"temperature": 1.5, "min_p": 0.01}, {"temperature": 1.0, "repetition_penalty": 1.3})


def assert_padding_never_drawn(plain, padded, hidden, seeds: int = 8, exact: bool = True) -> None:
    """`padded` is `plain` with pad_vocabulary's loud padding rows: its lm_head gives padding ids -inf (where its
    raw head_logits would pick them), every other logit is plain's, and every draw, by the backend's compiled
    sampler or on the host, is plain's draw for the same generator: never a padding id.   hidden: [B, D]

    exact: the backend sums each logit in an order that does not depend on the matrix's row count (npllm's own
    kernels), so the unpadded logits are plain's bit for bit. Otherwise (the NumPy reference: BLAS picks its kernel,
    and so its summation order, by the matrix's shape, and by the CPU or OPENBLAS_CORETYPE) each may differ by the
    rounding of two orders of the same D-term float32 sum: at most 2 D 2^-24 sum_d |h_d w_vd|."""
    import numpy as np

    from npllm.sampling import SamplingParams

    V = plain.config.vocab_size
    assert (np.asarray(padded.head_logits(hidden)).argmax(axis=1) >= V).all()  # unmasked, padding would win
    logits = padded.lm_head(hidden)
    assert logits.shape[1] > V and np.isneginf(logits[:, V:]).all()
    if exact:
        np.testing.assert_array_equal(logits[:, :V], plain.lm_head(hidden))
    else:
        h, w = np.abs(np.asarray(hidden, np.float64)), np.abs(np.asarray(plain.weights.output, np.float64))
        bound = 2 * h.shape[1] * 2.0**-24 * (h @ w.T) + 1e-30
        assert (np.abs(logits[:, :V] - plain.lm_head(hidden)) <= bound).all()
    for options in PADDING_SAMPLINGS:
        params = SamplingParams(**options)
        for seed in range(seeds):
            for row in range(len(hidden)):
                h = hidden[row:row + 1]
                got = padded.sample_next(h, params, np.random.default_rng(seed), [1, 2])
                assert got == plain.sample_next(h, params, np.random.default_rng(seed), [1, 2]) and got < V, options
    if padded.sample is not None:  # a batch of rows through the compiled sampler at once
        u = np.linspace(0.0, 0.999, len(hidden))
        ids = np.asarray(padded.sample(hidden, temperature=1.0, uniforms=u))
        assert (ids < V).all() and (ids == np.asarray(plain.sample(hidden, temperature=1.0, uniforms=u))).all()
