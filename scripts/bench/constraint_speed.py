"""Structured outputs' cost: compile time per schema and the mask's time per token (p50 / p99), on a tokenizer.

    python scripts/bench/constraint_speed.py [--tokenizer PATH] [--walks 20] [--steps 64]
    python scripts/bench/constraint_speed.py --decode MODEL [--backend numba] [--tokens 200] [--rounds 3]

For each schema below: the compile time (Constraint.json + bind: llguidance builds its lexer and parser for the
vocabulary; bind is kept per constraint, so a second request with the same schema pays nothing) and the first
mask's time (llguidance builds part of its lexer lazily there), then random walks
through the language, timing at each step llguidance's bitmask alone ("engine") and npllm's whole
ConstraintState.allowed() (the bitmask unpacked to a [V] bool array with the stop ids set: "allowed"). The
vocabulary's byte table is built once per tokenizer and timed apart. With --decode MODEL: decode tok/s of one
prompt with and without a constraint that never ends early (a regex over letters and spaces, EOS ignored), the two
alternated in one process, and their ratio. docs/structured.md quotes the figures.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from npllm.constraint import Constraint, Vocabulary
from npllm.tokenizer import load_tokenizer

SCHEMAS = {
    "any JSON": {},
    "object, 3 fields": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                           "age": {"type": "integer", "minimum": 0},
                                                           "ok": {"type": "boolean"}},
                         "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested, $ref, anyOf": {
        "type": "object", "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"},
                                                                            "y": {"type": "number"}},
                                          "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1, "maxItems": 8},
                       "label": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}]},
                       "kind": {"enum": ["line", "polygon", "cloud"]}},
        "required": ["points", "label", "kind"], "additionalProperties": False},
}


def walk(bound, eos: int, steps: int, rng) -> tuple[list[float], list[float]]:
    """One random walk: per step, (engine seconds, allowed() seconds)."""
    state, engine, whole = bound.start(), [], []
    matcher = state._matcher
    for _ in range(steps):
        copy = matcher.deep_copy()
        t0 = time.perf_counter()
        copy.compute_bitmask()
        t1 = time.perf_counter()
        allowed = state.allowed([eos])
        t2 = time.perf_counter()
        engine.append(t1 - t0)
        whole.append(t2 - t1)
        if state.finished:
            break
        token = int(rng.choice(np.flatnonzero(allowed)))
        if token == eos:
            break
        state.advance(token)
    return engine, whole


def decode_ratio(model: str, backend: str, tokens: int, rounds: int) -> None:
    import npllm

    llm = npllm.load(model, backend=backend)
    constraint = Constraint.regex("[a-z ,.]{0,100000}")
    llm.generate("Once upon a time", 8, ignore_eos=True)  # compile and warm up both paths
    llm.generate("Once upon a time", 8, ignore_eos=True, constraint=constraint)
    rates = {"plain": [], "constrained": []}
    for _ in range(rounds):
        for name, extra in (("plain", {}), ("constrained", {"constraint": constraint})):
            t = time.perf_counter()
            llm.generate("Once upon a time", tokens, ignore_eos=True, seed=0, **extra)
            rates[name].append(tokens / (time.perf_counter() - t))
    plain, constrained = (float(np.median(rates[k])) for k in ("plain", "constrained"))
    print(f"{model} ({backend}): {tokens} tokens, median of {rounds}: plain {plain:.1f} tok/s, constrained "
          f"{constrained:.1f} tok/s, ratio {constrained / plain:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="/work/shared/weights/llama2-tokenizer/tokenizer.model")
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--decode", default=None, metavar="MODEL", help="measure decode tok/s with and without")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.decode:
        return decode_ratio(args.decode, args.backend, args.tokens, args.rounds)
    tok = load_tokenizer(args.tokenizer)
    t = time.perf_counter()
    Vocabulary.of(tok, tok.vocab_size)
    print(f"{args.tokenizer}: {tok.vocab_size} ids; byte table and llguidance tokenizer built in "
          f"{time.perf_counter() - t:.2f} s (once per tokenizer)")
    rng = np.random.default_rng(0)
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        bound = Constraint.json(schema).bind(tok)
        compile_ms = 1e3 * (time.perf_counter() - t)
        t = time.perf_counter()
        bound.start().allowed([tok.eos_id])  # llguidance builds parts of its lexer lazily, on the first masks
        first_ms = 1e3 * (time.perf_counter() - t)
        engine, whole = [], []
        for _ in range(args.walks):
            e, w = walk(bound, tok.eos_id, args.steps, rng)
            engine += e
            whole += w
        e_us, w_us = 1e6 * np.array(engine), 1e6 * np.array(whole)
        print(f"{name:20s} compile {compile_ms:5.1f} ms, first mask {first_ms:5.1f} ms | {len(e_us)} masks: engine p50 {np.percentile(e_us, 50):6.0f}"
              f" us p99 {np.percentile(e_us, 99):6.0f} us | allowed() p50 {np.percentile(w_us, 50):6.0f} us p99 "
              f"{np.percentile(w_us, 99):6.0f} us")


if __name__ == "__main__":
    main()
