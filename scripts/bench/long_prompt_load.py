"""Long prompts under concurrency: how long a short completion waits while clients send prompts that cannot fit.

    python scripts/bench/long_prompt_load.py [--model stories260K] [--backend numpy] [--clients 8]
                                             [--prompt-bytes 1048576] [--probes 40] [--interval 0.25]
                                             [--seconds 90] [--json]

`npllm serve` runs in a child process on 127.0.0.1 (a free port). --clients threads each send, again and again, a
/v1/completions body of --prompt-bytes bytes (its prompt plain story text, sized so the whole body is that long and
fits the server's default 1 MiB body limit): far past any context, so each must be refused. Meanwhile one more
client sends --probes 3-token completions ("Once upon a time", max_tokens 3), one every --interval seconds, and
times each. It reports the probes' latency (p50, p99, max) and statuses, the long prompts' statuses and latencies,
and the lines the server wrote on stderr (tracebacks, warnings). Everything is bounded: the probes by their count,
the whole run by --seconds (requests in flight then are waited for, each at most its 120 s timeout).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
         "friend Ben. One day, they saw a big red ball under a tree. ")
PROBE = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
TIMEOUT = 120.0


def start_server(args) -> tuple[subprocess.Popen, int, list[str]]:
    """`npllm serve` in a child process; its port once it says it serves, and its stderr lines (collected on)."""
    argv = [sys.executable, "-m", "npllm", "serve", "--model", args.model, "--backend", args.backend,
            "--host", "127.0.0.1", "--port", "0", "--grace", "1"]
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            break
    else:
        raise SystemExit(f"npllm serve ended before it listened: {''.join(lines)[-800:]}")

    def collect():
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=collect, daemon=True).start()
    return proc, int(found.group(1)), lines


def long_body(size: int) -> bytes:
    """A completion body of exactly `size` bytes whose prompt is story text."""
    head, tail = b'{"max_tokens": 3, "prompt": "', b'"}'
    room = size - len(head) - len(tail)
    text = (STORY * (room // len(STORY) + 1))[:room].encode()
    return head + text + tail


def post(client: httpx.Client, url: str, **kwargs) -> tuple[int | None, float]:
    """(status, seconds) of one POST; status None when the connection failed or timed out."""
    start = time.monotonic()
    try:
        status = client.post(url, timeout=TIMEOUT, **kwargs).status_code
    except httpx.HTTPError:
        status = None
    return status, time.monotonic() - start


def flood(url: str, body: bytes, stop: threading.Event, seen: list) -> None:
    """Send the long body again and again until `stop`."""
    with httpx.Client() as client:
        while not stop.is_set():
            seen.append(post(client, url, content=body, headers={"content-type": "application/json"}))


def probe(url: str, count: int, interval: float, deadline: float, seen: list) -> None:
    with httpx.Client() as client:
        for _ in range(count):
            if time.monotonic() > deadline:
                return
            started = time.monotonic()
            seen.append(post(client, url, json=PROBE))
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(a), "p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3)}


def run(args) -> dict:
    proc, port, lines = start_server(args)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        assert httpx.post(url, json=PROBE, timeout=TIMEOUT).status_code == 200  # warm: the first call compiles
        logged_before = len(lines)
        stop, long_seen, probe_seen = threading.Event(), [], []
        body = long_body(args.prompt_bytes)
        floods = [threading.Thread(target=flood, args=(url, body, stop, long_seen), daemon=True)
                  for _ in range(args.clients)]
        for thread in floods:
            thread.start()
        time.sleep(args.interval)  # the long prompts are on their way
        started = time.monotonic()
        probe(url, args.probes, args.interval, started + args.seconds, probe_seen)
        stop.set()
        for thread in floods:
            thread.join(TIMEOUT + 5)
        logged = lines[logged_before:]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"clients": args.clients, "prompt_bytes": args.prompt_bytes, "seconds": round(time.monotonic() - started, 1),
            "probe_latency_s": percentiles([t for s, t in probe_seen if s == 200]),
            "probe_statuses": dict(collections.Counter(str(s) for s, _ in probe_seen)),
            "long_statuses": dict(collections.Counter(str(s) for s, _ in long_seen)),
            "long_latency_s": percentiles([t for _, t in long_seen]),
            "server_log_lines": len(logged), "server_tracebacks": sum("Traceback" in line for line in logged)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--backend", default="numpy", help="numpy (default: no compile wait) or numba")
    parser.add_argument("--clients", type=int, default=8, help="threads sending long prompts")
    parser.add_argument("--prompt-bytes", type=int, default=1 << 20, help="size of each long body")
    parser.add_argument("--probes", type=int, default=40, help="3-token completions timed")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between two probes' starts")
    parser.add_argument("--seconds", type=float, default=90.0, help="no probe starts after this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:18} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
