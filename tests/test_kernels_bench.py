"""`npllm bench --json`: the interface other tools read (keys, one object per line, consistent arithmetic)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npllm import kernels
from npllm.bench import decode_weight_bytes, load_weights
from npllm.cli import main
from npllm.errors import ConfigError
from npllm.formats.random import NAMED_SHAPES

KEYS = {"model", "backend", "threads", "batch", "prompt_len", "gen_len", "prefill_tok_s", "decode_tok_s",
        "first_token_ms", "weight_bytes_per_token", "achieved_gb_s", "bandwidth_gb_s", "peak_rss_mb",
        "threads_wait", "steal_cpus"}


def test_bench_json_lines(capsys):
    assert main(["bench", "--model", "stories260K", "--batch", "1", "3", "--prompt-len", "5", "--gen-len", "4",
                 "--repeat", "1", "--bandwidth-mib", "8", "--threads", "1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["prompt_len"]) for r in lines] == [(1, 5), (3, 5)]
    for r in lines:
        assert KEYS <= r.keys()
        assert r["backend"] == "numba" and r["threads"] == 1 and r["gen_len"] == 4
        assert r["threads_wait"] == ("spin" if kernels.SPINNING else "sleep")  # what this process's threads do
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["bandwidth_gb_s"] > 0
        step_bytes = decode_weight_bytes(NAMED_SHAPES["stories260K"])
        assert r["weight_bytes_per_token"] == step_bytes // r["batch"]
        # achieved GB/s is the bytes of one decode step over the time of one step
        assert r["achieved_gb_s"] == pytest.approx(step_bytes / (r["ms_per_token"] / 1e3) / 1e9, rel=0.02)
        assert 0 <= r["steal_cpus"] <= os.cpu_count()  # a share of the machine's CPUs, Linux having /proc/stat


def test_steal_seconds_reads_the_eighth_column_of_proc_stat(monkeypatch, tmp_path):
    import builtins

    from npllm import bench

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 9000 10 0 5 250 0 0\ncpu0 50 0 25 4500 5 0 2 125 0 0\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path,
                                                                            *a, **k))
    assert bench.steal_seconds() == 250 / os.sysconf("SC_CLK_TCK")
    stat.write_text("")  # no such line: no figure rather than an exception
    assert bench.steal_seconds() is None
    # the human-readable line flags a figure the host took time from, and only such a figure
    assert "steal 0.20 CPUs" in bench._steal_warning(0.2)
    assert bench._steal_warning(0.01) == bench._steal_warning(None) == ""


def test_decode_weight_bytes_counts_every_matrix_once():
    c = NAMED_SHAPES["stories15M"]
    assert decode_weight_bytes(c) == 4 * (c.n_params + c.dim)  # the parameters, plus the embedding row looked up


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        load_weights("stories7B")


def test_unknown_backend_is_reported(capsys):
    assert main(["bench", "--model", "stories260K", "--backend", "cobol", "--json"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_decode_weight_bytes_of_experts_counts_the_ones_a_token_uses():
    """A mixture of experts reads its router and k of its E experts per token: as many bytes as the dense model with
    k experts' width, plus the router."""
    moe, dense = NAMED_SHAPES["granite-moe-1B-A400M"], NAMED_SHAPES["granite-dense-A400M"]
    assert decode_weight_bytes(moe) == decode_weight_bytes(dense) + 4 * moe.n_layers * moe.n_experts * moe.dim


def test_bench_names_the_cpu_and_the_kernel_variant_it_chose(monkeypatch):
    """Every figure carries the CPU's model name (as lscpu prints it) and the integer-dot path the block kernels
    were built with, chosen from the CPU's features: a table from another machine says what it measured."""
    from npllm import bench
    from npllm.kernels.quant import intrinsics

    m = bench.machine()
    with open("/proc/cpuinfo") as f:
        names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert m["cpu"] in names
    expected = ("portable" if not intrinsics.AVX2 else "512-bit" if intrinsics.PAIRED
                else "256-bit vpdpbusd" if intrinsics.VNNI else "AVX2 vpmaddubsw")
    assert m["kernels"].startswith(expected) and ("GFNI" in m["kernels"]) == intrinsics.GFNI
    monkeypatch.setattr(intrinsics, "PAIRED", False)
    monkeypatch.setattr(intrinsics, "VNNI", False)
    assert intrinsics.variant().startswith("AVX2 vpmaddubsw" if intrinsics.AVX2 else "portable")


def test_bench_prints_the_machine_once_on_stderr(capsys):
    assert main(["bench", "--model", "stories260K", "--batch", "1", "2", "--prompt-len", "4", "--gen-len", "2",
                 "--repeat", "1", "--bandwidth-mib", "8", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    from npllm.bench import machine

    m = machine()
    assert len(out.splitlines()) == 2 and all(line.startswith("stories260K") for line in out.splitlines())
    assert err.count("[npllm] CPU: ") == 1 and m["cpu"] in err and m["kernels"] in err


TARGET_CHECK = """
from npllm.kernels import simd, target
from npllm.kernels.quant import intrinsics
print(sorted(target.features()), simd.WIDE, intrinsics.AVX2, intrinsics.VNNI, intrinsics.PAIRED, intrinsics.GFNI)
"""


@pytest.mark.parametrize("cpu_features, wide, avx2, vnni, paired, gfni", [
    ("+avx2,+fma,+avx512fp16", False, True, False, False, False),  # avx512fp16 is not avx512f
    ("+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+gfni", True, True, True, True, True),
    ("+avx2,+avxvnni", False, True, True, False, False),
    ("", False, False, False, False, False),  # a bare NUMBA_CPU_NAME: nothing assumed
])
def test_one_probe_decides_every_kernel_variant_from_numbas_target(cpu_features, wide, avx2, vnni, paired, gfni):
    """kernels/target.py is the one CPU-feature probe: simd's vector width and the block kernels' dot paths follow
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES feature by feature (a name is matched whole, not as a prefix)."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=cpu_features,
               PYTHONPATH=str(Path(__file__).parent.parent))
    out = subprocess.run([sys.executable, "-c", TARGET_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    flags = out.stdout.split("]")[1].split()
    assert flags == [str(v) for v in (wide, avx2, vnni, paired, gfni)]
