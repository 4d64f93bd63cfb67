"""What the commands share: the SamplingParams and context keywords their flags ask for, the one checkpoint of
info and quantize, loading a model with its tokenizer (and whether its first run waits for the compile), writing
to stdout as tokens come, and the template limits read before a model loads. The commands call
shared.load_with_tokenizer through this module, so a test can stand in for the load in one place."""

from __future__ import annotations

import os
import sys

from ..errors import ConfigError, ConstraintError, GenerationError
from ..sampling import SamplingParams, options


def sampling_params(args, params_type: type = SamplingParams) -> SamplingParams:
    """The SamplingParams the flags ask for (validated there: a bad value is a clear error)."""
    return params_type(**{f.name: getattr(args, f.name) for f, option in options(params_type) if option.flag})


def constraint_of(args):
    """The structured-output Constraint that --json-schema / --json-object / --regex / --grammar ask for (None when
    none does; at most one may), its file read and checked before the model loads."""
    from ..constraint import Constraint

    given = [flag for flag, value in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                                      ("--regex", args.regex), ("--grammar", args.grammar)) if value]
    if len(given) > 1:
        raise GenerationError(f"{' and '.join(given)} each constrain the output: give one of them")
    if args.json_object:
        return Constraint.json({"type": "object"})
    if args.regex is not None:
        return Constraint.regex(args.regex)
    for flag, path, make in (("--json-schema", args.json_schema, Constraint.json),
                             ("--grammar", args.grammar, Constraint.grammar)):
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise GenerationError(f"{flag} {path}: cannot read it ({e})") from None
            try:
                return make(text)
            except ConstraintError as e:
                raise ConstraintError(f"{flag} {path}: {e}") from None
    return None


def context_options(args) -> dict:
    return {"context_policy": args.context_policy, "sinks": args.sinks, "ignore_eos": args.ignore_eos}


def one_model(positional: str | None, option: str | None, default: str | None = None) -> str:
    """The checkpoint a command was given, positionally or as --model (not both), else default."""
    if positional is not None and option is not None:
        raise ConfigError(f"the checkpoint is given twice, as {positional!r} and as --model {option!r}: give one")
    model = positional if positional is not None else option if option is not None else default
    if model is None:
        raise ConfigError("no checkpoint given: name it as the first argument or with --model")
    return model


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
    from .. import load
    from ..hub import resolve

    checkpoint, found = resolve(args.model)
    if args.tokenizer is None and found is None:
        from ..formats import read_config

        read_config(checkpoint)  # a file that is no checkpoint at all says so, rather than asking for a tokenizer
        raise GenerationError(f"no tokenizer was found beside {args.model}: pass --tokenizer PATH")
    return load(checkpoint, args.tokenizer if args.tokenizer is not None else found, backend=args.backend,
                threads=args.threads, weight_dtype=args.weight_dtype, cold_start=cold_start(args),
                context=args.context, **options)


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
    from ..report import logprobs_line

    print(logprobs_line(tokenizer, step, label), file=sys.stderr)


def check_template_limits() -> None:
    """The NPLLM_TEMPLATE_* variables, read now: a bad one is an error before the model loads, not at each render."""
    from ..chat import TemplateLimits

    TemplateLimits.from_environment()
