"""`npllm bench`: prefill and decode throughput of a model, set against the memory bandwidth measured in the same run.

    npllm bench --model NAME_OR_PATH [--batch B ...] [--prompt-len N ...] [--gen-len N] [--backend B ...]
                [--threads T] [--weight-dtype D] [--kv-dtype D ...] [--repeat R] [--json]

A model is a checkpoint path, a known name found on disk, or a shape from formats/random.py (stories15M,
stories110M, tinyllama-1.1B, ...) filled with random weights: the arithmetic, and so the speed, is the same.

For each backend, KV cache dtype (--kv-dtype float32 float16: both on the same model, in turn), batch B and prompt
length N it measures (medians of R runs):
    prefill_tok_s      B prompts of N random tokens in one forward call, tokens per second
    first_token_ms     that prefill plus the LM head and argmax of the last tokens: time to first token, warm
    decode_tok_s       gen_len greedy steps of B tokens (one per sequence) after the prompt, summed over the batch
    ms_per_token       milliseconds per decode step
    weight_bytes_per_token  weight bytes a decode step reads, per sequence of the batch, in the types the
                       model holds them (a GGUF file's own types on the numba backend; float32 otherwise)
    achieved_gb_s      weight bytes streamed per decode step / step time (decode at batch 1 reads every weight
                       once per token, so this is the figure to hold against bandwidth_gb_s)
    decode_cpu_cores   CPU time of the process during decode / wall time: the cores it kept busy on average (up to
                       `threads`; less when other processes took cores, or when a call ran on one thread)
    load_avg           the machine's 1-minute load average when the figure was measured
    steal_cpus         the machine's steal time while the figure was measured, in CPUs (seconds stolen from all
                       its CPUs per second): on a VM, time its vCPUs were ready to run but the host ran another
                       guest; a figure measured with more than ~0.05 is the host's, not npllm's (None off Linux)
    kv_cache_mib       the KV cache's size (B slots x (N + gen_len) positions, keys and values)
and once per backend:
    dtype              the weights' types, largest share first ("Q4_0+Q6_K+F32"; "float32" for float models), with
                       weight_bytes_by_type where a file's types are kept
    first_token_cold_ms  the first request of the process, JIT compilation or cache loading included
    bandwidth_gb_s     memory read bandwidth: the best of a NumPy sgemv and a Numba streaming sum over 512 MiB
                       (--bandwidth-mib: make it larger than the last-level cache)
    peak_rss_mb        peak resident memory of the process (each backend runs in its own process), taken before
                       the bandwidth probe allocates its buffer
    threads_wait       "spin" or "sleep": what the OpenMP threads did between parallel regions (kernels/__init__.py:
                       they spin briefly when the machine had a core free for each of them, which decode gains most
                       from)
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from .models import limit_blas_threads, make_model, resolve_backend
from .models.numba import use_threads
from .config import ModelConfig
from .errors import ConfigError, FormatError
from .kernels import SPINNING
from .kernels.simd import LANES, vadd, vload, vsum, vzero


def load_weights(model: str) -> tuple[ModelConfig, dict[str, np.ndarray], str]:
    """(config, weights, "checkpoint" | "random") for a path, a known model on disk, or a named shape; a
    checkpoint's weights in their file types (formats.read_checkpoint)."""
    from .formats import read_checkpoint
    from .formats.random import NAMED_SHAPES, random_weights
    from .hub import resolve

    if Path(model).exists():
        return (*read_checkpoint(model), "checkpoint")
    try:
        checkpoint, _ = resolve(model, download_missing=False)
        return (*read_checkpoint(checkpoint), "checkpoint")
    except FormatError:
        if model not in NAMED_SHAPES:
            raise ConfigError(f"--model {model!r} is neither a checkpoint on disk nor a named shape "
                              f"({', '.join(NAMED_SHAPES)})") from None
    return NAMED_SHAPES[model], random_weights(NAMED_SHAPES[model]), "random"


# Positions past a model's context time the same arithmetic, so a bench may go past it (the default 512 + 256 on
# stories15M's 256); this many contexts further, the figures describe no run a model makes and attention's cost,
# which grows with the square of the length, turns a typo into hours.
MOST_CONTEXTS = 4


def check_lengths(config: ModelConfig, prompt_lens, gen_len: int) -> None:
    """Refuse a prompt length whose prompt plus gen_len decode steps run past MOST_CONTEXTS x the context."""
    most = MOST_CONTEXTS * config.max_seq_len
    longest = max(prompt_lens)
    if longest + gen_len > most:
        raise ConfigError(f"--prompt-len {longest} + --gen-len {gen_len} positions run far past the model's context "
                          f"of {config.max_seq_len} tokens: at most {most} ({MOST_CONTEXTS} contexts) are timed")


def decode_weight_bytes(c: ModelConfig) -> int:
    """Bytes of float32 weights a decode step reads: every layer matrix (of a mixture of experts, the router and
    the k experts a token uses), the norms and the LM head."""
    D, F, Dh = c.dim, c.hidden_dim, c.head_dim
    ffn = c.n_experts_used * 3 * D * c.moe_hidden_dim + c.n_experts * D if c.n_experts else 3 * D * F
    per_layer = D * (c.n_heads + 2 * c.n_kv_heads) * Dh + c.n_heads * Dh * D + ffn + 2 * D
    if c.attention_bias:
        per_layer += (c.n_heads + 2 * c.n_kv_heads) * Dh
    return 4 * (c.n_layers * per_layer + c.vocab_size * D + 2 * D)  # + final norm and one embedding row


@njit(parallel=True, cache=True)
def _stream_sum(a, chunks):
    """Sum of a float32 array read once, one contiguous chunk per thread, four 8-lane accumulators per thread."""
    n = a.shape[0] - a.shape[0] % (chunks * 4 * LANES)
    step = n // chunks
    partial = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        s0, s1, s2, s3 = vzero(), vzero(), vzero(), vzero()
        for i in range(c * step, (c + 1) * step, 4 * LANES):
            s0 = vadd(s0, vload(a, i))
            s1 = vadd(s1, vload(a, i + LANES))
            s2 = vadd(s2, vload(a, i + 2 * LANES))
            s3 = vadd(s3, vload(a, i + 3 * LANES))
        partial[c] = vsum(vadd(vadd(s0, s1), vadd(s2, s3)))
    return partial.sum()


def measure_bandwidth(threads: int, mib: int = 512, repeat: int = 5) -> dict[str, float]:
    """Read bandwidth in GB/s over `mib` MiB: NumPy sgemv (BLAS) and a Numba streaming sum, best of `repeat`."""
    rows = 256
    matrix = np.ones((rows, mib * 2**20 // 4 // rows), np.float32)
    vector = np.ones(matrix.shape[1], np.float32)
    flat = matrix.reshape(-1)
    use_threads(threads)  # not numba.set_num_threads: the model's record of what is set must stay true
    _stream_sum(flat[:1024], threads)

    def best_rate(run):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return matrix.nbytes / min(times) / 1e9

    stream = best_rate(lambda: _stream_sum(flat, threads))
    sgemv = best_rate(lambda: matrix @ vector)
    return {"bandwidth_gb_s": round(max(stream, sgemv), 2), "bandwidth_stream_gb_s": round(stream, 2),
            "bandwidth_sgemv_gb_s": round(sgemv, 2)}


def _median(xs):
    return float(np.median(xs))


class Session:
    """One model on one backend, timed request by request."""

    def __init__(self, model, seed: int = 0):
        self.model = model
        self.config = model.config
        self.rng = np.random.default_rng(seed)

    def prefill(self, batch: int, prompt_len: int, capacity: int, kv_dtype: str | None = None):
        """B random prompts in one forward call; returns (cache, next tokens, prefill seconds, first-token seconds)."""
        cache = self.model.new_cache(capacity, batch, kv_dtype)
        tokens = self.rng.integers(0, self.config.vocab_size, batch * prompt_len)
        positions = np.tile(np.arange(prompt_len), batch)
        slots = np.repeat(np.arange(batch), prompt_len)
        start = time.perf_counter()
        hidden = self.model.forward(tokens, positions, cache, slots)
        self.synchronize()
        prefilled = time.perf_counter()
        last = hidden[prompt_len - 1::prompt_len]  # [B, D] the last token of each prompt
        next_tokens = self.greedy(last)
        return cache, next_tokens, prefilled - start, time.perf_counter() - start

    def decode(self, cache, tokens, start_position: int, steps: int) -> tuple[float, float]:
        """`steps` greedy decode steps of one token per sequence; returns (seconds, CPU seconds of all threads)."""
        batch = len(tokens)
        slots = np.arange(batch)
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(steps):
            positions = np.full(batch, start_position + i)
            hidden = self.model.forward(tokens, positions, cache, slots)
            tokens = self.greedy(hidden)
        return time.perf_counter() - start, time.process_time() - cpu_start

    def greedy(self, hidden) -> np.ndarray:
        """The argmax ids of hidden states' logits: on the GPU for the CUDA model (only ids come back, which also
        waits for the device), else from host logits."""
        if self.model.sample is not None:
            return self.model.sample(hidden)
        return np.argmax(self.model.lm_head(hidden), axis=-1)

    def synchronize(self) -> None:
        """Wait for work queued on a GPU (its launches return at once); nothing to wait for on the CPU."""
        self.model.synchronize()


def bench_backend(model_name: str, backend: str, threads: int | None, batches, prompt_lens, gen_len: int,
                  repeat: int, bandwidth_mib: int = 512, weight_dtype: str = "file", kv_dtypes=("float32",)):
    """Yield one result dict per (KV dtype, batch, prompt length) for one backend, in this process."""
    backend = resolve_backend(backend)
    config, weights, kind = load_weights(model_name)
    check_lengths(config, prompt_lens, gen_len)
    start = time.perf_counter()
    model = make_model(config, weights, backend, threads, weight_dtype)
    load_s = time.perf_counter() - start
    del weights  # the Numba backend keeps its own packed copy
    used_threads = getattr(model, "threads", threads) or _blas_threads()
    session = Session(model)
    cold = session.prefill(1, prompt_lens[0], prompt_lens[0] + gen_len)[3]
    common = {**machine(), "model": model_name, "weights": kind, "backend": backend, "threads": used_threads,
              "gen_len": gen_len, "load_s": round(load_s, 3), "first_token_cold_ms": round(1e3 * cold, 2),
              "cold_prompt_len": prompt_lens[0], "threads_wait": "spin" if SPINNING else "sleep"}
    for kv_dtype in kv_dtypes:  # compile (or load) the forward pass for each cache dtype before any timing
        session.prefill(1, 1, 1, kv_dtype)
    step_bytes, types = decode_weight_bytes(config), {"float32" if weight_dtype == "file" else weight_dtype: None}
    if hasattr(model, "weight_types"):  # the Numba model, each matrix in its type: the bytes a step reads as stored
        step_bytes, types = model.weight_bytes, model.weight_types
    common["dtype"] = "+".join(sorted(types, key=lambda name: -(types[name] or 0)))
    if hasattr(model, "weight_types"):
        common["weight_bytes_by_type"] = types
    results = [{**common, **measure_point(session, kv_dtype, batch, prompt_len, gen_len, repeat, step_bytes)}
               for kv_dtype, batch, prompt_len in itertools.product(kv_dtypes, batches, prompt_lens)]
    peak_rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # before the 512 MiB probe
    if backend == "cuda":  # the GPU's memory, which its decode steps stream
        from .models.cuda import device_bandwidth_gb_s

        bandwidth = {"bandwidth_gb_s": round(device_bandwidth_gb_s(4 * bandwidth_mib), 1)}
    else:
        bandwidth = measure_bandwidth(used_threads, bandwidth_mib)
    for r in results:
        yield {**r, **bandwidth, "peak_rss_mb": peak_rss_mb}


def steal_seconds() -> float | None:
    """Seconds of steal time summed over the machine's CPUs since boot (/proc/stat's eighth column, in clock
    ticks), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def measure_point(session, kv_dtype: str, batch: int, prompt_len: int, gen_len: int, repeat: int,
                  step_bytes: int) -> dict:
    """Prefill and decode figures of one (KV dtype, batch, prompt length), medians of `repeat` runs."""
    prefill_s, first_s, decode_s, decode_cpu_s = [], [], [], []
    load = os.getloadavg()[0]
    steal_start, wall_start = steal_seconds(), time.perf_counter()
    for _ in range(repeat):
        cache, tokens, p_s, f_s = session.prefill(batch, prompt_len, prompt_len + gen_len, kv_dtype)
        kv_bytes = cache.nbytes
        prefill_s.append(p_s)
        first_s.append(f_s)
        d_s, d_cpu_s = session.decode(cache, tokens, prompt_len, gen_len)
        decode_s.append(d_s)
        decode_cpu_s.append(d_cpu_s)
        del cache
    step = _median(decode_s) / gen_len
    steal_end = steal_seconds()
    steal = None if steal_end is None else round((steal_end - steal_start) / (time.perf_counter() - wall_start), 2)
    return {"kv_dtype": kv_dtype, "batch": batch, "prompt_len": prompt_len,
            "prefill_tok_s": round(batch * prompt_len / _median(prefill_s), 1),
            "first_token_ms": round(1e3 * _median(first_s), 2),
            "decode_tok_s": round(batch / step, 1), "ms_per_token": round(1e3 * step, 3),
            "weight_bytes_per_token": step_bytes // batch,
            "achieved_gb_s": round(step_bytes / step / 1e9, 2),
            "decode_cpu_cores": round(sum(decode_cpu_s) / sum(decode_s), 2),
            "load_avg": round(load, 2), "steal_cpus": steal, "kv_cache_mib": round(kv_bytes / 2**20, 2)}


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo (lscpu's "Model name") gives it, else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> dict:
    """What a figure depends on besides the model: the CPU, the Numba target and the block kernels' variant."""
    from .kernels.quant.intrinsics import variant

    import llvmlite.binding

    return {"cpu": cpu_model(), "numba_cpu": numba.config.CPU_NAME or llvmlite.binding.get_host_cpu_name(),
            "kernels": variant()}


def _blas_threads() -> int:
    from threadpoolctl import threadpool_info

    return max((pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"), default=1)


def run(args) -> int:
    """The `npllm bench` command: each backend in a fresh process (own memory peak, own thread pools)."""
    for backend in args.backend:
        resolve_backend(backend)
    if len(args.backend) == 1:
        if args.threads is not None and args.backend[0] == "numpy":
            limit_blas_threads(args.threads)
        for i, result in enumerate(bench_backend(args.model, args.backend[0], args.threads, args.batch,
                                                 args.prompt_len, args.gen_len, args.repeat, args.bandwidth_mib,
                                                 args.weight_dtype, args.kv_dtype)):
            if i == 0 and not args.json:  # once, on stderr (stdout: a line per figure): the machine they are of
                print(f"[npllm] CPU: {result['cpu']} (Numba target {result['numba_cpu']}); block kernels: "
                      f"{result['kernels']}", file=sys.stderr, flush=True)
            print_result(result, args.json)
        return 0
    for backend in args.backend:
        command = [sys.executable, "-m", "npllm", "bench", "--model", args.model, "--backend", backend,
                   "--batch", *map(str, args.batch), "--prompt-len", *map(str, args.prompt_len),
                   "--gen-len", str(args.gen_len), "--repeat", str(args.repeat),
                   "--bandwidth-mib", str(args.bandwidth_mib), "--weight-dtype", args.weight_dtype,
                   "--kv-dtype", *args.kv_dtype, "--json"]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        child = subprocess.run(command, stdout=subprocess.PIPE, env=os.environ.copy(), text=True)
        if child.returncode:
            return child.returncode
        for line in child.stdout.splitlines():
            print_result(json.loads(line), args.json)
    return 0


def print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
        return
    random = " (random weights: no checkpoint of that name on disk)" if result.get("weights") == "random" else ""
    print(f"{result['model']}{random} {result['backend']} threads={result['threads']} ({result['threads_wait']}) "
          f"kv={result['kv_dtype']} "
          f"batch={result['batch']} "
          f"prompt={result['prompt_len']}: prefill {result['prefill_tok_s']:.0f} tok/s, first token "
          f"{result['first_token_ms']:.1f} ms (cold {result['first_token_cold_ms']:.0f} ms), decode "
          f"{result['decode_tok_s']:.1f} tok/s ({result['ms_per_token']:.2f} ms/step), "
          f"{result['achieved_gb_s']:.1f} of {result['bandwidth_gb_s']:.1f} GB/s, peak RSS "
          f"{result['peak_rss_mb']:.0f} MB{_steal_warning(result.get('steal_cpus'))}", flush=True)


def _steal_warning(steal: float | None) -> str:
    """A note on a figure the host took time from (steal_cpus above ~0.05), else nothing."""
    return f" (steal {steal:.2f} CPUs: the host ran other guests meanwhile)" if steal and steal >= 0.05 else ""
