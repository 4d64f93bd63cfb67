"""npllm's command line: it parses arguments and calls the Python API, nothing more.

    npllm generate [PROMPT] --model M --tokenizer T --max-new-tokens N --temperature T --top-p P --seed S
                            --top-k K --min-p P --typical-p P --repetition-penalty R --presence-penalty A
                            --frequency-penalty A --no-repeat-ngram N --stop STR --logprobs N
                            --backend numba|numpy|cuda|auto --threads N --weight-dtype file|float32|float16|q8_0
                            --kv-dtype float32|float16 --context N --context-policy error|truncate|sinks --sinks S
                            --ignore-eos
    npllm generate --prompt-file FILE ...      one prompt per line, generated together (ragged batching)
    npllm generate [PROMPT] ... --explain [--json]     (each token's candidates through the sampling pipeline)
    npllm chat --model M [--system S] [--chat-template NAME|FILE] [sampling options] [--context-policy P]
                                               a conversation: one user turn per line, replies streamed
    npllm quantize IN OUT --type q8_0|q4_0|q4_k|q6_k|f16|...     any checkpoint npllm reads, written as GGUF
                                               (IN also as --model IN, as every command takes it)
    npllm perplexity --model M --text FILE [--ctx N] [--batch B] [--stride S] [--kl-divergence BASE] [--json]
    npllm embed --model M [--input FILE] [--pooling last|mean|cls] [--[no-]normalize]
                                               one embedding per line of text, as JSON lines
    npllm bench --model NAME_OR_PATH [--batch B ...] [--prompt-len N ...] [--gen-len N] [--backend B ...]
                [--threads T] [--weight-dtype D] [--kv-dtype D ...] [--repeat R] [--json]
    npllm info [MODEL | --model MODEL]         architecture, size, context and tokenizer of a checkpoint
    npllm serve --model M [--host H] [--port P] [--api-key K] [--chat-template NAME|FILE] [--max-slots N]
                [--max-queue N] [--max-tokens-limit N] [--cors-origin URL] [--max-connections N]
                [--header-timeout S] [--body-timeout S] [--keep-alive-timeout S]   an OpenAI-compatible HTTP server
    npllm batch --model M --input IN.jsonl --output OUT.jsonl [--ray [ADDRESS]] [--workers N] [--batch-size B]
                [--errors FILE] [--chat-template NAME|FILE] [--max-line-bytes N]
                                                       a JSONL file of requests, resumable (docs/batch.md)

stdout gets the prompt followed by the completion and nothing else (with --prompt-file, each prompt and its
completion, separated by blank lines); timings go to stderr. PROMPT "-" reads the prompt from stdin.

Every input is checked before anything reaches stdout: a bad request prints one `npllm: error:` line on stderr and
exits 2. So is an option that the mode it is given in would ignore (--num-beams with --temperature, --prompt-file
with --draft, ...: npllm.cli.parser's tables GENERATE_MODES, GENERATE_NEEDS, CHAT_NEEDS, ...), before any model
loads. A reader that closes the pipe early (`| head`) ends the run quietly with status 141 (128 + SIGPIPE, what
the shell reports for a program the closed pipe stopped); Ctrl-C ends the line it interrupted and exits 130.

The package: parser.py holds the parser and its tables (each command's options, which go together), one module per
command runs it (generate.py, chat.py, ...: each a run_* function), shared.py what they share (loading a model with
its tokenizer, the sampling flags' SamplingParams, stdout), notice.py the first run's compile notice; main, here,
hands the parsed arguments to the command's run_*.
"""

from __future__ import annotations

import os
import sys

from ..errors import NpllmError
from . import shared
from .batch import run_batch
from .bench import run_bench
from .chat import run_chat
from .generate import run_generate, timing_line
from .info import run_info
from .notice import compile_notice
from .parser import (CHAT_NEEDS, GENERATE_MODES, GENERATE_NEEDS, PERPLEXITY_MODES, QUANTIZE_TYPES,
                     add_sampling_arguments, build_parser, check_combinations, flag, given_options)
from .embed import run_embed
from .perplexity import run_perplexity
from .quantize import quantize_progress, run_quantize
from .serve import run_serve, serve_chat_template
from .shared import cold_start, sampling_params

# npllm.__main__, the `npllm` script and the tests import these from npllm.cli.
__all__ = ["main", "build_parser", "add_sampling_arguments", "sampling_params", "cold_start", "compile_notice",
           "given_options", "flag", "check_combinations", "GENERATE_MODES", "GENERATE_NEEDS", "CHAT_NEEDS",
           "PERPLEXITY_MODES", "QUANTIZE_TYPES", "timing_line", "quantize_progress", "serve_chat_template"]

# Each command of build_parser and the function that runs it.
RUNS = {"generate": run_generate, "chat": run_chat, "info": run_info, "quantize": run_quantize, "bench": run_bench,
        "perplexity": run_perplexity, "embed": run_embed, "serve": run_serve, "batch": run_batch}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with compile_notice(getattr(args, "compiles", False)):
            return RUNS[args.command](args)
    except NpllmError as e:
        print(f"npllm: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # a request larger than this machine: one line, not a traceback
        print(f"npllm: error: out of memory ({e or 'an allocation failed'}): ask for less (a shorter context, "
              f"fewer tokens or sequences)", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more can be shown. Point stdout at /dev/null so the interpreter's
        # final flush does not fail again, and exit as a program stopped by SIGPIPE would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        try:
            if shared._open_line:  # the module's, as write_out last left it
                shared.write_out("\n")
            print("npllm: interrupted", file=sys.stderr)
        except BrokenPipeError:
            pass
        return 130
