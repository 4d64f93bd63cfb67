"""npllm serve: the OpenAI-compatible HTTP server (npllm.serve), its socket bound before the model loads."""

from __future__ import annotations

import sys

from ..errors import NpllmError
from . import shared
from .shared import check_template_limits


def run_serve(args) -> int:
    from pathlib import Path

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise NpllmError("npllm serve needs the serve extra: pip install -e '.[serve]' in npllm's folder "
                         "(Starlette and uvicorn)") from None
    from ..chat import chat_template_name
    from ..serve.app import Limits, Server, bind, check_api_key, run

    check_api_key(args.api_key)
    check_template_limits()
    sock = bind(args.host, args.port)  # before the model loads: a port in use is an error at once
    try:
        llm = shared.load_with_tokenizer(args, prefix_cache_mib=args.prefix_cache_mib)
        template, problem = serve_chat_template(args.chat_template, llm.source, llm.config.arch)
        limits = Limits(args.max_slots, args.max_queue, args.max_tokens_limit, args.max_body_bytes,
                        args.max_connections, args.header_timeout, args.body_timeout, args.keep_alive_timeout)
        server = Server(llm, args.served_model_name or Path(args.model).stem or str(args.model), limits, template,
                        problem, args.api_key, template_name=chat_template_name(args.chat_template, llm.source))
        return run(server, args.host, args.port, args.grace, args.cors_origin, sock=sock)
    finally:
        sock.close()


def serve_chat_template(spec: str | None, checkpoint: str, arch: str | None = None) -> tuple[str | None, str]:
    """(template, "") for the chat endpoint; (None, why) when the model ships none and none was named, so the
    server still serves completions and the chat endpoint answers 400 with the reason. A named template that
    cannot be read stops the server at once."""
    from ..batch import chat_template_for

    template, problem = chat_template_for(spec, checkpoint, arch)
    if problem:
        print(f"[npllm] /v1/chat/completions is off: {problem}", file=sys.stderr)
    return template, problem
