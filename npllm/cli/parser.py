"""The command line's parser and its tables: the Parser that refuses a bad argument in one line, which options each
command takes (one add_* function per command, their shared groups of options, the types and bounds of their
values), and which options go together (GENERATE_MODES, GENERATE_NEEDS, CHAT_NEEDS, PERPLEXITY_MODES, BATCH_NEEDS
and check_combinations, which the commands call before any model loads). It runs nothing: npllm.cli.main hands
the parsed arguments to the command's module."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

from ..embed import POOLINGS
from ..errors import GenerationError
from ..models import KV_DTYPES, WEIGHT_DTYPES
from ..prefix_cache import DEFAULT_MIB
from ..quant import MIXTURES, QUANTIZE
from ..sampling import Option, SamplingParams, options


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
    for add in (add_generate, add_chat, add_info, add_quantize, add_bench, add_perplexity, add_embed, add_serve,
                add_batch):
        add(commands)
    return parser


def package_version() -> str:
    """The installed distribution's version (its metadata); from a source tree that is not installed, the
    package's own __version__."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("npllm-engine")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


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


def add_model_option(parser) -> None:
    """--model M for a command whose checkpoint is a positional argument (info, quantize): every command takes
    --model, so a user who learnt it on one can use it on all. one_model() reconciles the two."""
    parser.add_argument("--model", "-m", dest="model_option", default=None, metavar="MODEL",
                        help="the checkpoint, as the positional argument gives it (give one of the two)")


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


def add_context_arguments(parser) -> None:
    parser.add_argument("--context-policy", choices=("error", "truncate", "sinks"), default="error",
                        help="past the context: error (stop there, the default), truncate (recompute over the "
                             "most recent half context) or sinks (StreamingLLM: first tokens + recent window)")
    parser.add_argument("--sinks", type=whole(0, MOST_TOKENS), default=4,
                        help="attention sinks kept with --context-policy sinks (default 4)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def add_constraint_arguments(parser) -> None:
    """Structured outputs (npllm.constraint): at most one of these; the output must be in its language."""
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="the output is JSON valid against the JSON Schema in FILE (docs/structured.md)")
    parser.add_argument("--json-object", action="store_true",
                        help="the output is a JSON object (OpenAI's response_format json_object)")
    parser.add_argument("--regex", default=None, metavar="RE", help="the output matches this regular expression")
    parser.add_argument("--grammar", default=None, metavar="FILE",
                        help="the output is in the language of this grammar (Lark-style EBNF or llama.cpp GBNF)")


CONSTRAINT = frozenset({"json_schema", "json_object", "regex", "grammar"})


def add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="continue a prompt, streaming text to stdout")
    gen.add_argument("prompt", nargs="?", default="",
                     help="text to continue ('-': read it from stdin; default: start from BOS)")
    add_model_arguments(gen)
    gen.add_argument("--max-new-tokens", type=whole(0), default=256, help="most tokens to generate (default 256)")
    add_sampling_arguments(gen)
    add_context_arguments(gen)
    add_constraint_arguments(gen)
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
    gen.set_defaults(compiles=True, command_parser=gen)


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
    add_constraint_arguments(chat)
    chat.set_defaults(compiles=True, command_parser=chat)


def add_info(commands) -> None:
    info = commands.add_parser("info", help="describe a checkpoint: architecture, size, context, tokenizer")
    info.add_argument("model", nargs="?", default=None, help="checkpoint path or known name (default stories260K)")
    add_model_option(info)


# every type npllm writes and every mixture, from quant's table
QUANTIZE_TYPES = tuple(name.lower() for name in (*QUANTIZE, *MIXTURES))


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
    bench.set_defaults(compiles=True)


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
    ppl.set_defaults(compiles=True, command_parser=ppl)


def add_embed(commands) -> None:
    emb = commands.add_parser("embed", help="one embedding per line of text (JSON lines out)")
    add_model_arguments(emb)
    emb.add_argument("--input", "-i", default="-", help="a UTF-8 text file, one text per line (default: stdin)")
    emb.add_argument("--pooling", choices=POOLINGS, default=None,
                     help="last token, mean of the tokens, or the first (default: what the model's files say; "
                          "else last)")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                     help="scale each vector to unit length (default: what the model's files say)")
    emb.set_defaults(compiles=True, command_parser=emb)


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
    add_prefix_cache(serve)
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
    serve.set_defaults(compiles=True)


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
    add_prefix_cache(batch)
    batch.add_argument("--max-line-bytes", type=whole(1, MOST_BODY), default=4 << 20, metavar="N",
                       help="a longer input line is an error line, skipped unread (default 4 MiB)")
    batch.set_defaults(compiles=True, command_parser=batch)


def add_prefix_cache(command) -> None:
    command.add_argument("--prefix-cache-mib", type=whole(0, MOST_MIB), default=DEFAULT_MIB, metavar="MIB",
                         help="host memory for the keys and values of prompt beginnings, so that a beginning shared "
                              f"by requests is computed once (default {DEFAULT_MIB}; 0: off)")


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
    Mode("prompt_file", MODEL | SAMPLING | CONSTRAINT | {"max_new_tokens", "stop", "logprobs"},
         "a file's prompts are generated together as one batch, each inside the context up to EOS"),
    Mode("num_beams", ONE_PROMPT | CONSTRAINT | {"stop"},
         "beam search keeps one PROMPT's most probable continuations under the model's own log-probabilities "
         "(no sampling, no draft, no per-token report), inside the context up to EOS"),
    Mode("draft", ONE_PROMPT | SAMPLING | CONSTRAINT | {"stop", "num_draft"}, SPECULATIVE),
    Mode("draft_layers", ONE_PROMPT | SAMPLING | CONSTRAINT | {"stop", "num_draft"}, SPECULATIVE),
    Mode("explain", ONE_PROMPT | SAMPLING | CONSTRAINT | {"json"},
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
BATCH_NEEDS = (Needs("workers", "--ray", lambda args: args.ray is not None),
               Needs("prefix_cache_mib", "no --ray (each Ray actor has a prefix cache of the default size)",
                     lambda args: args.ray is None))


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
