"""Load test for `npllm serve`, on this machine's loopback only: N clients x M streamed requests each, against the
same N x M requests served one after another.

    python scripts/load_test.py [--model stories260K] [--tokenizer T] [--clients 1 2 4 8] [--requests 4]
                                [--max-tokens 64] [--slots 8] [--time-limit 300] [--json]

The server runs as a child process (`npllm serve` on 127.0.0.1, a free port), so its engine thread does not share
an interpreter lock with the clients. --model is a checkpoint (path or known name) or a named shape of
npllm.formats.random (stories15M, ...) with random weights and --tokenizer: the arithmetic, and so the speed, is a
real model's. Every request asks for exactly --max-tokens tokens (the stop tokens get logit_bias -100), greedy.

For each N it reports:
    tok/s        completion tokens of all N x M requests / wall time from the first send to the last token
    TTFT         p50 / p99 time from sending a request to its first token
    ITL          p50 / p99 time between successive tokens of one request
and the same for the N x M requests sent one after another by a single client ("serial"). The run stops early, and
says so, once --time-limit seconds have passed (each row is bounded by its requests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PROMPTS = ["Once upon a time", "The little dog ran", "Lily and Ben went to the park", "One day, a bird",
           "Tom had a red ball and", "The sun was hot, so", "Sam wanted to play", "There was a big tree"]

CHILD = r"""
import sys
from npllm.serve.app import Limits, Server, run
model, tokenizer, backend, slots = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4])
try:
    import npllm
    llm = npllm.load(model, tokenizer, backend=backend)
except Exception:  # not a checkpoint: a named shape with random weights
    from npllm.bench import load_weights
    from npllm.llm import LLM
    from npllm.models import make_model
    from npllm.tokenizer import load_tokenizer
    config, weights, _ = load_weights(model)
    llm = LLM(make_model(config, weights, backend), load_tokenizer(tokenizer))
sys.exit(run(Server(llm, "load-test", Limits(max_slots=slots, max_queue=4096, max_tokens_limit=100000)),
             "127.0.0.1", 0, grace=1.0))
"""


def start_server(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, args.model, args.tokenizer or "", args.backend,
                             str(args.slots)], stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"the server did not start (exit status {proc.wait()})")
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return proc, found.group(1)


def one_request(client, url: str, prompt: str, max_tokens: int, stop_ids: list[int]) -> dict:
    """One streamed greedy completion: its send time, each token's arrival time, its token count."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in stop_ids}, "stream_options": {"include_usage": True}}
    sent, arrivals, tokens = time.perf_counter(), [], 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens}


def run_clients(url: str, n: int, m: int, max_tokens: int, stop_ids: list[int]) -> tuple[list[dict], float]:
    """n threads, each sending its m requests one after another; (results, wall seconds)."""
    import httpx

    results: list[dict] = []
    lock = threading.Lock()

    def client_loop(k: int) -> None:
        with httpx.Client(timeout=600) as client:
            for j in range(m):
                got = one_request(client, url, PROMPTS[(k * m + j) % len(PROMPTS)], max_tokens, stop_ids)
                with lock:
                    results.append(got)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def summary(results: list[dict], seconds: float) -> dict:
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    itl = np.concatenate([np.diff(r["arrivals"]) for r in results if len(r["arrivals"]) > 1] or [np.zeros(0)])
    tokens = sum(r["tokens"] for r in results)

    def ms(values, q):
        return round(1e3 * float(np.percentile(values, q)), 2) if len(values) else float("nan")

    return {"requests": len(results), "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1), "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--tokenizer", default=None, help="tokenizer file (needed for a named random shape)")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=4, help="requests per client (M)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=300.0, help="stop starting new rows after this many s")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if min(args.clients) < 1 or args.requests < 1 or args.max_tokens < 1 or max(args.clients) * args.requests > 4096:
        raise SystemExit("clients, requests and max-tokens must be positive, and clients x requests at most 4096")
    proc, url = start_server(args)
    deadline = time.monotonic() + args.time_limit
    try:
        stop_ids = [1, 2]  # BOS and EOS of llama2.c-style vocabularies: forbidden, so every request runs in full
        run_clients(url, 1, 1, 8, stop_ids)  # warm-up (compilation, first allocations)
        rows = []
        for n in args.clients:
            if time.monotonic() > deadline:
                print(f"[load_test] time limit reached; skipped N >= {n}", file=sys.stderr)
                break
            together = summary(*run_clients(url, n, args.requests, args.max_tokens, stop_ids))
            serial = summary(*run_clients(url, 1, n * args.requests, args.max_tokens, stop_ids))
            rows.append({"clients": n, "concurrent": together, "serial": serial})
            print_row(rows[-1], args.json)
    finally:
        proc.terminate()
        proc.wait(30)


def print_row(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    c, s = row["concurrent"], row["serial"]
    print(f"N={row['clients']:<3} {c['requests']:>4} req {c['tokens']:>6} tok | concurrent {c['tok_s']:>8.1f} tok/s "
          f"TTFT p50 {c['ttft_p50_ms']:>7.1f} p99 {c['ttft_p99_ms']:>7.1f} ms ITL p50 {c['itl_p50_ms']:>6.1f} "
          f"p99 {c['itl_p99_ms']:>6.1f} ms | serial {s['tok_s']:>8.1f} tok/s TTFT p50 {s['ttft_p50_ms']:>6.1f} ms "
          f"ITL p50 {s['itl_p50_ms']:>6.1f} ms | x{c['tok_s'] / s['tok_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
