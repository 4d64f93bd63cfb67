"""The chat examples of docs/serve.md and docs/batch.md work as written: their command lines (what they pass, the
chat template above all) and their requests, read out of the docs, run on stories260K, a llama2.c model that ships
no chat template just as the docs' stories15M does."""

import json
import re
import shlex

import pytest

import npllm
from npllm import cli
from tests_support import REPO

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e '.[serve]')")


def code_blocks(doc: str, language: str) -> list[str]:
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def commands(doc: str, start: str) -> list[list[str]]:
    """The doc's bash lines that run `start` (comments dropped, continuation lines joined), split as a shell
    would."""
    found = []
    for block in code_blocks(doc, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:len(start.split())] == start.split():
                found.append(words)
    return found


def with_model(argv: list[str], model, **flags) -> list[str]:
    """argv (without its leading "npllm") with --model replaced by `model` and each flag=value set."""
    args = list(argv[1:])
    for flag, value in {"--model": str(model), **flags}.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def test_the_serve_docs_chat_request_succeeds(stories260k):
    from starlette.testclient import TestClient

    from npllm.serve.app import Limits, Server, create_app

    (serve,) = commands("serve.md", "npllm serve")
    args = cli.build_parser().parse_args(with_model(serve, stories260k, **{"--backend": "numpy"}))
    (curl,) = [c for c in commands("serve.md", "curl") if any(w.endswith("/v1/chat/completions") for w in c)]
    body = json.loads(curl[curl.index("-d") + 1])
    llm = npllm.load(args.model, backend=args.backend)
    template, problem = cli.serve_chat_template(args.chat_template, llm.source, llm.config.arch)
    server = Server(llm, "stories260K", Limits(), template, problem)
    server.start()
    try:
        reply = TestClient(create_app(server)).post("/v1/chat/completions", json=body)
    finally:
        server.close()
    assert reply.status_code == 200, reply.text
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert reply.text.rstrip().endswith("data: [DONE]")


def test_the_batch_docs_chat_line_succeeds(stories260k, tmp_path, capsys):
    lines = [line for line in code_blocks("batch.md", "json")[0].splitlines() if line.strip()]
    assert any("messages" in json.loads(line) for line in lines)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    here = [c for c in commands("batch.md", "npllm batch") if "--ray" not in c][0]
    argv = with_model(here, stories260k, **{"--backend": "numpy", "--input": str(tmp_path / "in.jsonl"),
                                             "--output": str(tmp_path / "out.jsonl")})
    assert cli.main(argv) == 0, capsys.readouterr().err
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == [json.loads(line)["id"] for line in lines]
    assert not (tmp_path / "out.errors.jsonl").exists() or not (tmp_path / "out.errors.jsonl").read_text().strip()
