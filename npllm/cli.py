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
with --draft, ...: the tables GENERATE_MODES, GENERATE_NEEDS, CHAT_NEEDS, PERPLEXITY_MODES), before any model
loads. A reader that closes the pipe early (`| head`) ends the run quietly with status 141 (128 + SIGPIPE, what
the shell reports for a program the closed pipe stopped); Ctrl-C ends the line it interrupted and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

from .errors import ConfigError, GenerationError, NpllmError
from .models import KV_DTYPES, WEIGHT_DTYPES
from .quant import MIXTURES, QUANTIZE
from .sampling import Option, SamplingParams, options


class Parser(argparse.ArgumentParser):
    """argparse, but a refused argument (a bad value, an unknown flag or choice, a missing argument) is one
    `npllm: error:` line and exit status 2, as npllm's own errors are: argparse's default prints the whole usage
    block first, which buries the one line that says what is wrong. The subcommands' parsers are of this class too
    (add_subparsers makes them with the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"npllm: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="npllm", description="A readable NumPy Llama inference engine.")
    parser.add_argument("--version", action="version", version=f"npllm {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (add_generate, add_chat, add_info, add_quantize, add_bench, add_perplexity, add_serve, add_batch):
        add(commands)
    return parser


def package_version() -> str:
    """The installed distribution's version (its metadata); from a source tree that is not installed, the
    package's own __version__."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("npllm-engine")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="continue a prompt, streaming text to stdout")
    gen.add_argument("prompt", nargs="?", default="",
                     help="text to continue ('-': read it from stdin; default: start from BOS)")
    add_model_arguments(gen)
    gen.add_argument("--max-new-tokens", type=whole(0), default=256, help="most tokens to generate (default 256)")
    add_sampling_arguments(gen)
    add_context_arguments(gen)
    gen.add_argument("--prompt-file", default=None,
                     help="a file with one prompt per line (blank lines skipped), all generated as one batch")
    gen.add_argument("--explain", action="store_true",
                     help="for each token, a table of the top candidates through every sampling stage")
    gen.add_argument("--json", action="store_true", help="with --explain: one JSON object per token instead")
    gen.add_argument("--draft", default=None, metavar="MODEL",
                     help="speculative decoding: a smaller model with the same vocabulary proposes tokens")
    gen.add_argument("--draft-layers", type=whole(1, MOST_LAYERS), default=None, metavar="N",
                     help="speculative decoding with this model's first N layers as the draft")
    gen.add_argument("--num-draft", type=whole(1, MOST_DRAFT), default=4, metavar="K",
                     help="tokens drafted per round (default 4)")
    gen.add_argument("--num-beams", type=whole(1, MOST_BEAMS), default=1, metavar="B",
                     help="beam search with B beams (greedy, deterministic): prints the best hypothesis")
    gen.set_defaults(run=run_generate, compiles=True, command_parser=gen)


def add_chat(commands) -> None:
    chat = commands.add_parser("chat", help="talk with a model in its chat template, replies streamed")
    add_model_arguments(chat)
    chat.add_argument("--system", "-s", default=None, help="the system message")
    chat.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                      help="llama2, llama3, chatml, zephyr, mistral, gemma, phi3, granite, olmo2, or a .jinja / "
                           "tokenizer_config.json file "
                           "(default: the model's own)")
    chat.add_argument("--max-new-tokens", type=whole(0), default=256, help="most tokens per reply (default 256)")
    add_sampling_arguments(chat)
    add_context_arguments(chat)
    chat.set_defaults(run=run_chat, compiles=True, command_parser=chat)


def add_context_arguments(parser) -> None:
    parser.add_argument("--context-policy", choices=("error", "truncate", "sinks"), default="error",
                        help="past the context: error (stop there, the default), truncate (recompute over the "
                             "most recent half context) or sinks (StreamingLLM: first tokens + recent window)")
    parser.add_argument("--sinks", type=whole(0, MOST_TOKENS), default=4,
                        help="attention sinks kept with --context-policy sinks (default 4)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def context_options(args) -> dict:
    return {"context_policy": args.context_policy, "sinks": args.sinks, "ignore_eos": args.ignore_eos}


def add_sampling_arguments(parser, params_type: type = SamplingParams) -> None:
    """One flag per SamplingParams field that has one, built from the field's Option (npllm.sampling): its name,
    type and range, default and help. A value the parser lets through is checked by SamplingParams itself."""
    for f, option in options(params_type):
        if option.flag is not None:
            parser.add_argument(option.flag, dest=f.name, **flag_spec(option, f.default))


def flag_spec(option: Option, default) -> dict:
    """argparse's keywords for an Option's flag: "real" -> float, "integer" -> int (whole(least, most) when it has
    bounds), "text" -> a repeatable string."""
    default = default if option.cli_default is None else option.cli_default
    spec = {"help": option.help, "metavar": option.metavar}
    if option.kind == "text":
        return {**spec, "action": "append", "default": []}
    if option.kind == "real":
        return {**spec, "type": float, "default": default}
    if option.kind == "integer":
        kind = int if option.least is None else whole(option.least, option.most)
        return {**spec, "type": kind, "default": default}
    raise ValueError(f"a {option.kind!r} option has no command-line flag; give it flag=None")


def add_info(commands) -> None:
    info = commands.add_parser("info", help="describe a checkpoint: architecture, size, context, tokenizer")
    info.add_argument("model", nargs="?", default=None, help="checkpoint path or known name (default stories260K)")
    add_model_option(info)
    info.set_defaults(run=run_info)


def add_quantize(commands) -> None:
    quantize = commands.add_parser("quantize", help="write a checkpoint as a GGUF file of a quantized type")
    quantize.add_argument("input", nargs="?", default=None,
                          help="checkpoint path or known name (llama2.c .bin, HF directory, GGUF); or --model IN")
    quantize.add_argument("output", help="the GGUF file to write")
    add_model_option(quantize)
    quantize.add_argument("--type", "-t", default="q8_0", choices=QUANTIZE_TYPES,
                          help="type of the weight matrices (default q8_0), or a mixture: q4_k_m, q5_k_m (q4_k, q5_k "
                               "with q6_k for the LM head and some wv, w2); norms stay f32, rows that do not split "
                               "into the type's blocks fall back to q8_0 or f16")
    quantize.add_argument("--tokenizer", "-z", default=None, help="vocabulary to embed (default: found beside IN)")
    quantize.set_defaults(run=run_quantize)


def add_model_option(parser) -> None:
    """--model M for a command whose checkpoint is a positional argument (info, quantize): every command takes
    --model, so a user who learnt it on one can use it on all. one_model() reconciles the two."""
    parser.add_argument("--model", "-m", dest="model_option", default=None, metavar="MODEL",
                        help="the checkpoint, as the positional argument gives it (give one of the two)")


def one_model(positional: str | None, option: str | None, default: str | None = None) -> str:
    """The checkpoint a command was given, positionally or as --model (not both), else default."""
    if positional is not None and option is not None:
        raise ConfigError(f"the checkpoint is given twice, as {positional!r} and as --model {option!r}: give one")
    model = positional if positional is not None else option if option is not None else default
    if model is None:
        raise ConfigError("no checkpoint given: name it as the first argument or with --model")
    return model


def add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="prefill and decode throughput against the memory bandwidth")
    bench.add_argument("--model", "-m", default="stories15M",
                       help="checkpoint path, known name on disk, or a shape with random weights (default stories15M)")
    bench.add_argument("--batch", type=whole(1, MOST_BATCH), nargs="+", default=[1, 8],
                       help="sequences decoded together (default 1 8)")
    bench.add_argument("--prompt-len", type=whole(1, MOST_TOKENS), nargs="+", default=[128, 512],
                       help="prompt tokens (default 128 512)")
    bench.add_argument("--gen-len", type=whole(1, MOST_TOKENS), default=256, help="decode steps (default 256)")
    bench.add_argument("--backend", nargs="+", default=["numba"],
                       help="one or more of numba, numpy, cuda, auto (default numba)")
    bench.add_argument("--threads", type=whole(1, MOST_THREADS), default=None, help="cores to use (default: all)")
    bench.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="file",
                       help="how matrices are stored on every backend: file (each in its file type, the default), "
                       "float32, float16 or q8_0 blocks")
    bench.add_argument("--kv-dtype", choices=KV_DTYPES, nargs="+", default=["float32"],
                       help="KV cache storage, one or more, measured in turn on one model (default float32)")
    bench.add_argument("--repeat", type=whole(1, MOST_REPEAT), default=3,
                       help="runs per figure; medians are reported (default 3)")
    bench.add_argument("--bandwidth-mib", type=whole(1, MOST_MIB), default=512,
                       help="size of the bandwidth probe (default 512)")
    bench.add_argument("--json", action="store_true", help="one JSON object per line")
    bench.set_defaults(run=run_bench, compiles=True)


def add_perplexity(commands) -> None:
    ppl = commands.add_parser("perplexity", help="perplexity of a text (llama.cpp's method), or KL to a base model")
    add_model_arguments(ppl)
    ppl.add_argument("--text", "-f", required=True, help="a UTF-8 text file")
    ppl.add_argument("--ctx", type=whole(4, MOST_TOKENS), default=None,
                     help="tokens per chunk (default: min(512, the context))")
    ppl.add_argument("--batch", type=whole(1, MOST_BATCH), default=1,
                     help="chunks run together, one cache slot each (default 1)")
    ppl.add_argument("--stride", type=whole(1, MOST_TOKENS), default=None,
                     help="Hugging Face's strided method instead: windows of --ctx tokens, this many apart")
    ppl.add_argument("--kl-divergence", metavar="BASE_MODEL", default=None,
                     help="mean KL(base || model) and top-1 agreement against this model (same tokenizer)")
    ppl.add_argument("--json", action="store_true", help="one JSON object instead of a sentence")
    ppl.set_defaults(run=run_perplexity, compiles=True, command_parser=ppl)


def add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over continuous batching "
                                              "(needs the serve extra)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to all)")
    serve.add_argument("--port", type=whole(0, 65535), default=8000, help="TCP port (default 8000; 0: any free one)")
    serve.add_argument("--api-key", default=os.environ.get("NPLLM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $NPLLM_API_KEY, else no key)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send and /v1/models lists (default: the checkpoint's name)")
    serve.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                       help="template for /v1/chat/completions: a built-in (llama2, llama3, chatml, zephyr, "
                            "mistral, gemma, phi3, granite, olmo2) or a "
                            "file (default: the model's own; without one the chat endpoint answers 400)")
    serve.add_argument("--max-slots", type=whole(1, MOST_BATCH), default=8,
                       help="requests decoded together, one cache slot each (default 8)")
    serve.add_argument("--max-queue", type=whole(0, MOST_QUEUE), default=64,
                       help="requests waiting for a slot; beyond that the answer is 429 (default 64)")
    serve.add_argument("--max-tokens-limit", type=whole(1, MOST_TOKENS), default=4096,
                       help="largest max_tokens a request may ask for (default 4096)")
    serve.add_argument("--max-body-bytes", type=whole(1, MOST_BODY), default=1 << 20,
                       help="largest request body; bigger ones get 413 (default 1 MiB)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="URL",
                       help="allow browser pages from this origin (repeatable; default: no CORS headers)")
    serve.add_argument("--max-connections", type=whole(1, MOST_CONNECTIONS), default=256,
                       help="open connections at once; one more is answered 503 and closed (default 256; lowered "
                            "to what the open-files limit allows)")
    serve.add_argument("--header-timeout", type=seconds(), default=10.0,
                       help="seconds a client has to send a request's head; a slower connection is closed "
                            "(default 10)")
    serve.add_argument("--body-timeout", type=seconds(), default=30.0,
                       help="seconds a client has to send a request's body after its head; then 408 (default 30)")
    serve.add_argument("--keep-alive-timeout", type=seconds(), default=5.0,
                       help="seconds an idle connection stays open after a response (default 5)")
    serve.add_argument("--grace", type=seconds(0), default=10.0,
                       help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C (default 10)")
    serve.set_defaults(run=run_serve, compiles=True)


def add_batch(commands) -> None:
    batch = commands.add_parser("batch", help="a JSONL file of requests through the model, resumable, results in "
                                              "input order (docs/batch.md)")
    add_model_arguments(batch)
    batch.add_argument("--input", "-i", required=True,
                       help='requests, one JSON object a line: {"id", "prompt" or "messages", fields of the '
                            "server's requests (max_tokens, temperature, top_p, seed, stop, ...)}")
    batch.add_argument("--output", "-o", required=True,
                       help="results are appended here in input order; ids already in it are skipped")
    batch.add_argument("--errors", default=None,
                       help="bad lines, with their line number and reason (default: OUTPUT's name + .errors.jsonl)")
    batch.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="run on Ray Data: the cluster at ADDRESS, else $RAY_ADDRESS, else one on this machine "
                            "(needs the ray extra)")
    batch.add_argument("--workers", type=whole(1, MOST_BATCH), default=1,
                       help="with --ray: actors, each loading the model once (default 1)")
    batch.add_argument("--batch-size", type=whole(1, MOST_BATCH), default=8,
                       help="requests decoded together, one cache slot each (default 8; with --ray, also the rows "
                            "an actor takes at a time)")
    batch.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                       help='template for "messages" lines (default: the model\'s own)')
    batch.add_argument("--max-line-bytes", type=whole(1, MOST_BODY), default=4 << 20, metavar="N",
                       help="a longer input line is an error line, skipped unread (default 4 MiB)")
    batch.set_defaults(run=run_batch, compiles=True, command_parser=batch)


# Upper bounds on counts, far above any sensible use, so a typo cannot ask for a petabyte or a year of work.
MOST_THREADS = MOST_BATCH = 1 << 12
MOST_TOKENS = 1 << 24  # ModelConfig's MAX_CONTEXT
MOST_REPEAT = 1000
MOST_LAYERS = 1 << 12  # ModelConfig's layer cap
MOST_DRAFT = MOST_BEAMS = 64
MOST_MIB = 1 << 20
MOST_QUEUE = 1 << 16
MOST_BODY = 1 << 30
MOST_CONNECTIONS = 1 << 20
MOST_SECONDS = 7 * 24 * 3600.0


def whole(least: int, most: int | None = None):
    """argparse type: an integer in [least, most] (a count, a length, a number of threads), refused at parse time."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {least}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum {most}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def seconds(least: float | None = None):
    """argparse type: a finite duration in seconds, above 0 (or at least `least` when given) and at most a week,
    refused at parse time."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (value >= least if least is not None else value > 0):  # also false for NaN
            raise argparse.ArgumentTypeError(f"{text} is not " + (f">= {least:g}" if least is not None else "> 0"))
        if value > MOST_SECONDS:
            raise argparse.ArgumentTypeError(f"{text} is above the maximum {MOST_SECONDS:g} (a week)")
        return value

    parse.__name__ = "seconds"
    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default="stories260K",
                        help="checkpoint path or known name (stories260K, stories15M, stories42M, stories110M)")
    parser.add_argument("--tokenizer", "-z", default=None, help="tokenizer path (default: found beside the model)")
    parser.add_argument("--backend", default="numba",
                        help="numba (compiled CPU kernels, default), numpy (the reference), cuda (an NVIDIA GPU) or "
                             "auto (cuda when a GPU is usable, else numba)")
    parser.add_argument("--threads", type=whole(1, MOST_THREADS), default=None, help="cores to use (default: all)")
    parser.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="file",
                        help="how matrices are stored on every backend: file (each in its file type, the default), "
                       "float32, float16 or q8_0 blocks")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                        help="float16: the KV cache stores keys and values in half precision (numba, numpy)")
    parser.add_argument("--context", type=whole(1, MOST_TOKENS), default=None, metavar="N",
                        help="positions the model runs with (default: its trained context; longrope models choose "
                             "their factors by it)")


def sampling_params(args, params_type: type = SamplingParams) -> SamplingParams:
    """The SamplingParams the flags ask for (validated there: a bad value is a clear error)."""
    return params_type(**{f.name: getattr(args, f.name) for f, option in options(params_type) if option.flag})


# ----------------------------------------------------------------------------------------------------------------
# Options that go together: one table per command. An option given in a mode that does not honour it is refused
# before anything loads (one `npllm: error:` line), never silently ignored.


@dataclasses.dataclass(frozen=True)
class Mode:
    """A way a command runs, switched on by giving `option`, and the options it honours (`takes`). Any other option
    given beside it is refused with `why`: it would be ignored, or means nothing there. Without any mode on, every
    option is honoured."""

    option: str  # the argparse dest that switches the mode on
    takes: frozenset[str]
    why: str


@dataclasses.dataclass(frozen=True)
class Needs:
    """An option that means something only when `met(args)`, which the error names as `condition`."""

    option: str
    condition: str
    met: Callable[[argparse.Namespace], bool]


# argparse dests. A new option is refused by every mode until a mode's `takes` names it.
MODEL = frozenset({"model", "tokenizer", "backend", "threads", "weight_dtype", "kv_dtype", "context"})
# every sampling flag but --stop and --logprobs (text and a report, not a stage of the draw: each mode names them)
SAMPLING = frozenset(f.name for f, option in options() if option.flag is not None) - {"stop", "logprobs"}
ONE_PROMPT = MODEL | {"prompt", "max_new_tokens"}
SPECULATIVE = ("speculative decoding continues one PROMPT with one draft, inside the context up to EOS, and reports no "
               "log-probabilities")

GENERATE_MODES = (
    Mode("prompt_file", MODEL | SAMPLING | {"max_new_tokens", "stop", "logprobs"},
         "a file's prompts are generated together as one batch, each inside the context up to EOS"),
    Mode("num_beams", ONE_PROMPT | {"stop"},
         "beam search keeps one PROMPT's most probable continuations under the model's own log-probabilities "
         "(no sampling, no draft, no per-token report), inside the context up to EOS"),
    Mode("draft", ONE_PROMPT | SAMPLING | {"stop", "num_draft"}, SPECULATIVE),
    Mode("draft_layers", ONE_PROMPT | SAMPLING | {"stop", "num_draft"}, SPECULATIVE),
    Mode("explain", ONE_PROMPT | SAMPLING | {"json"},
         "--explain shows one PROMPT's draws stage by stage (each token's log-probability and top candidates "
         "included), inside the context up to EOS, without stop strings"),
)
SINKS = Needs("sinks", "--context-policy sinks", lambda args: args.context_policy == "sinks")
GENERATE_NEEDS = (
    Needs("json", "--explain (it is --explain's machine-readable form)", lambda args: args.explain),
    Needs("num_draft", "--draft or --draft-layers",
          lambda args: args.draft is not None or args.draft_layers is not None),
    SINKS,
)
CHAT_NEEDS = (SINKS,)
PERPLEXITY_MODES = (
    Mode("stride", MODEL | {"text", "ctx", "json"},
         "Hugging Face's strided method runs one window at a time and measures perplexity only"),
    Mode("kl_divergence", MODEL | {"text", "ctx", "batch", "json"},
         "the KL divergence is measured over llama.cpp's chunks (--ctx, --batch)"),
)


def given_options(args) -> list[str]:
    """The options given a value other than their default, in the parser's order (args.command_parser is the
    sub-command's parser; "command", the sub-command's name, is the top parser's)."""
    parser = args.command_parser
    return [dest for dest, value in vars(args).items() if dest != "command" and value != parser.get_default(dest)]


def flag(dest: str) -> str:
    """How the command line spells an argparse dest: --max-new-tokens, or PROMPT for the positional argument."""
    return "PROMPT" if dest == "prompt" else "--" + dest.replace("_", "-")


def check_combinations(args, modes: tuple[Mode, ...] = (), needs: tuple[Needs, ...] = ()) -> None:
    """Refuse (GenerationError) an option given where it would be ignored: one whose `needs` are not met, or one
    beside a mode (the first in table order) that does not take it."""
    given = given_options(args)
    for need in needs:
        if need.option in given and not need.met(args):
            raise GenerationError(f"{flag(need.option)} needs {need.condition}")
    for mode in modes:
        if mode.option in given:
            ignored = [dest for dest in given if dest != mode.option and dest not in mode.takes]
            if ignored:
                raise GenerationError(f"{flag(mode.option)} does not take {flag(ignored[0])}: {mode.why}")


def check_generate_args(args) -> None:
    """Combinations of generate's options that mean nothing together, refused before anything loads."""
    check_combinations(args, GENERATE_MODES, GENERATE_NEEDS)


# Commands whose first run on a machine does not wait for the numba backend's compile: the NumPy reference answers
# while a detached process compiles (npllm.models.make_model's cold_start). Not bench, which times the compiled
# kernels, nor serve or perplexity, long runs better served by waiting. $WAIT_COMPILE=1: wait for it as they do.
COLD_START_COMMANDS = ("generate", "chat")
WAIT_COMPILE = "NPLLM_WAIT_COMPILE"


def cold_start(args) -> str:
    """make_model's cold_start for this command: "wait" (not a COLD_START_COMMANDS, or $WAIT_COMPILE set), "exact"
    for a run whose tokens are meant to be reproduced (greedy, --seed, beams: a quantized model waits for the
    compile, whose tokens the reference does not always give), else "reference"."""
    if args.command not in COLD_START_COMMANDS or os.environ.get(WAIT_COMPILE, "") not in ("", "0"):
        return "wait"
    reproduced = args.temperature == 0 or args.seed is not None or getattr(args, "num_beams", 1) > 1
    return "exact" if reproduced else "reference"


def load_with_tokenizer(args, **options):
    """npllm.load(args.model, args.tokenizer) for a command that reads or writes text. A missing tokenizer is one
    error line before any weight is read: making the model loads its compiled code (the first time, compiles it)."""
    from . import load
    from .hub import resolve

    checkpoint, found = resolve(args.model)
    if args.tokenizer is None and found is None:
        from .formats import read_config

        read_config(checkpoint)  # a file that is no checkpoint at all says so, rather than asking for a tokenizer
        raise GenerationError(f"no tokenizer was found beside {args.model}: pass --tokenizer PATH")
    return load(checkpoint, args.tokenizer if args.tokenizer is not None else found, backend=args.backend,
                threads=args.threads, weight_dtype=args.weight_dtype, cold_start=cold_start(args),
                context=args.context, **options)


def run_generate(args) -> int:
    from .context import encode_prompt
    from .generate import check_request

    check_generate_args(args)
    if args.prompt_file is not None:
        return run_generate_batch(args)
    prompt = read_prompt(args.prompt)
    params = sampling_params(args)
    llm = load_with_tokenizer(args, kv_dtype=args.kv_dtype)
    if args.context_policy == "error":  # a prompt far past the context is refused before it is encoded whole
        prompt_ids = encode_prompt(llm.tokenizer, llm.config, prompt)
        check_request(llm.config, prompt_ids, args.max_new_tokens)
    else:
        prompt_ids = llm.tokenizer.encode(prompt, bos=True)
    if args.explain:
        from .explain import print_explained

        print_explained(llm, prompt_ids, args.max_new_tokens, params, as_json=args.json)
        return 0
    if args.num_beams > 1:
        return run_beam_search(args, llm, prompt_ids)
    return stream_generate(args, llm, prompt, len(prompt_ids), params)


def stream_generate(args, llm, prompt: str, prompt_len: int, params) -> int:
    """Print the prompt and its completion as the tokens come, then one line of timings on stderr."""
    speculation = speculation_options(args)
    start, first, count = time.perf_counter(), None, 0

    def on_step(step) -> None:
        nonlocal first, count
        first = first or time.perf_counter()
        count += 1
        if params.logprobs:
            print_logprobs(llm.tokenizer, step)

    for piece in llm.stream(prompt, args.max_new_tokens, echo=True, on_step=on_step, params=params, **speculation,
                            **context_options(args)):
        write_out(piece)
    write_out("\n")
    print(timing_line(prompt_len, count, start, first, time.perf_counter()), file=sys.stderr)
    if speculation:
        stats = speculation["speculation"]
        print(f"[npllm] speculative: {stats.accepted}/{stats.drafted} drafted tokens accepted (acceptance "
              f"{stats.acceptance_rate:.2f}); {count / max(stats.rounds, 1):.2f} tokens per forward call of the model "
              f"({stats.rounds} calls, {stats.draft_calls} draft calls)", file=sys.stderr)
    return 0


def timing_line(prompt_len: int, count: int, start: float, first: float | None, end: float) -> str:
    """generate's stderr summary: the time to the first new token, and the rate after it where there is one (it
    needs two tokens: with --max-new-tokens 0 or 1, or an immediate end token, there is none to give)."""
    line = f"[npllm] {prompt_len} prompt + {count} new tokens"
    if first is None:
        return f"{line} in {1e3 * (end - start):.1f} ms"
    line += f"; first token {1e3 * (first - start):.1f} ms"
    return f"{line}; {(count - 1) / (end - first):.1f} tok/s after it" if count > 1 else line


def speculation_options(args) -> dict:
    """llm.stream's speculative-decoding keywords from --draft / --draft-layers / --num-draft (empty: off)."""
    if args.draft is None and args.draft_layers is None:
        return {}
    from .speculative import SpeculationStats

    return {"draft": args.draft, "draft_layers": args.draft_layers, "num_draft": args.num_draft,
            "speculation": SpeculationStats()}


def run_beam_search(args, llm, prompt_ids) -> int:
    """--num-beams: the prompt and the best hypothesis's text on stdout, every hypothesis's score on stderr."""
    from .generate import stop_ids

    found = llm.beam_search(prompt_ids, args.num_beams, args.max_new_tokens, stop=tuple(args.stop))
    best = [t for t in found[0].tokens if t not in stop_ids(llm.config)]
    write_out(llm.completion_text(prompt_ids, best, echo=True, stop=tuple(args.stop)) + "\n")
    for rank, h in enumerate(found):
        print(f"[beam {rank}] score {h.score:.4f} over {len(h.tokens)} tokens", file=sys.stderr)
    return 0


def read_prompt(prompt: str) -> str:
    """The prompt as valid text: "-" reads stdin (one trailing newline dropped). Bytes that are not UTF-8 (which
    Python hands over from argv as lone surrogates) are refused here, not deep inside the tokenizer."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GenerationError(f"the prompt read from stdin is not UTF-8 (byte {data[e.start]:#04x} at offset "
                                  f"{e.start})") from None
        prompt = prompt.removesuffix("\n").removesuffix("\r")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"the prompt is not valid UTF-8 text (character {e.start}: "
                              f"{ascii(prompt[e.start])}); pass text, or '-' to read it from stdin") from None
    return prompt


# Whether the last text written to stdout left a line open, so an interruption can end it.
_open_line = False


def write_out(text: str) -> None:
    """Write to stdout at once (a token is shown as soon as it is decoded)."""
    global _open_line
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
        _open_line = not text.endswith("\n")


def print_logprobs(tokenizer, step, label: str = "[logprobs]") -> None:
    """One stderr line per token (report.logprobs_line)."""
    from .report import logprobs_line

    print(logprobs_line(tokenizer, step, label), file=sys.stderr)


def read_prompt_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--prompt-file {path}: cannot read it ({e})") from None
    if not prompts:
        raise GenerationError(f"--prompt-file {path}: no prompts in it")
    return prompts


def run_generate_batch(args) -> int:
    """--prompt-file: every prompt with its completion on stdout (blank lines between); with --logprobs, each
    prompt's tokens on stderr after the batch, numbered by prompt ("[logprobs 2]")."""
    prompts = read_prompt_file(args.prompt_file)
    params = sampling_params(args)
    llm = load_with_tokenizer(args, kv_dtype=args.kv_dtype)

    def on_step(index: int, step) -> None:
        print_logprobs(llm.tokenizer, step, f"[logprobs {index + 1}]")

    start = time.perf_counter()
    completions = llm.generate(prompts, args.max_new_tokens, params=params,
                               on_step=on_step if params.logprobs else None)
    seconds = time.perf_counter() - start
    write_out("\n\n".join(p + c for p, c in zip(prompts, completions)) + "\n")
    print(f"[npllm] {len(prompts)} prompts completed together in {seconds:.2f} s", file=sys.stderr)
    return 0


def check_template_limits() -> None:
    """The NPLLM_TEMPLATE_* variables, read now: a bad one is an error before the model loads, not at each render."""
    from .chat import TemplateLimits

    TemplateLimits.from_environment()


def run_chat(args) -> int:
    from .chat.repl import run

    check_combinations(args, needs=CHAT_NEEDS)
    check_template_limits()
    params = sampling_params(args)  # checked before the model loads
    return run(load_with_tokenizer(args, kv_dtype=args.kv_dtype), args, params, context_options(args), write_out)


def run_info(args) -> int:
    from .formats import read_checkpoint
    from .info import describe
    from .hub import resolve

    checkpoint, _ = resolve(one_model(args.model, args.model_option, default="stories260K"))
    config, weights = read_checkpoint(checkpoint)  # a GGUF file's matrices as stored
    print(describe(config, weights, checkpoint))
    return 0


# every type npllm writes and every mixture, from quant's table
QUANTIZE_TYPES = tuple(name.lower() for name in (*QUANTIZE, *MIXTURES))


def quantize_progress(stream=None):
    """A progress line for `npllm quantize` on a terminal (stderr), rewritten after each weight, or None where
    stderr is a file or a pipe (a log keeps only the summary)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, name: str) -> None:
        print(f"\r\033[K[npllm] quantized {done}/{total} tensors ({name})", end="\n" if done == total else "",
              file=stream, flush=True)

    return show


def run_quantize(args) -> int:
    from collections import Counter

    from .convert import quantize_checkpoint
    from .formats.gguf import fallbacks, quant_type

    source = one_model(args.input, args.model_option)
    tensors, tokenizer = quantize_checkpoint(source, args.output, args.type.upper(), args.tokenizer,
                                             progress=quantize_progress())
    counts, sizes = Counter(t.type_name for t in tensors), Counter()
    for t in tensors:
        sizes[t.type_name] += t.raw.size
    parts = ", ".join(f"{name} x{counts[name]} ({sizes[name] / 2**20:.2f} MiB)" for name in sorted(counts))
    vocab = f"vocabulary of {tokenizer.name}" if tokenizer is not None else "no vocabulary (pass --tokenizer)"
    print(f"[npllm] wrote {args.output}: {len(tensors)} tensors: {parts}; {vocab}", file=sys.stderr)
    wanted = args.type.upper()
    block = quant_type(MIXTURES.get(wanted, (wanted,))[0]).block_size
    for (stored, row), n in sorted(fallbacks(tensors, wanted).items()):
        print(f"[npllm] {n} {'matrix' if n == 1 else 'matrices'} with rows of {row} values stored as {stored}: "
              f"{wanted} needs rows that split into blocks of {block}", file=sys.stderr)
    return 0


def run_perplexity(args) -> int:
    import json

    from . import load
    from .evaluate import kl_divergence, perplexity, strided_perplexity

    check_combinations(args, PERPLEXITY_MODES)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--text {args.text}: cannot read it ({e})") from None
    llm = load_with_tokenizer(args, kv_dtype=args.kv_dtype)
    ids = llm._require_tokenizer().encode(text, bos=True)
    ctx = args.ctx or min(512, llm.config.max_seq_len)
    progress = sys.stderr.isatty()
    if args.kl_divergence is not None:
        # the base keeps a float32 cache: `--kv-dtype float16 --kl-divergence SAME_MODEL` measures the cache's rounding
        base = load(args.kl_divergence, args.tokenizer, backend=args.backend, threads=args.threads,
                    weight_dtype=args.weight_dtype, context=args.context)
        result = kl_divergence(llm.model, base.model, ids, ctx, args.batch, progress=progress)
        sentence = (f"mean KL = {result.mean_kl:.6f} +/- {result.kl_stderr:.6f} nats, top-1 agreement "
                    f"{100 * result.top1_agreement:.2f}% over {result.tokens} tokens; PPL {result.ppl:.4f} "
                    f"(base {result.base_ppl:.4f})")
    elif args.stride is not None:
        result = strided_perplexity(llm.model, ids, ctx, args.stride, progress=progress)
        sentence = f"PPL = {result.ppl:.4f} over {result.tokens} tokens in {result.chunks} windows (strided)"
    else:
        result = perplexity(llm.model, ids, ctx, args.batch, progress=progress)
        sentence = (f"PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f} over {result.tokens} tokens in "
                    f"{result.chunks} chunks of {ctx}")
    print(json.dumps(result.as_dict()) if args.json else sentence)
    print(f"[npllm] {result.seconds:.2f} s", file=sys.stderr)
    return 0


def run_serve(args) -> int:
    from pathlib import Path

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise NpllmError("npllm serve needs the serve extra: pip install -e '.[serve]' in npllm's folder "
                         "(Starlette and uvicorn)") from None
    from .chat import chat_template_name
    from .serve.app import Limits, Server, bind, check_api_key, run

    check_api_key(args.api_key)
    check_template_limits()
    sock = bind(args.host, args.port)  # before the model loads: a port in use is an error at once
    try:
        llm = load_with_tokenizer(args)
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
    from .batch import chat_template_for

    template, problem = chat_template_for(spec, checkpoint, arch)
    if problem:
        print(f"[npllm] /v1/chat/completions is off: {problem}", file=sys.stderr)
    return template, problem


BATCH_NEEDS = (Needs("workers", "--ray", lambda args: args.ray is not None),)


def run_batch(args) -> int:
    """npllm batch: the input's requests without a result in the output, in this process or on Ray Data; one
    summary line on stderr, nothing on stdout."""
    from .batch import Runner, chat_template_for, errors_path, output_lock, plan, run

    check_combinations(args, needs=BATCH_NEEDS)
    check_template_limits()
    errors = args.errors or str(errors_path(args.output))
    if args.ray is not None:
        from .ray import run_batch as run_on_ray

        if args.chat_template is not None:
            chat_template_for(args.chat_template, None)  # a template that cannot be read: an error before Ray starts
        summary = run_on_ray(args.model, args.input, args.output, errors, address=args.ray or None,
                             workers=args.workers, batch_size=args.batch_size, max_line_bytes=args.max_line_bytes,
                             tokenizer=args.tokenizer, backend=args.backend, threads=args.threads,
                             chat_template=args.chat_template, weight_dtype=args.weight_dtype,
                             kv_dtype=args.kv_dtype, context=args.context)
    else:
        from .chat import chat_template_name

        with output_lock(args.output):  # held from the reading of the output to the last result written
            work = plan(args.input, args.output, errors, args.max_line_bytes)  # bad files: refused before the load
            llm = load_with_tokenizer(args, kv_dtype=args.kv_dtype)
            template, problem = chat_template_for(args.chat_template, llm.source, llm.config.arch)
            runner = Runner(llm, None, template, problem, chat_template_name(args.chat_template, llm.source),
                            args.batch_size)
            summary = run(runner, work, args.output, errors)
    print(summary.line(args.output, errors), file=sys.stderr)
    return 0


def run_bench(args) -> int:
    from . import bench

    return bench.run(args)


@contextmanager
def compile_notice(active: bool):
    """While a command that runs a model is at work: one line on stderr the first time Numba compiles, so that the
    first run's minute of silence is explained (Numba raises "numba:compile" on a cache miss only, not when it
    loads compiled code from its cache), or when the compile is left to a detached process and the NumPy reference
    answers meanwhile (npllm.models.BEHIND)."""
    if not active:
        yield
        return
    from numba.core import event

    from .models import BEHIND

    class Notice(event.Listener):
        shown = False

        def on_start(self, ev) -> None:
            if not self.shown:
                self.shown = True
                print(behind_notice(**ev.data) if ev.kind == BEHIND else
                      "[npllm] compiling kernels for this CPU: the first run of a model's kind takes up to a minute "
                      "or two (a quantized one the longest); later runs load them from Numba's cache",
                      file=sys.stderr, flush=True)

        def on_end(self, ev) -> None:
            pass

    notice = Notice()
    for kind in ("numba:compile", BEHIND):
        event.register(kind, notice)
    try:
        yield
    finally:
        for kind in ("numba:compile", BEHIND):
            event.unregister(kind, notice)


def behind_notice(quantized: bool, waits: bool) -> str:
    """The line that says this run goes on without its compiled kernels (or, waits: why it does not), and how long
    the one-time compile takes."""
    took = "2-4 minutes for a quantized model on 2 cores" if quantized else "about a minute on 2 cores"
    if waits:
        return (f"[npllm] compiling kernels for this CPU, once ({took}; later runs load them from Numba's cache): a "
                f"greedy or seeded run of a quantized model waits for them, since the NumPy reference could pick "
                f"other tokens (a sampled run without --seed would not wait)")
    same = "" if quantized else " (the same greedy tokens)"
    return (f"[npllm] this CPU's kernels for this kind of model are not compiled yet: this run uses the NumPy "
            f"reference{same}, slower per token, while a background process compiles them into Numba's cache, "
            f"once ({took}); later runs use them. {WAIT_COMPILE}=1 waits for the compile instead")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with compile_notice(getattr(args, "compiles", False)):
            return args.run(args)
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
            if _open_line:
                write_out("\n")
            print("npllm: interrupted", file=sys.stderr)
        except BrokenPipeError:
            pass
        return 130


if __name__ == "__main__":
    sys.exit(main())
