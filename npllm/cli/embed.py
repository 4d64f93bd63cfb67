"""npllm embed: one embedding per line of text, written as JSON lines {"index": i, "embedding": [...]}."""

from __future__ import annotations

import json
import sys

from ..errors import GenerationError
from . import shared


def run_embed(args) -> int:
    texts = read_lines(args.input)
    llm = shared.load_with_tokenizer(args)
    vectors = llm.embed(texts, args.pooling, args.normalize) if texts else []  # every text checked before any output
    for i, vector in enumerate(vectors):
        print(json.dumps({"index": i, "embedding": [float(v) for v in vector]}))
    print(f"[npllm] {len(texts)} embeddings", file=sys.stderr)
    return 0


def read_lines(path: str) -> list[str]:
    """The texts to embed: the file's (or stdin's) lines, without their line ends; an empty line is refused (it has
    no tokens to pool) with its line number."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--input {path}: cannot read it ({e})") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise GenerationError(f"--input {path}: line {number} is empty (one text per line)")
    return lines
