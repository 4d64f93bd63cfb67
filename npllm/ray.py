"""npllm on Ray Data: generation and perplexity over a dataset, spread over actors that each load the model once.

    Predictor                 a callable class for Dataset.map_batches: request columns in, generated_text and the
                              rest out (each actor holds one model and a continuous-batching engine)
    perplexity(dataset, model, ctx=...)     llama.cpp's perplexity of the rows' text, its chunks scored by actors:
                              the figure `npllm perplexity` prints for the same text in one process
    run_batch(...)            `npllm batch --ray`: npllm.batch's files, the generation on Ray Data

Results equal the single-process ones whatever the number of actors and the batch size: every request computes
alone what it computes in a batch (npllm.batching), greedy or with its own seed; every chunk of a perplexity is
scored on a fresh cache. Ray is imported when one of these runs, so `import npllm.ray` works without it (the `ray`
extra: pip install -e ".[ray]" from a clone).

    import ray, npllm.ray
    ds = ray.data.from_items([{"prompt": "Once upon a time", "max_tokens": 50, "temperature": 0}])
    out = ds.map_batches(npllm.ray.Predictor, fn_constructor_kwargs={"model": "stories15M"}, batch_size=8,
                         compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    print(out.take_all()[0]["generated_text"])
"""

from __future__ import annotations

import inspect
import json
import math
import time
from contextlib import contextmanager

import numpy as np

from .batch import (DEFAULT_MAX_LINE_BYTES, DEFAULT_SLOTS, BadRequest, Plan, Runner, Summary, chat_template_for,
                    output_lock, plan, write_results)
from .errors import GenerationError, NpllmError
from .prefix_cache import DEFAULT_MIB
from .serve.protocol import ApiError, parse_json
from .evaluate import Perplexity, chunk_nll, llama_cpp_chunks, perplexity_of

OUTPUT_COLUMNS = ("generated_text", "tokens", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs",
                  "error")


def require_ray():
    """The ray module, or an NpllmError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise NpllmError("this needs Ray Data: pip install -e '.[ray]' in npllm's folder "
                         "(or pip install 'ray[data]')") from None
    return ray


def assigned_cpus() -> int | None:
    """The CPUs Ray gave the calling actor or task (its num_cpus), as a thread count; None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


def _load(model, tokenizer, backend: str, threads: int | None, **options):
    """The model, with as many threads as given, else as many as the actor's num_cpus (options: load's
    weight_dtype, kv_dtype, context)."""
    from .llm import load

    return load(model, tokenizer, backend=backend, threads=threads or assigned_cpus(), **options)


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


def _plain(value):
    """A column value as JSON-like Python: NumPy arrays as lists, NumPy scalars as Python ones."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _missing(value) -> bool:
    """A null cell: None, or the NaN a numeric column holds where a row has no value."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _objects(values: list) -> np.ndarray:
    """A 1-D object array of the values (lists stay one cell each)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


class Predictor:
    """A callable class for Dataset.map_batches: one model per actor, each batch run on its continuous-batching
    engine (`slots` sequences at a time).

    Columns in: "prompt" (text or token ids) or "messages", and any field of the server's requests (max_tokens,
    temperature, top_p, seed, stop, ...; a null cell is an absent field); or, with json_column, one column holding
    each row's request as JSON text. Columns out: the input columns, and generated_text, tokens (ids),
    finish_reason, prompt_tokens, completion_tokens, logprobs (JSON text when asked for, else "") and error (why
    the row is not a request, else ""; its other outputs are then empty).

    threads: the model's thread count; default the actor's num_cpus (map_batches(..., num_cpus=N)).
    chat_template: NAME|FILE for "messages" rows (default: the model's own); a file must exist where actors run.
    """

    def __init__(self, model="stories260K", tokenizer=None, backend: str = "numba", threads: int | None = None,
                 chat_template: str | None = None, slots: int = DEFAULT_SLOTS, json_column: str | None = None,
                 name: str | None = None, weight_dtype: str = "file", kv_dtype: str = "float32",
                 context: int | None = None):
        from .chat import chat_template_name

        llm = _load(model, tokenizer, backend, threads, weight_dtype=weight_dtype, kv_dtype=kv_dtype, context=context,
                    prefix_cache_mib=DEFAULT_MIB)  # each actor's own cache, of npllm batch's default size
        template, problem = chat_template_for(chat_template, llm.source, llm.config.arch)
        self.runner = Runner(llm, name, template, problem, chat_template_name(chat_template, llm.source), slots)
        self.json_column = json_column

    def __call__(self, batch: dict) -> dict:
        columns = {name: list(values) for name, values in batch.items()}  # also a pandas DataFrame's columns
        n = len(next(iter(columns.values()))) if columns else 0
        bodies = [self._body({name: values[i] for name, values in columns.items()}) for i in range(n)]
        records = [record for _, record in self.runner.run(enumerate(bodies))]
        out = {name: np.asarray(batch[name]) for name in columns}
        out.update(self._columns(records))
        return out

    def _body(self, row: dict) -> dict | BadRequest:
        if self.json_column is not None:
            text = row[self.json_column]
            if not isinstance(text, (str, bytes)):
                return BadRequest(f"column {self.json_column}: not JSON text (a {type(text).__name__})")
            try:
                body = parse_json(text)  # nesting too deep for the parser included
            except ApiError as e:
                return BadRequest(f"column {self.json_column}: {e.message.replace('the request body ', '')}")
            return body if isinstance(body, dict) else BadRequest(f"column {self.json_column}: not an object")
        return {k: _plain(v) for k, v in row.items() if not _missing(_plain(v))}

    @staticmethod
    def _columns(records: list[dict]) -> dict:
        def get(name, default):
            return [r.get(name, default) for r in records]

        usage = [r.get("usage", {}) for r in records]
        return {
            "generated_text": _objects(get("text", "")),
            "tokens": _objects([list(t) for t in get("tokens", [])]),
            "finish_reason": _objects([r.get("finish_reason") or "" for r in records]),
            "prompt_tokens": np.array([u.get("prompt_tokens", 0) for u in usage], np.int64),
            "completion_tokens": np.array([u.get("completion_tokens", 0) for u in usage], np.int64),
            "cached_tokens": np.array([u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usage],
                                      np.int64),
            "logprobs": _objects([json.dumps(r["logprobs"]) if "logprobs" in r else "" for r in records]),
            "error": _objects(get("error", "")),
        }


def record_of(row: dict) -> dict:
    """npllm batch's record (npllm.batch.Runner.run's) from a Predictor's output row."""
    if row["error"]:
        return {"error": str(row["error"])}
    prompt, completion = int(row["prompt_tokens"]), int(row["completion_tokens"])
    record = {"text": str(row["generated_text"]), "tokens": [int(t) for t in row["tokens"]],
              "finish_reason": str(row["finish_reason"]),
              "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                        "prompt_tokens_details": {"cached_tokens": int(row["cached_tokens"])}}}
    if row["logprobs"]:
        record["logprobs"] = json.loads(row["logprobs"])
    return record


def _pool(ray, workers: int):
    return ray.data.ActorPoolStrategy(size=workers)


def _connect(ray, address: str | None) -> bool:
    """Join the cluster at `address` (None: $RAY_ADDRESS, else a cluster started on this machine with
    `ray start`, else a new local one), unless this process is already in one. True when this call joined."""
    if ray.is_initialized():
        return False
    ray.init(address=address)
    return True


@contextmanager
def _ordered(ray):
    """While it lasts, this process's Ray Data context keeps results in input order and draws no progress bars of
    its own (npllm draws one); then both settings are put back."""
    context = ray.data.DataContext.get_current()
    before = context.execution_options.preserve_order, context.enable_progress_bars
    context.execution_options.preserve_order, context.enable_progress_bars = True, False
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = before


def run_batch(model, input_path, output, errors, *, address: str | None = None, workers: int = 1,
              batch_size: int = DEFAULT_SLOTS, progress: bool = True, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
              **loading) -> Summary:
    """npllm batch --ray: the input's pending lines as a dataset, run through `workers` Predictor actors (each with
    `batch_size` slots and `threads` CPUs, default 1), the results appended in input order as they arrive, the
    output locked throughout (npllm.batch.output_lock). loading: how each actor loads the model, Predictor's
    keywords (tokenizer, backend, threads, chat_template, weight_dtype, kv_dtype); one it does not take is a
    TypeError here, before Ray starts."""
    predictor = dict(model=str(model), slots=batch_size, json_column="body", **loading)
    inspect.signature(Predictor).bind(**predictor)
    ray = require_ray()
    with output_lock(output):
        work: Plan = plan(input_path, output, errors, max_line_bytes)
        if not work.pending:
            return write_results(work, iter(()), output, errors, progress)
        return _run_on_ray(ray, address, work, output, errors, workers, batch_size, progress, predictor)


def _run_on_ray(ray, address, work: Plan, output, errors, workers: int, batch_size: int, progress: bool,
                predictor: dict) -> Summary:
    """run_batch's part on the cluster: joined (or started) for the run, left at its end."""
    joined = _connect(ray, address)
    try:
        rows = [{"line": line.number, "body": json.dumps(line.body)} for line in work.pending]
        with _ordered(ray):
            done = ray.data.from_items(rows).map_batches(
                Predictor, batch_size=batch_size, batch_format="numpy", compute=_pool(ray, workers),
                num_cpus=predictor.get("threads") or 1, fn_constructor_kwargs=predictor)
            results = ((int(row["line"]), record_of(row)) for row in done.iter_rows())
            return write_results(work, results, output, errors, progress)
    finally:
        if joined:
            ray.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------------------------


class ChunkScorer:
    """A callable class for map_batches over llama.cpp's chunks: {"chunk", "tokens" [b, ctx]} in, {"chunk",
    "nll" [b, n]} out (evaluate.chunk_nll), the chunks of a batch run together, one cache slot each."""

    def __init__(self, model, tokenizer=None, backend: str = "numba", threads: int | None = None):
        self.model = _load(model, tokenizer, backend, threads).model

    def __call__(self, batch: dict) -> dict:
        chunks = np.asarray(batch["tokens"], dtype=np.int64)
        return {"chunk": np.asarray(batch["chunk"]), "nll": chunk_nll(self.model, chunks, len(chunks))}


def perplexity(dataset, model="stories260K", ctx: int | None = None, *, column: str = "text", separator: str = "\n",
               batch: int = 1, workers: int = 1, tokenizer=None, backend: str = "numba",
               threads: int | None = None) -> Perplexity:
    """Perplexity of the dataset's text by llama.cpp's method, the chunks scored by `workers` actors (`batch`
    chunks per forward call, `threads` CPUs each, default 1).

    The text is the rows' `column` joined by `separator`, in the dataset's order; it is tokenized here, in the
    calling process (the tokenizer alone is loaded, not the model), and cut as `npllm perplexity` cuts it. The
    result is the one `npllm perplexity --text FILE --ctx CTX` prints for a FILE holding that text (ctx default:
    min(512, the model's context), as there).
    """
    from .llm import load_tokenizer_of

    ray = require_ray()
    start = time.perf_counter()
    tok, config = load_tokenizer_of(model, tokenizer)
    ctx = ctx or min(512, config.max_seq_len)
    if ctx > config.max_seq_len:
        raise GenerationError(f"ctx {ctx} is longer than the model's context ({config.max_seq_len})")
    with _ordered(ray):
        texts = [str(row[column]) for row in dataset.iter_rows()]
        chunks = llama_cpp_chunks(tok.encode(separator.join(texts), bos=True), ctx, config.bos_id)
        items = ray.data.from_items([{"chunk": i, "tokens": chunk} for i, chunk in enumerate(chunks)])
        scored = items.map_batches(ChunkScorer, batch_size=batch, batch_format="numpy",
                                   compute=_pool(ray, workers), num_cpus=threads or 1,
                                   fn_constructor_kwargs=dict(model=str(model), tokenizer=tokenizer,
                                                              backend=backend, threads=threads))
        nll = np.empty((len(chunks), ctx - 1 - ctx // 2))
        for row in scored.iter_rows():
            nll[int(row["chunk"])] = row["nll"]
    return perplexity_of(nll, time.perf_counter() - start)
