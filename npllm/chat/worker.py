"""Chat templates rendered in worker processes, which a render that overruns its deadline does not outlive.

    TemplateLimits(seconds, max_chars, memory_mib)   the bounds of one render; .from_environment() reads
                                                    NPLLM_TEMPLATE_TIMEOUT, NPLLM_TEMPLATE_MAX_CHARS,
                                                    NPLLM_TEMPLATE_MEMORY_MIB over the defaults, each checked
                                                    against its range (RANGES; npllm.settings)
    render_in_worker(template, variables, limits) -> str, or TemplateFailure(phrase)
    close_workers()                                 stop every worker (a render in flight fails at once)

A worker is `python -c BOOT npllm/chat/sandbox.py FD` (that file's docstring: the guards inside it, the protocol);
FD is the read end of a pipe only this process writes to, so the worker exits as soon as this process is gone.
Idle workers are kept for the next render (the first render of a process pays the start, ~0.1-0.3 s); up to
MOST_WORKERS render at once, more wait for one. The caller waits for the answer in select() with the deadline: past
it, or on Ctrl-C (KeyboardInterrupt) or any other exception, the worker is killed, so a template cannot hold the
caller longer than the deadline, nor keep running after it. A worker that died while idle (the OOM killer) is dropped,
and one found dead before it acknowledged the request (the sandbox's b"A") is replaced once: that render goes on in a
new worker; one that dies after the acknowledgement fails its render ("stopped its worker process"). The waiting
thread holds no lock the rest of the process needs: the server waits in a thread of its own, its event loop free.
"""

from __future__ import annotations

import atexit
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..settings import check_setting, setting_from_env

MOST_WORKERS = 4
SIGNAL_SLICE = 0.1  # seconds between two looks at pending signals while a render runs
START_SECONDS = 60.0  # a worker starting on a loaded machine (imports jinja2)
_SANDBOX = Path(__file__).with_name("sandbox.py")
# -c puts the current folder first on the path: dropped, so that no file there can stand in for a module
_BOOT = ("import sys\nif sys.path and sys.path[0] == '': del sys.path[0]\n"
         "import importlib.util\n"
         "spec = importlib.util.spec_from_file_location('npllm_chat_sandbox', sys.argv[1])\n"
         "module = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(module)\n"
         "module.serve(int(sys.argv[2]))\n")


@dataclass(frozen=True)
class TemplateLimits:
    """seconds: a render's deadline; max_chars: the longest text (and string, list) it may make; memory_mib: what
    its worker may allocate beyond what it holds at the start of the render. Each is > 0 and at most its maximum
    in RANGES (an hour; 2**30 characters; 1 TiB), whether given here or by its environment variable."""

    seconds: float = 5.0
    max_chars: int = 4_000_000
    memory_mib: int = 1024

    # field -> (environment variable, maximum, whole number?)
    RANGES = {"seconds": ("NPLLM_TEMPLATE_TIMEOUT", 3600.0, False),
              "max_chars": ("NPLLM_TEMPLATE_MAX_CHARS", 1 << 30, True),
              "memory_mib": ("NPLLM_TEMPLATE_MEMORY_MIB", 1 << 20, True)}

    def __post_init__(self):
        for field, (_, most, whole) in self.RANGES.items():
            check_setting(f"template limit {field}", getattr(self, field), most, whole)

    @classmethod
    def from_environment(cls) -> TemplateLimits:
        """The defaults, each replaced by its environment variable where that is set (settings.setting_from_env:
        a value out of range is a SettingError naming the variable)."""
        return cls(**{field: setting_from_env(variable, getattr(cls, field), most, whole)
                      for field, (variable, most, whole) in cls.RANGES.items()})


class TemplateFailure(Exception):
    """A render failed; the message completes a sentence that starts with the template's name ("raised: ...").
    over_limit: it was stopped by a limit (the deadline, the output cap, a guard, memory), not by its own error."""

    def __init__(self, message: str, over_limit: bool = False):
        super().__init__(message)
        self.over_limit = over_limit


def render_in_worker(template: str, variables: dict, limits: TemplateLimits) -> str:
    """`template` rendered with `variables` (plain data: str, int, float, bool, None, lists, dicts) in a worker, or
    TemplateFailure. Ctrl-C while it runs stops the worker and raises KeyboardInterrupt. A worker that died while
    idle (the OOM killer, a stray kill) and so never took the request is replaced once, unseen by the caller."""
    request = pickle.dumps({"template": template, "variables": variables, "max_chars": int(limits.max_chars),
                            "memory_mib": int(limits.memory_mib), "seconds": float(limits.seconds)})
    try:
        kind, value = _ask_a_worker(request, limits.seconds)
    except _Gone as e:  # a fresh worker died before taking the request too
        raise TemplateFailure(f"cannot be rendered: its worker process stopped before it took the request "
                              f"({e})") from None
    if kind != "ok":
        raise TemplateFailure(value, over_limit=kind == "limit")
    return value


def _ask_a_worker(request: bytes, seconds: float, tries: int = 2) -> tuple[str, str]:
    """A worker's answer to `request`, trying another worker where one was gone before it took the request."""
    for attempt in range(tries):
        worker = _POOL.take()
        try:
            return worker.ask(request, seconds)
        except _Gone:
            if attempt == tries - 1 or worker.ended_here:  # close_workers() stopped it: no new worker now
                raise
        except BaseException:  # a deadline, a worker gone, Ctrl-C: the worker's state is unknown, so it goes
            worker.stop()
            raise
        finally:
            _POOL.give(worker)


def close_workers() -> None:
    """Stop every worker, idle or busy (a busy one's caller gets a TemplateFailure at once)."""
    _POOL.close()


class _Gone(Exception):
    """The worker's process ended before it took the request (the message: its exit status); it is stopped."""


class _Worker:
    """One worker process and the pipes to it. Only the thread that holds it reads, writes or closes them."""

    def __init__(self):
        if not sys.executable:
            raise TemplateFailure("cannot be rendered: no Python interpreter to start a template worker with")
        # the lifeline: the worker reads its end until this process, the only writer, is gone, then exits
        lifeline, self.lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(_SANDBOX), str(lifeline)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         bufsize=0, pass_fds=(lifeline,))
        except OSError as e:
            os.close(self.lifeline)
            raise TemplateFailure(f"cannot be rendered: the template worker did not start ({e})") from None
        finally:
            os.close(lifeline)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
        self.stopped = self.ended_here = False
        late = f"cannot be rendered: the template worker did not start within {START_SECONDS:g} s"
        try:
            ready = self._read(1, time.monotonic() + START_SECONDS, late)
            if ready != b"R":  # it answered why it cannot start
                raise TemplateFailure(self._answer(ready, time.monotonic() + START_SECONDS, late)[1])
        except _Gone as e:
            raise TemplateFailure(f"cannot be rendered: the template worker stopped as it started ({e})") from None
        except BaseException:
            self.stop()
            raise

    def ask(self, request: bytes, seconds: float) -> tuple[str, str]:
        """The worker's answer to one request, within `seconds` of sending it (else it is stopped). _Gone where the
        worker ended before it took the request (it died idle: another may render it); TemplateFailure where it
        ended after (the render did it)."""
        data = memoryview(struct.pack(">I", len(request)) + request)
        try:
            while data:
                data = data[self.proc.stdin.write(data):]
        except (OSError, ValueError):  # the pipe's reader is gone
            status = self._status()
            self.stop()
            raise _Gone(status) from None
        deadline = time.monotonic() + seconds
        late = f"did not finish within {seconds:g} s (NPLLM_TEMPLATE_TIMEOUT; the render was stopped)"
        if self._read(1, deadline, late) != b"A":
            self.stop()
            raise TemplateFailure("cannot be rendered: its worker answered out of turn")
        try:
            return self._answer(b"", deadline, late)
        except _Gone as e:
            raise TemplateFailure(f"stopped its worker process ({e})") from None

    def _answer(self, start: bytes, deadline: float, late: str) -> tuple[str, str]:
        header = start + self._read(4 - len(start), deadline, late)
        return pickle.loads(self._read(struct.unpack(">I", header)[0], deadline, late))

    def _read(self, n: int, deadline: float, late: str) -> bytes:
        """n bytes from the worker by `deadline`; past it the worker is stopped and TemplateFailure(late) raised;
        where the worker has ended, it is stopped and _Gone raised."""
        data = bytearray()
        fd = self.proc.stdout.fileno()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise TemplateFailure(late, over_limit=True)
            # in slices: a signal that another thread took (Ctrl-C, SIGTERM's handler) is acted on within one
            if not self.selector.select(min(left, SIGNAL_SLICE)):
                continue
            chunk = os.read(fd, n - len(data))
            if not chunk:
                status = self._status()
                self.stop()
                raise _Gone(status)
            data += chunk
        return bytes(data)

    def _status(self) -> str:
        code = self.proc.wait()
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        """End the process, leaving the pipes to the thread that holds the worker (it reads the end of them)."""
        try:
            self.proc.kill()
        except OSError:
            pass

    def stop(self) -> None:
        """End the process and close the pipes (by the thread that holds the worker, or for an idle one)."""
        if self.stopped:
            return
        self.stopped = True
        self.kill()
        self.proc.wait()
        self.selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        os.close(self.lifeline)


class _Pool:
    """Idle workers, and how many exist; a fresh set after a fork (the parent's pipes are not this process's)."""

    def __init__(self):
        self.lock = threading.Condition()
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()
        self.starting = 0
        self.pid = os.getpid()

    def _forked(self) -> None:
        if self.pid != os.getpid():
            self.idle, self.busy, self.starting, self.pid = [], set(), 0, os.getpid()

    def take(self) -> _Worker:
        """An idle worker whose process still runs (those that died idle are dropped), else a new one."""
        with self.lock:
            self._forked()
            while True:
                self._drop_dead()
                if self.idle or len(self.busy) + self.starting < MOST_WORKERS:
                    break
                self.lock.wait()
            if self.idle:
                worker = self.idle.pop()
                self.busy.add(worker)
                return worker
            self.starting += 1
        try:
            worker = _Worker()
        finally:
            with self.lock:
                self.starting -= 1
                self.lock.notify()
        with self.lock:
            self.busy.add(worker)
        return worker

    def _drop_dead(self) -> None:
        """Stop the idle workers whose process has ended (reaped at once: it has)."""
        dead = [worker for worker in self.idle if worker.proc.poll() is not None]
        for worker in dead:
            self.idle.remove(worker)
            worker.stop()

    def give(self, worker: _Worker) -> None:
        with self.lock:
            self.busy.discard(worker)
            if not worker.stopped:
                self.idle.append(worker)
            self.lock.notify()

    def close(self) -> None:
        with self.lock:
            self._forked()
            idle, busy, self.idle = self.idle, list(self.busy), []
        for worker in idle:
            worker.stop()
        for worker in busy:
            worker.ended_here = True  # its caller must not start another
            worker.kill()


_POOL = _Pool()
atexit.register(close_workers)
