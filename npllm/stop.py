"""Stop strings: end a completion at the first occurrence of any of them, even when one spans several tokens.

Text arrives piece by piece. A piece cannot be released while its end could still be the beginning of a stop
string ("Once up" might become "Once upon" with stop "upon"), so the filter holds back the longest tail of the
text that is a prefix of some stop string, and releases it only once the next piece rules the stop out.
The completion never contains the stop string itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from .errors import GenerationError


class StopStrings:
    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(stops)
        if any(not s for s in self.stops):
            raise GenerationError("a stop string must not be empty")
        self.pending = ""  # text received but not yet released: [released ... | pending]
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece of text; return what can be released now (everything before a stop, once one is seen)."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self.pending + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return text[:cut]
        hold = self._held_tail(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The generation ended without a stop: release what was held back."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def cut_at_stop(text: str, stops: Iterable[str]) -> str:
    """text up to the first occurrence of any stop string (all of it when none occurs)."""
    return min((text[:i] for i in (text.find(s) for s in stops) if i >= 0), key=len, default=text)


def text_of_steps(decoder, steps: Iterable, stops: StopStrings, on_step: Callable | None = None) -> Iterator[str]:
    """The text of generation steps: each step's ids through a stream decoder (which releases whole UTF-8
    characters only), held while it may begin a stop string (which ends the text and is not part of it).

    The caller primes the decoder: a completion feeds it the prompt's ids first, so that the first generated piece
    keeps the space it has after the prompt; a chat reply starts a fresh decoder, so the reply's leading space is
    dropped as at the start of any text."""
    for step in steps:
        if on_step is not None:
            on_step(step)
        piece = stops.feed(decoder.feed(step.token_ids))
        if piece:
            yield piece
        if stops.stopped:
            return
    tail = stops.feed(decoder.flush()) + stops.flush()
    if tail:
        yield tail
