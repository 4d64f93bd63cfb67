"""The Jinja environment chat templates run in, and the worker process that runs them (this file is its program).

A template is code from a model file, and Jinja's sandbox stops it reaching Python's internals but not using time or
memory: nested loops, 'a' * 10**9, indent(10**9), tojson(indent=10**9). So templates render in a worker process
(npllm/chat/worker.py starts it: `python -c BOOT path/to/sandbox.py FD`) that the caller can kill, and inside it:

    guards        the environment below refuses, before doing it, an operation whose result would be longer than
                  `max_chars` characters (items of a list; decimal digits of an int: at most 4300, Python's own
                  limit for printing one): `*`, `+`, `**`, `%` on strings, lists and ints; str.center/ljust/rjust/
                  zfill/expandtabs/replace/join/translate/format; the filters center, indent, join, replace,
                  format, slice, tojson's indent (at most 100), and lipsum()
    output        the render stops once it has written more than `max_chars` characters
    memory        an address-space limit (RLIMIT_AS: what the worker had at the request + `memory_mib`); what the
                  guards do not foresee fails with MemoryError
    deadline      SIGALRM, left at its default action (the kernel ends the process, whatever Python is doing),
                  comes `seconds` + 1 s into a render, should the parent not have killed the worker at `seconds`

This file imports only the standard library and Jinja (the worker loads it by path, without npllm's package).

Protocol, over the worker's stdin and stdout: a request is a 4-byte big-endian length and a pickled dict (template,
variables, max_chars, memory_mib, seconds); the worker says b"A" once it has read the whole request (so the parent
can tell a worker that died idle, which never took the request and may be replaced, from one the render ended),
then answers with the same framing around ("ok", text), ("error", phrase) or ("limit", phrase) (a guard, the
output cap, memory), phrase completing "<the template's name> ...", e.g. "raised: roles must alternate". The worker
says b"R" once ready, or answers ("error", phrase) and exits when it cannot start (no jinja2).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import re
import signal
import string
import struct
import sys
import threading
from datetime import datetime

try:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:  # a runtime dependency; a broken install still deserves a sentence (see serve)
    jinja2 = None
    Extension, ImmutableSandboxedEnvironment = object, object

MAX_INT_DIGITS = 4300  # Python's own limit for int <-> str
MAX_INT_BITS = math.ceil(MAX_INT_DIGITS * math.log2(10))
MAX_JSON_INDENT = 100
MAX_SLICES = 100_000  # jinja's sandbox bounds range() to 100,000 items; slice(n) loops n times


class LimitExceeded(Exception if jinja2 is None else jinja2.TemplateError):
    """A guard refused an operation: its result would pass a limit."""


# -- the environment ------------------------------------------------------------------------------------------------


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing operations whose results would pass `max_chars` (module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options):
        super().__init__(**options)
        self.max_chars = 1 << 62  # set for each render

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            _check_repeat(left, right, self.max_chars)
        elif operator == "+" and _sized(left) and _sized(right):
            _check_size(len(left) + len(right), self.max_chars, "a concatenation")
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
                raise LimitExceeded(f"{left} ** {right} has more than {MAX_INT_DIGITS} digits")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, self.max_chars)
        result = super().call_binop(context, operator, left, right)
        _check_int(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature trick)
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, (str, bytes)):
            args = _check_str_method(owner, name, args, kwargs, __self.max_chars)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, limit = value.__self__, self.max_chars

        @functools.wraps(wrapped)
        def checked(*args, **kwargs):
            _check_brace_format(template, limit)
            return wrapped(*args, **kwargs)

        return checked


@functools.lru_cache(maxsize=1)
def environment() -> GuardedEnvironment:
    """trim_blocks, lstrip_blocks, loop controls and {% generation %}, as transformers' apply_chat_template."""
    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation],
                             loader=NoLoader())
    env.filters["tojson"] = tojson
    for name in ("center", "indent", "join", "replace", "format", "slice"):
        env.filters[name] = _guarded_filter(env.filters[name], name)
    env.globals["lipsum"] = _guarded_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    return env


@functools.lru_cache(maxsize=32)
def compiled(template: str):
    """The compiled template (cached: a chat renders the same template every turn)."""
    return environment().from_string(template)


def raise_exception(message):
    raise jinja2.TemplateError(message)


def strftime_now(fmt):
    if not isinstance(fmt, str):
        raise jinja2.TemplateRuntimeError(f"strftime_now needs a format string, got {type(fmt).__name__}")
    return datetime.now().strftime(fmt)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as json.dumps writes it: Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not."""
    if isinstance(indent, (int, str)) and not isinstance(indent, bool):
        width = indent if isinstance(indent, int) else len(indent)
        if width > MAX_JSON_INDENT:
            raise LimitExceeded(f"tojson's indent is {width}; the limit is {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_not_json)


def _not_json(value):
    if isinstance(value, jinja2.Undefined):
        name = getattr(value, "_undefined_name", None)
        raise jinja2.UndefinedError(f"tojson was given an undefined value{f' ({name!r})' if name else ''}")
    raise jinja2.TemplateRuntimeError(f"tojson cannot write a {type(value).__name__}")


class Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text (training masks use it); rendering
    outputs its body unchanged, in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class NoLoader(jinja2.BaseLoader if jinja2 else object):
    """include, import and extends find nothing: a chat template is rendered on its own."""

    def get_source(self, environment, template):
        raise jinja2.TemplateNotFound(template, f"{template!r}: a chat template cannot include, import or extend "
                                                "another template")


def _check_namespace_name(name):
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class Namespace(jinja2.utils.Namespace if jinja2 else object):
    """Jinja's namespace(), refusing attribute names that start with "_" (a way toward Python internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick: `self` may also be an attribute name
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


# -- the guards -----------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sized(x) -> bool:
    return isinstance(x, (str, bytes, list, tuple))


def _check_size(size: int, limit: int, what: str) -> None:
    if size > limit:
        raise LimitExceeded(f"{what} would be {size:,} characters or items long; the limit is {limit:,} "
                            "(NPLLM_TEMPLATE_MAX_CHARS)")


def _check_int(value) -> None:
    if _is_int(value) and value.bit_length() > MAX_INT_BITS:
        raise LimitExceeded(f"an integer of more than {MAX_INT_DIGITS} digits")


def _check_repeat(left, right, limit: int) -> None:
    """sequence * n, n * sequence, int * int."""
    for seq, n in ((left, right), (right, left)):
        if _sized(seq) and _is_int(n):
            _check_size(len(seq) * max(n, 0), limit, "a repetition")
    if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise LimitExceeded(f"a product of more than {MAX_INT_DIGITS} digits")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")


def _check_percent_format(template: str, limit: int) -> None:
    """printf-style widths and precisions: numbers up to `limit`, no '*' (a width taken from the arguments)."""
    for match in _PERCENT_SPEC.finditer(template):
        for number in match.groups():
            if number == "*":
                raise LimitExceeded("'%*' (a width taken from the arguments) is not allowed in chat templates")
            if number is not None:
                _check_size(int(number), limit, "a %-format's width or precision")


_NUMBER = re.compile(r"\d+")


def _check_brace_format(template: str, limit: int) -> None:
    """str.format: widths and precisions up to `limit`, none taken from the arguments ('{:{}}')."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError:
        return  # str.format will say what is wrong with it
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise LimitExceeded("a format width taken from the arguments ('{:{}}') is not allowed in chat templates")
        for number in _NUMBER.findall(spec or ""):
            _check_size(int(number), limit, "a format's width or precision")


def _check_str_method(text, name: str, args: tuple, kwargs: dict, limit: int) -> tuple:
    """Refuse a str (or bytes) method call whose result would pass `limit`; the arguments to call it with (join's
    iterable read into a list, since it is read twice)."""
    def arg(i, key, default=None):
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name in ("center", "ljust", "rjust", "zfill") and _is_int(arg(0, "width")):
        _check_size(arg(0, "width"), limit, f"{name}()'s result")
    elif name == "expandtabs" and _is_int(arg(0, "tabsize", 8)):
        _check_size(len(text) + text.count("\t" if isinstance(text, str) else b"\t") * max(arg(0, "tabsize", 8), 0),
                     limit, "expandtabs()'s result")
    elif name == "replace":
        _check_replace(text, arg(0, "old"), arg(1, "new"), arg(2, "count", -1), limit)
    elif name == "join" and args:
        items = list(args[0])
        _check_join(text, items, limit)
        args = (items, *args[1:])
    elif name == "translate" and isinstance(arg(0, "table"), dict):
        longest = max((len(v) for v in arg(0, "table").values() if isinstance(v, str)), default=1)
        _check_size(len(text) * longest, limit, "translate()'s result")
    return args


def _check_replace(text, old, new, count, limit: int) -> None:
    if not (isinstance(old, type(text)) and isinstance(new, type(text)) and _is_int(count)):
        return  # str.replace will refuse the types itself
    found = text.count(old)  # "" is found len(text) + 1 times
    if count >= 0:
        found = min(found, count)
    _check_size(len(text) + found * (len(new) - len(old)), limit, "replace()'s result")


def _check_join(separator, items: list, limit: int) -> None:
    if all(isinstance(item, (str, bytes)) for item in items):
        _check_size(sum(map(len, items)) + len(separator) * max(len(items) - 1, 0), limit, "a join")


def _guarded_filter(original, name: str):
    """The filter `name`, refusing arguments whose result would pass the environment's max_chars."""
    skip = 1 if getattr(original, "jinja_pass_arg", None) else 0  # join, replace, slice get an eval context first

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        limit, rest = environment().max_chars, args[skip:]

        def arg(i, key, default=None):
            return rest[i] if len(rest) > i else kwargs.get(key, default)

        value = arg(0, "value", arg(0, "s", ""))
        if name == "center" and _is_int(arg(1, "width")):
            _check_size(arg(1, "width"), limit, "center's result")
        elif name == "indent":
            width = arg(1, "width", 4)
            width = len(width) if isinstance(width, str) else width
            if _is_int(width):
                text = str(value)
                _check_size(len(text) + (text.count("\n") + 1) * max(width, 0), limit, "indent's result")
        elif name == "replace":
            count = arg(3, "count")
            _check_replace(str(value), arg(1, "old"), arg(2, "new"), -1 if count is None else count, limit)
        elif name == "format" and isinstance(value, str):
            _check_percent_format(value, limit)
        elif name == "join" and value is not None and not isinstance(value, (str, jinja2.Undefined)):
            items = list(value)
            if arg(2, "attribute") is None and isinstance(arg(1, "d", ""), str):
                _check_join(arg(1, "d", ""), items, limit)
            args = (*args[:skip], items, *rest[1:]) if rest else args
            if not rest:
                kwargs = {**kwargs, "value": items}
        elif name == "slice" and _is_int(arg(1, "slices")) and arg(1, "slices") > MAX_SLICES:
            raise LimitExceeded(f"slice({arg(1, 'slices')}): at most {MAX_SLICES} slices")
        return original(*args, **kwargs)

    return guarded


def _guarded_lipsum(original):
    """lipsum(n, html, min, max): n paragraphs of up to `max` words (of up to 10 characters, and a space)."""
    @functools.wraps(original)
    def guarded(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja's own parameter names)
        if _is_int(n) and _is_int(max):
            _check_size(n * max * 11, environment().max_chars, "lipsum's text")
        return original(n, html, min, max)

    return guarded


# -- rendering ------------------------------------------------------------------------------------------------------


def render(template: str, variables: dict, max_chars: int) -> str:
    """The template's text for `variables`, stopped past max_chars characters written. Raises what the template
    raises (LimitExceeded for a guard)."""
    env = environment()
    env.max_chars = max_chars
    compiled_template = compiled_or_raise(template)
    pieces, written = [], 0
    for piece in compiled_template.generate(**variables):
        written += len(piece)
        if written > max_chars:
            raise LimitExceeded(f"it wrote more than {max_chars:,} characters (NPLLM_TEMPLATE_MAX_CHARS)")
        pieces.append(piece)
    return "".join(pieces)


class CompileError(Exception):
    """The template does not compile (its message says where)."""


def compiled_or_raise(template: str):
    try:
        return compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise CompileError(f"{e.message} (line {e.lineno})") from None
    except (ValueError, RecursionError, MemoryError, jinja2.TemplateError) as e:  # a 5000-digit literal, deep nesting
        raise CompileError(_describe(e)) from None


def phrase(e: BaseException, memory_mib: int) -> str:
    """What went wrong, as the end of a sentence that starts with the template's name."""
    if isinstance(e, CompileError):
        return f"does not compile: {e}"
    if isinstance(e, LimitExceeded):
        return f"went over a limit: {e}"
    if isinstance(e, MemoryError):
        return (f"needed more than its {memory_mib} MiB of memory (NPLLM_TEMPLATE_MEMORY_MIB; an operation the "
                "guards do not foresee made something huge)")
    if isinstance(e, RecursionError):
        return "recursed too deeply (a macro that calls itself?)"
    if isinstance(e, jinja2.TemplateError):  # raise_exception(), a sandbox refusal, an undefined called, ...
        return f"raised: {e}"
    return f"failed: {_describe(e)}"


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, jinja2.TemplateError) else f"{text} ({type(e).__name__})"


# -- the worker's loop ----------------------------------------------------------------------------------------------


def serve(lifeline: int | None = None) -> None:
    """Answer requests on stdin/stdout until stdin closes (the module docstring's protocol); exit as soon as the
    parent is gone (lifeline: a pipe's read end whose writer is the parent), even in the middle of a render."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops this process itself
    if lifeline is not None:
        threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    inp, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # whatever else writes to stdout cannot corrupt the answers
    if jinja2 is None:
        _send(out, ("error", "needs the jinja2 package (pip install jinja2)"))
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    out.write(b"R")
    out.flush()
    memory_mib = None
    while True:
        header = inp.read(4)
        if len(header) < 4:
            return
        body = inp.read(struct.unpack(">I", header)[0])
        out.write(b"A")
        out.flush()
        request = pickle.loads(body)
        if request["memory_mib"] != memory_mib:
            memory_mib = request["memory_mib"]
            _limit_memory(memory_mib)
        signal.setitimer(signal.ITIMER_REAL, request["seconds"] + 1.0)
        try:
            answer = ("ok", render(request["template"], request["variables"], request["max_chars"]))
        except Exception as e:  # noqa: BLE001 (every failure of untrusted code becomes a sentence)
            answer = ("limit" if isinstance(e, (LimitExceeded, MemoryError)) else "error", phrase(e, memory_mib))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        _send(out, answer)


def _exit_with_parent(lifeline: int) -> None:
    """Block (without the GIL) until the parent's end of the lifeline closes, then end the process."""
    try:
        while os.read(lifeline, 1):
            pass
    finally:
        os._exit(0)


def _send(out, answer) -> None:
    data = pickle.dumps(answer)
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def _limit_memory(memory_mib: int) -> None:
    """Let the process map at most memory_mib MiB more than it has now (RLIMIT_AS; where it exists)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = now + (memory_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ImportError, OSError, ValueError):  # not Linux: the deadline still holds
        pass


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else None)
