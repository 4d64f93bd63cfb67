"""Measure checkpoint load time and memory for each on-disk dtype (F32, F16, BF16 safetensors; GGUF F32, F16, Q8_0,
Q4_0 when the `gguf` package is installed) on one synthetic Llama-shaped model.

    python scripts/bench_load.py [--dim 1024 --layers 8 --ffn 2816 --vocab 32000] [--dir /tmp/npllm-bench]

Each load runs in a fresh subprocess, which reports the wall time of read_checkpoint and the growth of its peak
resident set (VmHWM) over the interpreter's baseline. F32 safetensors are memory-mapped (pages are read on first
touch, so the "touch" column also times a full pass over the weights); other dtypes are converted to float32 on load.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's npllm, for the parent and (through cwd) the children

CHILD = r"""
import sys, time
import numpy as np
from npllm.formats import read_checkpoint

def peak_mib():  # VmHWM: this process's peak resident set (unlike ru_maxrss, not inherited from the parent)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

base = peak_mib()
t0 = time.perf_counter()
config, weights = read_checkpoint(sys.argv[1])
t1 = time.perf_counter()
peak_load = peak_mib()
total = sum(float(np.sum(w, dtype=np.float64)) for w in weights.values())  # touch every page
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, peak_load - base, peak_mib() - base)
"""


def hf_names(layers: int) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for l in range(layers):
        p = f"model.layers.{l}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                  "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
                                  "mlp.up_proj.weight")]
    return names


def shapes(a) -> dict[str, tuple[int, ...]]:
    dh = a.dim // a.heads
    kv = a.kv_heads * dh
    by_suffix = {"embed_tokens.weight": (a.vocab, a.dim), "lm_head.weight": (a.vocab, a.dim), "norm.weight": (a.dim,),
                 "layernorm.weight": (a.dim,), "q_proj.weight": (a.dim, a.dim), "k_proj.weight": (kv, a.dim),
                 "v_proj.weight": (kv, a.dim), "o_proj.weight": (a.dim, a.dim), "gate_proj.weight": (a.ffn, a.dim),
                 "up_proj.weight": (a.ffn, a.dim), "down_proj.weight": (a.dim, a.ffn)}
    return {n: next(s for suf, s in by_suffix.items() if n.endswith(suf)) for n in hf_names(a.layers)}


def write_safetensors(path: str, a, dtype: str) -> None:
    rng = np.random.default_rng(0)
    header, offset, table = {}, 0, shapes(a)
    itemsize = 4 if dtype == "F32" else 2
    for name, shape in table.items():
        n = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in table.items():
            x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            if dtype == "F16":
                x = x.astype(np.float16)
            elif dtype == "BF16":
                x = (x.view(np.uint32) >> 16).astype(np.uint16)
            f.write(x.tobytes())


def write_config(directory: str, a) -> None:
    cfg = {"model_type": "llama", "hidden_size": a.dim, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
           "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "vocab_size": a.vocab,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_gguf(path: str, safetensors_dir: str, qtype_name: str) -> None:
    import gguf

    from npllm.formats import read_checkpoint

    config, weights = read_checkpoint(safetensors_dir)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_formats_gguf import write_gguf as write  # the tests' llama.cpp-style writer

    write(path, config, weights, getattr(gguf.GGMLQuantizationType, qtype_name))


def measure(path: str) -> tuple[float, float, float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, path], check=True, capture_output=True, text=True, cwd=REPO)
    return tuple(float(x) for x in out.stdout.split())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default="/tmp/npllm-bench")
    a = p.parse_args()
    params = sum(int(np.prod(s)) for s in shapes(a).values())
    print(f"model: {params / 1e6:.0f}M parameters ({params * 4 / 2**20:.0f} MiB as float32)")
    print(f"{'checkpoint':<22}{'file MiB':>10}{'load s':>9}{'touch s':>9}{'RSS after load':>16}{'after touch':>13}")
    for dtype in ("F32", "F16", "BF16"):
        d = os.path.join(a.dir, f"st_{dtype}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "model.safetensors")
        if not os.path.exists(path):
            write_safetensors(path, a, dtype)
            write_config(d, a)
        report(f"safetensors {dtype}", path, d)
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("(gguf package not installed: GGUF rows skipped)")
        return
    for qtype in ("F32", "F16", "Q8_0", "Q4_0"):
        path = os.path.join(a.dir, f"model_{qtype}.gguf")
        if not os.path.exists(path):
            write_gguf(path, os.path.join(a.dir, "st_F32"), qtype)
        report(f"gguf {qtype}", path, path)


def report(label: str, file: str, checkpoint: str) -> None:
    load, touch, rss_load, rss_touch = measure(checkpoint)
    size = os.path.getsize(file) / 2**20
    print(f"{label:<22}{size:>10.0f}{load:>9.2f}{touch:>9.2f}{rss_load:>12.0f} MiB{rss_touch:>9.0f} MiB")


if __name__ == "__main__":
    main()
