"""The one stderr line that explains a first run's silence: Numba compiling, or the NumPy reference answering while
a background process compiles."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from .shared import WAIT_COMPILE


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

    from ..models import BEHIND

    class Notice(event.Listener):
        shown = False

        def on_start(self, ev) -> None:
            if not self.shown:
                self.shown = True
                print(behind_notice(**ev.data) if ev.kind == BEHIND else
                      "[npllm] compiling kernels for this CPU: the first run takes 2-4 minutes on 2 cores (one "
                      "compile for every model, float32 or quantized); later runs load them from Numba's cache",
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
    took = "2-4 minutes on 2 cores: one compile for every model, float32 or quantized"
    if waits:
        return (f"[npllm] compiling kernels for this CPU, once ({took}; later runs load them from Numba's cache): a "
                f"greedy or seeded run of a quantized model waits for them, since the NumPy reference could pick "
                f"other tokens (a sampled run without --seed would not wait)")
    same = "" if quantized else " (the same greedy tokens)"
    return (f"[npllm] this CPU's kernels are not compiled yet: this run uses the NumPy "
            f"reference{same}, slower per token, while a background process compiles them into Numba's cache, "
            f"once ({took}); later runs use them. {WAIT_COMPILE}=1 waits for the compile instead")
