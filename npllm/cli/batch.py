"""npllm batch: a JSONL file of requests (npllm.batch), in this process or on Ray Data (npllm.ray)."""

from __future__ import annotations

import sys

from . import shared
from .parser import BATCH_NEEDS, check_combinations
from .shared import check_template_limits


def run_batch(args) -> int:
    """npllm batch: the input's requests without a result in the output, in this process or on Ray Data; one
    summary line on stderr, nothing on stdout."""
    from ..batch import Runner, chat_template_for, errors_path, output_lock, plan, prefix_line, run

    check_combinations(args, needs=BATCH_NEEDS)
    check_template_limits()
    errors = args.errors or str(errors_path(args.output))
    if args.ray is not None:
        from ..ray import run_batch as run_on_ray

        if args.chat_template is not None:
            chat_template_for(args.chat_template, None)  # a template that cannot be read: an error before Ray starts
        summary = run_on_ray(args.model, args.input, args.output, errors, address=args.ray or None,
                             workers=args.workers, batch_size=args.batch_size, max_line_bytes=args.max_line_bytes,
                             tokenizer=args.tokenizer, backend=args.backend, threads=args.threads,
                             chat_template=args.chat_template, weight_dtype=args.weight_dtype,
                             kv_dtype=args.kv_dtype, context=args.context)
    else:
        from ..chat import chat_template_name

        with output_lock(args.output):  # held from the reading of the output to the last result written
            work = plan(args.input, args.output, errors, args.max_line_bytes)  # bad files: refused before the load
            llm = shared.load_with_tokenizer(args, kv_dtype=args.kv_dtype, prefix_cache_mib=args.prefix_cache_mib)
            template, problem = chat_template_for(args.chat_template, llm.source, llm.config.arch)
            runner = Runner(llm, None, template, problem, chat_template_name(args.chat_template, llm.source),
                            args.batch_size)
            summary = run(runner, work, args.output, errors)
            if runner.engine.prefix is not None:
                print(prefix_line(runner.engine.prefix.stats), file=sys.stderr)
    print(summary.line(args.output, errors), file=sys.stderr)
    return 0
