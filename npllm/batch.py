"""`npllm batch`: a JSONL file of requests through a model, one result line per request, in input order, resumable.

    input  (one JSON object a line)   {"id": ..., "prompt": "..."}  or  {"id": ..., "messages": [...]}, with the
                                      fields of the server's requests (max_tokens, temperature, top_p, seed, stop,
                                      presence_penalty, frequency_penalty, logit_bias, logprobs, ...): each line
                                      is read by npllm.serve.protocol exactly as a POST body would be
    output (one JSON object a line)   {"id", "text", "tokens", "finish_reason", "usage"} (+ "logprobs" if asked)
    errors (one JSON object a line)   {"line", "id", "error"}: a line that is not a request, and why

Resuming: the ids already in the output are skipped, so a run that is killed and started again ends with every id
exactly once. Results are appended one whole line per write (a torn last line, from a crash of the machine or a
write that failed, is cut off at the next start), and only in input order: a result waits until every earlier one
is written, so a kill loses at most the requests in flight. The errors file describes the latest run (it is
rewritten each run; a bad line is reported again by the next run, since it has no result). One run at a time writes
an output: a run holds OUTPUT.lock (flock) from its start to its end, and a second one is refused at once. An output
holding an id twice (two runs of an older npllm at once) is refused, not resumed: which line is right is unknown.

Input lines are read at most max_line_bytes at a time: a longer one is an error line, skipped without being held.

The model side (Runner) is the same in this process and in each Ray actor (npllm.ray): a ContinuousEngine with
`slots` cache slots, fed in input order, each request computing exactly what it computes alone (greedy, or
sampled with its own `seed`), so results do not depend on the batch size or the number of workers.
Nothing here imports Ray.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ChatTemplateError, GenerationError
from .serve.protocol import (ApiError, Context, Output, chat_logprobs, check_nesting, completion_logprobs,
                             parse_chat, parse_completion, parse_json, reply_message)

DEFAULT_SLOTS = 8
WINDOW_PER_SLOT = 2  # requests submitted ahead of the oldest unwritten one: 2 x slots keeps every slot busy
MOST_TOKENS = 1 << 24  # no limit of our own on max_tokens: a request ends at its context, as `npllm generate` does
DEFAULT_MAX_LINE_BYTES = 4 << 20  # 4x a server's default body limit; a whole 128K-token context as text fits
SKIP_CHUNK = 1 << 16  # an over-long line is read past this many bytes at a time
BOM = b"\xef\xbb\xbf"


class BadRequest(Exception):
    """A line of the input that is not a request the model can run; the message says why."""


# ----------------------------------------------------------------------------------------------------------------
# The files
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One request of the input file."""

    number: int  # 1-based line number in the input file
    id: str | int
    body: dict  # the request's fields, the id removed


@dataclass
class Plan:
    """What a run has to do: the requests without a result yet (in input order), the bad lines, the ids skipped."""

    pending: list[Line]
    errors: list[dict]
    skipped: int


def id_key(id_) -> str:
    """How ids are compared: their JSON text (1 and "1" are different ids)."""
    return json.dumps(id_)


def parse_line(number: int, text: str) -> Line:
    """A line of the input as a request: a JSON object with an "id" (a string or an integer) and a "prompt" or
    "messages", nested no deeper than a server's body may be; the other fields are checked later, by the server's
    rules."""
    try:
        body = parse_json(text)
        check_nesting(body)
    except ApiError as e:
        raise BadRequest(e.message.replace("the request body", "the line")) from None
    if not isinstance(body, dict):
        raise BadRequest(f"a line must be a JSON object, got {type(body).__name__}")
    if "id" not in body:
        raise BadRequest('no "id"')
    id_ = body.pop("id")
    if not (isinstance(id_, str) or (isinstance(id_, int) and not isinstance(id_, bool))):
        raise BadRequest(f'"id" must be a string or an integer, got {json.dumps(id_)}')
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest('give either "prompt" or "messages"')
    return Line(number, id_, body)


def read_input(path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, str | BadRequest]]:
    """(line number, text) of each non-blank line of a UTF-8 file (a byte order mark before the first is dropped);
    (line number, BadRequest) for a line over max_line_bytes, which is read past in bounded pieces, never held."""
    number = 0
    try:
        with open(path, "rb") as f:
            while line := f.readline(max_line_bytes + 1):
                number += 1
                if len(line) > max_line_bytes and not line.endswith(b"\n"):
                    _skip_line(f)
                    yield number, BadRequest(f"the line is longer than --max-line-bytes ({max_line_bytes} bytes)")
                    continue
                text = (line[len(BOM):] if number == 1 and line.startswith(BOM) else line).decode("utf-8")
                if text.strip():
                    yield number, text
    except OSError as e:
        raise GenerationError(f"--input {path}: cannot read it ({e})") from None
    except UnicodeDecodeError as e:
        raise GenerationError(f"--input {path}: line {number} is not UTF-8 text ({e})") from None


def _skip_line(f) -> None:
    """Read past the rest of the current line."""
    while (piece := f.readline(SKIP_CHUNK)) and not piece.endswith(b"\n"):
        pass


def finished_ids(output) -> set[str]:
    """The id keys already in the output file (none when it does not exist). A last line without its newline (the
    machine went down mid-write) is cut off, so that the next append starts a line; any other line that is not a
    result means the file is not this command's output, and an id on two lines that two runs wrote to it at once:
    nothing is written to it then."""
    fd = open_regular(output, os.O_RDWR, "--output", absent_ok=True)
    if fd is None:
        return set()
    done: dict[str, int] = {}
    with os.fdopen(fd, "rb") as f:
        end = 0  # where the last whole line ends
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                os.ftruncate(fd, end)
                break
            end += len(line)
            key = _result_id(line, number, output)
            if key in done:
                raise GenerationError(f"--output {output}: line {number} repeats the id {key} of line {done[key]} "
                                      f"(two runs wrote it at once?); remove the repeated lines before resuming")
            done[key] = number
    return set(done)


def _result_id(line: bytes, number: int, output) -> str:
    """The id key of a line of the output; GenerationError if the line is not a result."""
    try:
        record = parse_json(line)
    except ApiError:
        record = None
    if not isinstance(record, dict) or "id" not in record:
        raise GenerationError(f"--output {output}: line {number} is not a result of npllm batch; "
                              f"refusing to append to it")
    return id_key(record["id"])


def open_regular(path, flags: int, what: str, absent_ok: bool = False) -> int | None:
    """A descriptor on `path` (links followed) if it is a regular file; GenerationError naming `what` otherwise,
    without blocking on a FIFO or reading a device. absent_ok: None when it does not exist (and flags do not
    create it)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except FileNotFoundError as e:
        if absent_ok:
            return None
        raise GenerationError(f"{what} {path}: cannot open it ({e.strerror})") from None
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader (opened to write), a folder
            raise _not_regular(path, stat.S_IFIFO if e.errno == errno.ENXIO else stat.S_IFDIR, what) from None
        raise GenerationError(f"{what} {path}: cannot open it ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode, what)
    return fd


def _not_regular(path, mode: int, what: str) -> GenerationError:
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a device or a socket"
    return GenerationError(f"{what} {path} is not a regular file ({kind}); it must be a file, new or a batch output")


def _names_a_file(output) -> None:
    if Path(output).name in ("", "."):  # "", ".", "/": nothing to put a name beside
        raise GenerationError(f"--output {os.fspath(output)!r} names no file")


@contextmanager
def output_lock(output):
    """While it lasts, this process alone writes `output`: an exclusive flock on OUTPUT.lock beside it (links
    resolved), removed at the end; GenerationError at once when another run holds it. A lock file, not the output
    itself, so that a run refused before it writes leaves no output behind."""
    _names_a_file(output)
    try:
        mode = os.stat(output).st_mode  # a FIFO or a device is refused here, before a lock file is made beside it
    except FileNotFoundError:
        mode = stat.S_IFREG
    except OSError as e:
        raise GenerationError(f"--output {output}: cannot open it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(output, mode, "--output")
    lock = Path(output).resolve()
    lock = lock.with_name(lock.name + ".lock")
    fd = _locked(lock, output)
    try:
        yield
    finally:
        with suppress(OSError):
            os.unlink(lock)  # still ours: anyone who opened it waits for the flock, then sees it gone (_locked)
        os.close(fd)


def _locked(lock: Path, output) -> int:
    """A descriptor holding the flock on `lock`, which is still the file at that path (a run ending unlinks it: a
    lock taken on the unlinked file would be no lock)."""
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise GenerationError(f"--output {output}: cannot create its lock file {lock} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise GenerationError(f"--output {output} is being written by another npllm batch (it holds {lock}); "
                                  f"wait for it to end, or choose another output") from None
        with suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
    raise GenerationError(f"--output {output}: could not take its lock file {lock}")


def plan(input_path, output, errors=None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Plan:
    """Read the input: each line a request (or an error), the ids already in the output skipped, a repeated id an
    error on its later line. The three files must be different files; the output, when it exists, a regular file.
    The caller holds output_lock(output) from here until the results are written."""
    paths = {"--input": input_path, "--output": output, "--errors": errors or errors_path(output)}
    for (a, pa), (b, pb) in [(x, y) for i, x in enumerate(paths.items()) for y in list(paths.items())[i + 1:]]:
        if Path(pa).resolve() == Path(pb).resolve():
            raise GenerationError(f"{a} and {b} are the same file ({pa})")
    done = finished_ids(output)
    pending, errors, seen, skipped = [], [], {}, 0
    for number, text in read_input(input_path, max_line_bytes):
        try:
            if isinstance(text, BadRequest):
                raise text
            line = parse_line(number, text)
            key = id_key(line.id)
            if key in seen:
                raise BadRequest(f"id {key} repeats line {seen[key]}")
            seen[key] = number
        except BadRequest as e:
            errors.append(error_record(number, None if isinstance(text, BadRequest) else _id_of(text), str(e)))
            continue
        if key in done:
            skipped += 1
        else:
            pending.append(line)
    return Plan(pending, errors, skipped)


def _id_of(text: str):
    """The id of a line, when it can be read; else None."""
    try:
        body = parse_json(text)
    except ApiError:
        return None
    return body.get("id") if isinstance(body, dict) else None


def error_record(number: int, id_, reason: str) -> dict:
    return {"line": number, "id": id_, "error": reason}


class Appender:
    """A file that grows by whole lines: each record is one os.write on a descriptor opened for appending, so a
    killed process leaves no half line, and a write that fails (a full disk) is taken back and raises
    GenerationError. what: how errors name it ("--output"); regular: it must be a regular file (else any file that
    takes writes, a FIFO with a reader or /dev/null)."""

    def __init__(self, path, what: str, truncate: bool = False, regular: bool = True):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self.path, self.what = path, what
        if regular:
            self.fd = open_regular(path, flags, what)
        else:  # a FIFO with a reader, /dev/null: the errors file may be any file that takes writes
            try:
                self.fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)  # no reader: ENXIO, no wait
            except OSError as e:
                why = "a FIFO that no process reads" if e.errno == errno.ENXIO else e.strerror
                raise GenerationError(f"{what} {path}: cannot write it ({why})") from None
            os.set_blocking(self.fd, True)
        self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        size = os.fstat(self.fd).st_size if self.regular else None
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            if size is not None:
                with suppress(OSError):
                    os.ftruncate(self.fd, size)  # no part of the line stays for a resume to read
            raise GenerationError(f"{self.what} {self.path}: cannot write it ({e.strerror or e}); what was written "
                                  f"before is kept, and a run started again goes on from there") from None

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def errors_path(output) -> Path:
    """The default errors file: beside the output, out.jsonl -> out.errors.jsonl."""
    _names_a_file(output)
    path = Path(output)
    return path.with_name(path.stem + ".errors" + (path.suffix or ".jsonl"))


# ----------------------------------------------------------------------------------------------------------------
# The model side
# ----------------------------------------------------------------------------------------------------------------


def model_name(model) -> str:
    """The name a request's optional "model" field must match: the checkpoint's stem, or the known name."""
    return Path(str(model)).stem or str(model)


def chat_template_for(spec: str | None, checkpoint, arch: str | None = None) -> tuple[str | None, str]:
    """(template, "") for "messages" requests: --chat-template NAME|FILE, else the model's own; (None, why) when
    the model ships none and none was named (its "messages" lines are then errors saying so). A named template that
    cannot be read raises ChatTemplateError. arch: the model's, for the built-in the reason suggests."""
    from .chat import find_chat_template, resolve_chat_template

    if spec is not None:
        return resolve_chat_template(spec, None), ""
    try:
        return resolve_chat_template(None, find_chat_template(checkpoint), arch), ""
    except ChatTemplateError as e:
        return None, str(e)


@dataclass
class Job:
    """A request in the engine: its checked spec, its text so far (protocol.Output) and its tokens."""

    key: object
    spec: object  # protocol.Spec
    output: Output
    tokens: list[int] = field(default_factory=list)
    pieces: list = field(default_factory=list)
    handle: object = None  # batching.Handle

    def record(self) -> dict:
        """The result line's fields (without the id)."""
        self.output.ended(self.handle)
        self.output.finish(self.handle.finish_reason)
        out = self.output
        record = {"text": out.text, "tokens": self.tokens, "finish_reason": out.finish_reason, "usage": out.usage()}
        if self.spec.calls_tools:  # a chat line with tools: its calls as the server gives them
            message, record["finish_reason"] = reply_message(out)
            if "tool_calls" in message:
                record["tool_calls"] = message["tool_calls"]
        if self.spec.logprobs is not None:
            record["logprobs"] = (chat_logprobs if self.spec.chat else completion_logprobs)(self.pieces)
        return record


class Runner:
    """A loaded model and a continuous-batching engine on it; runs request bodies in order. What the plain run and
    each Ray actor hold.

        spec(body) -> protocol.Spec                   the body checked by the server's rules (BadRequest if not)
        run([(key, body), ...]) -> [(key, record)]    in the order given; record: the result's fields, or
                                                      {"error": reason} for a body that is not a request
    """

    def __init__(self, llm, name: str | None = None, chat_template: str | None = None, template_problem: str = "",
                 template_name: str = "", slots: int = DEFAULT_SLOTS):
        from .batching import ContinuousEngine

        if llm.tokenizer is None:
            raise GenerationError(f"no tokenizer was found for {llm.source}: pass a tokenizer")
        self.llm = llm
        self.context = Context(name or model_name(llm.source), llm.tokenizer, llm.config, MOST_TOKENS,
                               chat_template, template_problem, template_name)
        # the LLM's prefix cache (npllm.prefix_cache; --prefix-cache-mib): a shared system prompt is computed once
        self.engine = ContinuousEngine(llm.model, slots=slots, prefix_cache=getattr(llm, "prefix_cache", None))
        self.window = WINDOW_PER_SLOT * slots

    def spec(self, body: dict):
        try:
            parse = parse_chat if "messages" in body else parse_completion
            spec = parse(body, self.context)
        except ApiError as e:
            raise BadRequest(e.message) from None
        if spec.n != 1:  # a result line holds one text: n choices are n lines
            raise BadRequest(f"n must be 1 in a batch line (a result line holds one choice; give n lines), got "
                             f"{spec.n}")
        return spec

    def run(self, items: Iterable[tuple[object, dict]]) -> Iterator[tuple[object, dict]]:
        """Each (key, body)'s record, in the order given. At most `window` requests are ahead of the oldest
        record not yet yielded; the engine admits them in that order as slots free up."""
        source = iter(items)
        pending: deque = deque()  # (key, Job or error record), in input order
        exhausted = False
        while True:
            while not exhausted and sum(isinstance(p, Job) for _, p in pending) < self.window:
                try:
                    key, body = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((key, self._submit(key, body)))
            while pending and not (isinstance(pending[0][1], Job) and not pending[0][1].handle.done):
                key, item = pending.popleft()
                yield key, item.record() if isinstance(item, Job) else item
            if exhausted and not pending:
                return
            self.engine.step()

    def _submit(self, key, body: dict):
        """A Job in the engine for a valid body, else its error record (body may be the BadRequest itself)."""
        if isinstance(body, BadRequest):
            return {"error": str(body)}
        try:
            spec = self.spec(body)
        except BadRequest as e:
            return {"error": str(e)}
        job = Job(key, spec, Output(spec, self.context.tokenizer))
        job.handle = self.engine.submit(spec.request, on_token=lambda handle, token: self._on_token(job, token))
        return job

    def _on_token(self, job: Job, token: int) -> None:
        """A token of a job: its text; a completed stop string ends the job now (its slot is freed)."""
        job.tokens.append(int(token))
        job.pieces.append(job.output.feed(job.handle.drawn))
        if job.output.stopped:
            self.engine.cancel(job.handle)


# ----------------------------------------------------------------------------------------------------------------
# A run
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    done: int = 0  # results written by this run
    skipped: int = 0  # ids already in the output
    errors: int = 0  # lines written to the errors file
    tokens: int = 0  # completion tokens of the results written
    seconds: float = 0.0

    def line(self, output, errors) -> str:
        """The run's summary for stderr."""
        rate = self.tokens / self.seconds if self.seconds > 0 else float("nan")
        return (f"[npllm] batch: {self.done} results written to {output} in {self.seconds:.1f} s "
                f"({rate:.1f} tokens/s); {self.skipped} already there; {self.errors} bad lines"
                + (f" in {errors}" if self.errors else ""))


def prefix_line(stats) -> str:
    """The prefix cache's hit rate over a run (npllm.prefix_cache.PrefixStats), for stderr."""
    return (f"[npllm] batch: prefix cache: {stats.cached_tokens} of {stats.prompt_tokens} prompt tokens from the "
            f"cache ({100 * stats.hit_rate:.1f}%); {stats.hits} of {stats.lookups} prompts hit")


def write_results(work: Plan, results: Iterable[tuple[int, dict]], output, errors, progress: bool = True) -> Summary:
    """Append each (line number, record) to the output (or, for {"error"}, to the errors file), in the order
    they come (the caller yields them in input order), with a tqdm bar on stderr."""
    from tqdm import tqdm

    start = time.perf_counter()
    summary = Summary(skipped=work.skipped, errors=len(work.errors))
    lines = {line.number: line for line in work.pending}
    with Appender(output, "--output") as out, \
            Appender(errors, "--errors", truncate=True, regular=False) as bad, \
            tqdm(total=len(work.pending), unit="req", file=sys.stderr, disable=not progress) as bar:
        for record in work.errors:
            bad.write(record)
        for number, record in results:
            line = lines[number]
            if "error" in record:
                bad.write(error_record(number, line.id, record["error"]))
                summary.errors += 1
            else:
                out.write({"id": line.id, **record})
                summary.done += 1
                summary.tokens += record["usage"]["completion_tokens"]
            bar.update()
    summary.seconds = time.perf_counter() - start
    return summary


def run(runner: Runner, work: Plan, output, errors=None, progress: bool = True) -> Summary:
    """npllm batch in this process: every pending line of the plan (plan(input, output)) through runner's engine,
    results appended in input order."""
    items = ((line.number, line.body) for line in work.pending)
    return write_results(work, runner.run(items), output, errors or errors_path(output), progress)
