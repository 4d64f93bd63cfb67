"""Fences around other packages' internals: the versions they were read and tested in.

npllm reaches into a few packages' internals where their public API cannot do what it needs: Numba's code
libraries and cache index (kernels/compiler.py), uvicorn's h11 protocol and server state (serve/app.py). Internals
may change in any release, so each such use is fenced by the range of versions it is known in, the range
pyproject.toml allows: Fence.holds(version) says whether a version lies in it; outside it (or where the version
cannot be read), the first call prints one notice on stderr, and the caller keeps to the package's plain behaviour
rather than break.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass


@dataclass
class Fence:
    """The versions of `package` in which npllm's `uses` of its internals are tested: [first, first not), each as
    (major, minor). `fallback` says what runs outside it, for the notice."""

    package: str
    tested: tuple[tuple[int, int], tuple[int, int]]
    uses: str
    fallback: str
    noticed: bool = False  # whether this process has said that its version is outside `tested`

    def holds(self, version: str) -> bool:
        """Whether `version` lies in `tested`; outside it, one notice on stderr the first time."""
        found = re.match(r"(\d+)\.(\d+)", version)
        low, high = self.tested
        if found and low <= (int(found[1]), int(found[2])) < high:
            return True
        if not self.noticed:
            self.noticed = True
            name = self.package
            print(f"[npllm] {name} {version} is outside the versions npllm's {self.uses} were tested with "
                  f"({low[0]}.{low[1]} <= {name} < {high[0]}.{high[1]}): {self.fallback}", file=sys.stderr,
                  flush=True)
        return False
