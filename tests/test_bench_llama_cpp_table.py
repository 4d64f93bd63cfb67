"""scripts/bench/llama_cpp_table.py, the llama.cpp comparison in one command, run against stand-ins for llama.cpp's
programs (shell scripts that print what llama-bench and llama-batched-bench print, and die as their repacked kernels
do on a VM that lists AMX without enabling it) and for `npllm bench`: the pairs, their ratios, the ratios below 1.0
named at the end, the CPU model in the header, and the fallback to llama.cpp without repacking."""

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench"

LLAMA_BENCH = """#!/bin/sh
# dies unless repacking is off (--repack 0), as llama.cpp's AMX path does on such a VM
case " $* " in *" --repack 0 "*) ;; *) exit 139 ;; esac
case " $* " in
  *" -n 0 "*) echo '[{"n_prompt": 128, "n_gen": 0, "avg_ts": 200.0}]' ;;
  *) echo '[{"n_prompt": 0, "n_gen": 64, "avg_ts": 50.0}]' ;;
esac
"""
BATCHED_BENCH = """#!/bin/sh
case " $* " in *" --no-repack "*) ;; *) exit 139 ;; esac
echo 'a log line'
echo '{"pl": 4, "speed_pp": 400.0, "speed_tg": 100.0}'
echo '{"pl": 16, "speed_pp": 400.0, "speed_tg": 300.0}'
"""


@pytest.fixture
def table(monkeypatch, tmp_path):
    """The script as a module, with a stand-in llama.cpp build in tmp_path/llama and `npllm bench` answering
    prefill 300 tok/s (1.5x llama.cpp's 200) and decode 40 tok/s (0.8x its 50) at batch 1, 200 tok/s decode
    batched (2.0x at 4 sequences, 0.67x at 16)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("llama_cpp_table", BENCH / "llama_cpp_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bin_ = tmp_path / "llama" / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("llama-bench", LLAMA_BENCH), ("llama-batched-bench", BATCHED_BENCH),
                       ("llama-quantize", "#!/bin/sh\nexit 0\n")):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod((bin_ / name).stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "llama"))
    monkeypatch.setenv("GGUF_DIR", str(tmp_path / "gguf"))
    model = tmp_path / "shape-llamacpp-Q4_0.gguf"
    monkeypatch.setattr(module, "files", lambda build, out, shapes, types: {
        (shape, qtype): model for shape in shapes for qtype in types})

    def npllm_bench(path, threads, batches=(1,)):
        assert path == model
        return {b: {"batch": b, "prefill_tok_s": 300.0, "decode_tok_s": 40.0 if b == 1 else 200.0,
                    "achieved_gb_s": 7.0, "bandwidth_gb_s": 10.0, "steal_cpus": 0.01} for b in batches}

    monkeypatch.setattr(module, "npllm_bench", npllm_bench)
    return module


def test_pairs_ratios_and_what_is_below_one(table, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["llama_cpp_table.py", "--shapes", "shape", "--types", "Q4_0", "--threads",
                                      "1", "2", "--batch", "4", "16", "--batch-shapes", "shape", "--batch-types",
                                      "Q4_0"])
    assert table.main() == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("llama.cpp's repacked kernels died")  # the probe without --repack 0
    assert "CPU: " in out and "llama.cpp repacking: off" in out and "threads 1 and 2" in out
    rows = [line for line in out.splitlines() if line.startswith("| shape Q4_0 |")]
    assert len(rows) == 4  # two thread counts, two batch sizes
    assert rows[0].startswith("| shape Q4_0 | 1 | 1 | 50.0 / 40.0 | **0.80x** | 200.0 / 300.0 | 1.50x | "
                              "7.0 of 10.0 (70%)")
    assert rows[2].startswith("| shape Q4_0 | 2 | 4 | 100.0 / 200.0 | 2.00x | 400.0 / 300.0 | **0.75x**")
    assert "| shape Q4_0 | 2 | 16 | 300.0 / 200.0 | **0.67x** |" in rows[3]
    below = out.splitlines()[-1]
    assert below.startswith("below 1.0 (npllm / llama.cpp): ")
    assert "shape Q4_0 decode at 1 thread(s), round 1: 0.80x" in below
    assert "shape Q4_0 decode at 2 thread(s), round 1: 0.80x" in below
    assert "shape Q4_0 batched decode of 16 at 2 thread(s): 0.67x" in below
    assert "shape Q4_0 batched prefill of 4 at 2 thread(s): 0.75x" in below
    assert "prefill at" not in below and "decode of 4 at" not in below  # npllm ahead there


def test_repacking_kept_where_it_runs(table, monkeypatch, tmp_path, capsys):
    bench = tmp_path / "llama" / "bin" / "llama-bench"
    bench.write_text(LLAMA_BENCH.replace("*) exit 139 ;;", "*) ;;"))  # this machine's repacked kernels run
    monkeypatch.setattr(sys, "argv", ["llama_cpp_table.py", "--shapes", "shape", "--types", "Q4_0", "--threads",
                                      "2", "--batch"])
    assert table.main() == 0
    out = capsys.readouterr().out
    assert "llama.cpp repacking: on" in out and "died" not in out


def test_a_failing_run_is_a_row_not_a_crash(table, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["llama_cpp_table.py", "--shapes", "shape", "--types", "Q4_0", "--threads",
                                      "2", "--batch", "--repack", "1"])  # forced on: the stand-in dies
    assert table.main() == 0
    out = capsys.readouterr().out
    assert "| shape Q4_0 | 2 | 1 | failed: " in out and "exited 139" in out
