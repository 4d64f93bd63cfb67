"""npllm chat: a conversation in the model's chat template (npllm.chat.repl), one user turn per line."""

from __future__ import annotations

from . import shared
from .parser import CHAT_NEEDS, check_combinations
from .shared import check_template_limits, context_options, sampling_params, write_out


def run_chat(args) -> int:
    from ..chat.repl import run

    check_combinations(args, needs=CHAT_NEEDS)
    check_template_limits()
    params = sampling_params(args)  # checked before the model loads
    constraint = shared.constraint_of(args)
    llm = shared.load_with_tokenizer(args, kv_dtype=args.kv_dtype)
    return run(llm, args, params, context_options(args), write_out, llm.bind_constraint(constraint))
