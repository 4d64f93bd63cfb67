"""One thread that owns the continuous-batching engine, and the jobs the HTTP side hands it.

The HTTP side runs in an asyncio event loop; a forward call must not run there, or every connection would stall for
the length of a step. So one thread drives ContinuousEngine.step in a loop while anything is waiting or running,
and requests reach it through an inbox (a queue of submits and cancels, applied between steps). Each job's tokens go
back to the event loop through `deliver` (loop.call_soon_threadsafe in the server), one event per token, then one
event when the job ends:

    ("token", Sampled)          a kept token (its id, and with params.logprobs its log-probability and alternatives)
    ("done", finish_reason)     "stop", "length", "context" or "cancelled"
    ("error", message)          the step failed (an out-of-memory, a broken model): the job is over

Every active request shares each forward call, each with its own sampling parameters, generator and stops
(npllm.batching.ContinuousEngine); a cancel frees its slot before the next step. Other work on the model (an
embedding request) goes through the same inbox as a call, run between two steps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from ..batching import ContinuousEngine, Handle
from ..generate import Request

log = logging.getLogger("npllm.serve")
prefix_log = logging.getLogger("npllm.serve.prefix")  # `npllm serve` prints its info lines on stderr (app.run)
REPORT_EVERY_S = 60.0  # the prefix cache's hit rate is logged (info) at most this often, when it was used


class Job:
    """A request on its way through the engine thread: what to run and where its events go."""

    def __init__(self, request: Request, deliver: Callable[[tuple], None]):
        self.request, self.deliver = request, deliver
        self.handle: Handle | None = None  # set by the engine thread once submitted
        self.finished = False  # set by the engine thread after the last event


class EngineThread:
    """A ContinuousEngine stepped by a thread of its own, fed through an inbox.

        submit(job)     the job joins the engine before its next step
        cancel(job)     the job ends ("cancelled") before the next step; its slot is freed
        close()         cancel everything and end the thread
    """

    def __init__(self, engine: ContinuousEngine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.live: dict[int, Job] = {}  # handle id -> job, for the jobs submitted and not finished
        self.closing = False
        stats = engine.prefix.stats if engine.prefix is not None else None  # a cache may be older than the server
        # when the hit rate was last logged, and the counts then: (time, prompt tokens, cached tokens)
        self.reported = (time.monotonic(), stats.prompt_tokens if stats else 0, stats.cached_tokens if stats else 0)
        self.thread = threading.Thread(target=self._loop, name="npllm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        self._post(("submit", job))

    def cancel(self, job: Job) -> None:
        self._post(("cancel", job))

    def call(self, function: Callable[[], object]) -> concurrent.futures.Future:
        """function() run on the engine thread between two steps, where it may use the model (nothing else does
        meanwhile: the model's buffers are the engine's); its result, or its exception, in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", (function, future)))
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every job still in the engine and stop the thread."""
        self._post(("close", None))
        self.thread.join(timeout)

    def _post(self, message) -> None:
        self.inbox.put(message)
        self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.clear()  # cleared before the inbox is read: a post after this point wakes the wait below
            self._drain()
            if self.closing:
                return
            if not self.engine.busy:
                self.wake.wait()
                continue
            try:
                self.engine.step()
            except Exception as e:  # a failed step ends every job in it; the server keeps serving
                log.exception("engine step failed")
                self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
            self._finish_done()
            self._report_prefix()

    def prefix_report(self) -> dict | None:
        """The engine's prefix cache's size and hit counts (PrefixCache.report), None when it has none."""
        prefix = self.engine.prefix
        return None if prefix is None else prefix.report()

    def _report_prefix(self, now: float | None = None) -> None:
        """Log the prefix cache's hit rate over the last minute (info), when prompts were looked up in it."""
        prefix = self.engine.prefix
        now = time.monotonic() if now is None else now
        then, prompt, cached = self.reported
        if prefix is None or now - then < REPORT_EVERY_S:
            return
        stats = prefix.stats
        looked, hit = stats.prompt_tokens - prompt, stats.cached_tokens - cached
        self.reported = (now, stats.prompt_tokens, stats.cached_tokens)
        if looked:
            prefix_log.info("prefix cache: %d of %d prompt tokens from the cache in the last %.0f s (%.1f%%); %d blocks, "
                     "%.1f of %.1f MiB", hit, looked, now - then, 100 * hit / looked, len(prefix.blocks),
                     prefix.nbytes / 2**20, prefix.budget / 2**20)

    def _drain(self) -> None:
        while True:
            try:
                kind, job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._submit(job)
            elif kind == "cancel":
                self._cancel(job)
            elif kind == "call":
                self._call(*job)
            else:
                for job in list(self.live.values()):
                    self._cancel(job)
                self.closing = True

    def _submit(self, job: Job) -> None:
        if job.finished:  # cancelled before it was submitted
            return
        try:
            job.handle = self.engine.submit(job.request, on_token=lambda h, t, job=job: job.deliver(("token", h.drawn)))
        except Exception as e:  # the HTTP side checks requests first; this is the last line
            self._end(job, ("error", f"{type(e).__name__}: {e}"))
            return
        self.live[job.handle.id] = job
        if job.handle.done:  # nothing to generate
            self._end(job, ("done", job.handle.finish_reason))

    @staticmethod
    def _call(function, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function())
        except Exception as e:  # the caller's to answer (a 400 or a 500), not the engine's
            future.set_exception(e)

    def _cancel(self, job: Job) -> None:
        if job.finished:
            return
        if job.handle is not None:
            self.engine.cancel(job.handle)
        self._end(job, ("done", "cancelled"))

    def _finish_done(self) -> None:
        for job in [j for j in self.live.values() if j.handle.done]:
            self._end(job, ("done", job.handle.finish_reason))

    def _fail_all(self, message: str) -> None:
        for job in list(self.live.values()):
            if not job.handle.done:
                self.engine.cancel(job.handle)
            self._end(job, ("error", message))

    def _end(self, job: Job, event: tuple) -> None:
        job.finished = True
        if job.handle is not None:
            self.live.pop(job.handle.id, None)
        job.deliver(event)
