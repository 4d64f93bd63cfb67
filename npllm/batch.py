"""`npllm batch`: a JSONL file of requests through a model, one result line per request, in input order, resumable.

    input  (one JSON object a line)   {"id": ..., "prompt": "..."}  or  {"id": ..., "messages": [...]}, with the
                                      fields of the server's requests (max_tokens, temperature, top_p, seed, stop,
                                      presence_penalty, frequency_penalty, logit_bias, logprobs, ...): each line
                                      is read by npllm.serve.protocol exactly as a POST body would be
    output (one JSON object a line)   {"id", "text", "tokens", "finish_reason", "usage"} (+ "logprobs" if asked)
    errors (one JSON object a line)   {"line", "id", "error"}: a line that is not a request, and why

Resuming: the ids already in the output are skipped, so a run that is killed and started again ends with every id
exactly once. Results are appended one whole line per write (a torn last line, from a crash of the machine, is cut
off at the next start), and only in input order: a result waits until every earlier one is written, so a kill
loses at most the requests in flight. The errors file describes the latest run (it is rewritten each run; a bad
line is reported again by the next run, since it has no result).

The model side (Runner) is the same in this process and in each Ray actor (npllm.ray): a ContinuousEngine with
`slots` cache slots, fed in input order, each request computing exactly what it computes alone (greedy, or
sampled with its own `seed`), so results do not depend on the batch size or the number of workers.
Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ChatTemplateError, GenerationError
from .serve.protocol import (ApiError, Context, Output, chat_logprobs, completion_logprobs, parse_chat,
                             parse_completion)

DEFAULT_SLOTS = 8
WINDOW_PER_SLOT = 2  # requests submitted ahead of the oldest unwritten one: 2 x slots keeps every slot busy
MOST_TOKENS = 1 << 24  # no limit of our own on max_tokens: a request ends at its context, as `npllm generate` does


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
    "messages"; the other fields are checked later, by the server's rules."""
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BadRequest(f"not JSON: {e}") from None
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


def read_input(path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of a UTF-8 file."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if text.strip():
                    yield number, text
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--input {path}: cannot read it ({e})") from None


def finished_ids(output) -> set[str]:
    """The id keys already in the output file (none when it does not exist). A last line without its newline (the
    machine went down mid-write) is cut off, so that the next append starts a line; any other line that is not a
    result means the file is not this command's output, and nothing is written to it."""
    path = Path(output)
    if not path.exists():
        return set()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GenerationError(f"--output {output}: cannot read it ({e})") from None
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for number, text in enumerate(whole.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "id" not in record:
            raise GenerationError(f"--output {output}: line {number} is not a result of npllm batch; "
                                  f"refusing to append to it")
        done.add(id_key(record["id"]))
    return done


def plan(input_path, output, errors=None) -> Plan:
    """Read the input: each line a request (or an error), the ids already in the output skipped, a repeated id an
    error on its later line. The three files must be different files."""
    paths = {"--input": input_path, "--output": output, "--errors": errors or errors_path(output)}
    for (a, pa), (b, pb) in [(x, y) for i, x in enumerate(paths.items()) for y in list(paths.items())[i + 1:]]:
        if Path(pa).resolve() == Path(pb).resolve():
            raise GenerationError(f"{a} and {b} are the same file ({pa})")
    done = finished_ids(output)
    pending, errors, seen, skipped = [], [], {}, 0
    for number, text in read_input(input_path):
        try:
            line = parse_line(number, text)
            key = id_key(line.id)
            if key in seen:
                raise BadRequest(f"id {key} repeats line {seen[key]}")
            seen[key] = number
        except BadRequest as e:
            errors.append(error_record(number, _id_of(text), str(e)))
            continue
        if key in done:
            skipped += 1
        else:
            pending.append(line)
    return Plan(pending, errors, skipped)


def _id_of(text: str):
    """The id of a line, when it can be read; else None."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return body.get("id") if isinstance(body, dict) else None


def error_record(number: int, id_, reason: str) -> dict:
    return {"line": number, "id": id_, "error": reason}


class Appender:
    """A file that grows by whole lines: each record is one os.write on a descriptor opened for appending, so a
    killed process leaves no half line."""

    def __init__(self, path, truncate: bool = False):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise GenerationError(f"{path}: cannot write it ({e.strerror})") from None

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        while data:
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def errors_path(output) -> Path:
    """The default errors file: beside the output, out.jsonl -> out.errors.jsonl."""
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
        self.output.finish(self.handle.finish_reason)
        out = self.output
        record = {"text": out.text, "tokens": self.tokens, "finish_reason": out.finish_reason, "usage": out.usage()}
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
        self.engine = ContinuousEngine(llm.model, slots=slots)
        self.window = WINDOW_PER_SLOT * slots

    def spec(self, body: dict):
        try:
            parse = parse_chat if "messages" in body else parse_completion
            return parse(body, self.context)
        except ApiError as e:
            raise BadRequest(e.message) from None

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
        rate = self.tokens / self.seconds if self.seconds > 0 else float("nan")
        return (f"[npllm] batch: {self.done} results written to {output} in {self.seconds:.1f} s "
                f"({rate:.1f} tokens/s); {self.skipped} already there; {self.errors} bad lines"
                + (f" in {errors}" if self.errors else ""))


def write_results(work: Plan, results: Iterable[tuple[int, dict]], output, errors, progress: bool = True) -> Summary:
    """Append each (line number, record) to the output (or, for {"error"}, to the errors file), in the order
    they come (the caller yields them in input order), with a tqdm bar on stderr."""
    from tqdm import tqdm

    start = time.perf_counter()
    summary = Summary(skipped=work.skipped, errors=len(work.errors))
    lines = {line.number: line for line in work.pending}
    with Appender(output) as out, Appender(errors, truncate=True) as bad, \
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
