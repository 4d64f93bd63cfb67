"""Weights read through a memory map leave one resident copy: tensors.release drops a mapped weight's pages once it
is checked or copied, and nothing is lost (a released page is read back from the file).

Resident memory is read from /proc (Linux): VmRSS for what is resident now, VmHWM for the peak of a child process
that loads a model.
"""

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npllm.config import ModelConfig
from npllm.tensors import release, release_files
from npllm.formats.gguf_write import write_gguf
from npllm.formats.random import random_weights
from tests_support import mapping_resident_kb

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists() or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="resident memory is read from /proc; release needs madvise")

MB = 2**20


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def mapped_file(tmp_path):
    values = np.random.default_rng(0).standard_normal(48 * MB // 4).astype(np.float32)
    path = tmp_path / "w.bin"
    values.tofile(path)
    return path, values


@pytest.mark.parametrize("how", ["memmap", "mmap"])
def test_a_released_weight_leaves_resident_memory_and_reads_back_the_same(mapped_file, how):
    path, values = mapped_file
    if how == "memmap":
        w = np.memmap(path, np.float32, mode="r").reshape(-1, 1024)
    else:
        with open(path, "rb") as f:
            w = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.float32).reshape(-1, 1024)
    checksum = float(w.sum(dtype=np.float64))  # every page resident
    before = resident_mb()
    release(w[: len(w) // 2], w[len(w) // 2:])
    assert before - resident_mb() > 0.9 * values.nbytes / MB
    assert float(w.sum(dtype=np.float64)) == checksum
    np.testing.assert_array_equal(w.reshape(-1), values)


def test_releasing_the_files_drops_every_page_of_their_maps(mapped_file):
    """release_files drops every page of each file mapping the weights view, once the caller is done with all of
    them: also pages that no weight's own release() covers (here: a weight smaller than a page, whose release drops
    nothing; in a model file, the neighbours' pages that fault-around maps back in, up to a large folio's 2 MiB at
    each boundary). Memory that is not a read-only file map is ignored, and the values read back the same."""
    path, values = mapped_file
    with open(path, "rb") as f:
        flat = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.float32)
    checksum = float(flat.sum(dtype=np.float64))  # every page resident
    release(flat[:1000])
    assert mapping_resident_kb(path) > 0.9 * values.nbytes / 1024
    release_files([flat[:1000], values])
    assert mapping_resident_kb(path) == 0
    assert float(flat.sum(dtype=np.float64)) == checksum
    np.testing.assert_array_equal(flat, values)


def test_memory_that_is_not_a_read_only_file_map_is_left_alone(mapped_file):
    path, values = mapped_file
    with open(path, "rb") as f:
        private = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), np.float32)
    private[:3] = [1.0, 2.0, 3.0]  # a copy-on-write page holds the only copy of these values
    anonymous = np.frombuffer(mmap.mmap(-1, 8 * MB), np.float32)
    anonymous[::1024] = 5.0
    in_memory = values.copy()
    release(private, anonymous, in_memory, in_memory.T)
    release_files([private, anonymous, in_memory])
    np.testing.assert_array_equal(private[:3], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(private[3:], values[3:])
    assert (anonymous[::1024] == 5.0).all()
    np.testing.assert_array_equal(in_memory, values)


PEAK = r"""
import sys
from pathlib import Path
from npllm.formats import read_checkpoint
from npllm.models import make_model
from npllm.models.numba import link_ahead

link_ahead(None)  # the interpreter, NumPy, Numba and the compiled code are the baseline, not the load

def status(key):  # kB -> MB
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024

checkpoint = read_checkpoint(sys.argv[1])  # its metadata's objects are not the copy either
base = status("VmRSS")
model = make_model(*checkpoint, "numba")
print(status("VmHWM") - base, status("VmRSS") - base)
"""


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_file_on_the_numba_backend_peaks_at_about_one_copy(tmp_path, qtype):
    """Loading an all-F32 GGUF builds the float32 panels from the map, a Q8_0 one its interleaved rows: the peak of
    the load stays near the file's size (the copy + one block or matrix), not twice it (the map's pages beside the
    copy)."""
    config = ModelConfig(dim=512, hidden_dim=1408, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=8192,
                         max_seq_len=64, head_dim=64)
    if qtype != "F32":  # a file of about the F32 one's size
        config = config.replace(dim=1024, hidden_dim=2816, n_heads=16, n_kv_heads=16)
    path = tmp_path / "model.gguf"
    write_gguf(path, config, random_weights(config, 1), qtype)
    size_mb = path.stat().st_size / MB
    peak, held = map(float, subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True,
                                           check=True).stdout.split())
    assert held < 1.1 * size_mb, f"the model holds {held:.0f} MB for a {size_mb:.0f} MB file"
    assert peak < 1.25 * size_mb, f"the load peaked {peak:.0f} MB above the start for a {size_mb:.0f} MB file"
