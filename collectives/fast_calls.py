"""Prepared calls run straight from C, before any Python of the call.

A communicator keeps its prepared calls (:mod:`.prepared`) in Python; those
that are a shared window's compiled calls, run on the call's arrays as they
are, it also keeps in a :class:`FastCalls` of the C extension, under the
objects the call passed (collective, algorithm, root, op: compared by
identity) and each array's dtype (by identity) and size. The public methods
ask it first: it finds the entry, makes the checks the Python path makes
(one-dimensional numpy arrays, C-contiguous, writable where written, apart
where they must be, no nonblocking call queued, the communicator open),
takes the next call number and runs the compiled call. A miss costs a
lookup and falls through to the Python path, which checks everything as
usual. The call number lives in the same object, so both paths count alike.

Where the extension is not built or is off, :class:`NoFastCalls` stands in:
it keeps the call number and misses every time.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import compiled
from .numpy_layout import reads_numpy_right

__all__ = ["NoFastCalls", "make"]


class NoFastCalls:
    """The stand-in without the extension: a call number, and no entries."""

    def __init__(self) -> None:
        self.seq = 0
        self.open = 1
        self.generation = 0
        self.hits = 0

    def run(self, collective: str, algorithm: Any, root: Any, op: Any, a: Any, b: Any, timeout: Any) -> bool:
        """Always a miss."""
        return False

    def add(self, *args: Any) -> bool:
        """Keeps nothing."""
        return False

    def clear(self) -> None:
        """Nothing to forget."""


def make(queue: Any, wait: Callable[[tuple, tuple, Any, int], None]) -> Any:
    """The communicator's fast calls: a ``FastCalls`` of the extension over
    its queue of nonblocking calls (whose ``busy`` must be 0) and ``wait``
    (``wait(info, arrays, late, seq)``: the rest of a run that has to wait,
    or raise why it stopped), or a :class:`NoFastCalls`."""
    ext = compiled.enabled()
    if ext is None or not hasattr(ext, "FastCalls"):
        return NoFastCalls()
    fast = ext.FastCalls(np.ndarray, queue, wait)
    return fast if reads_numpy_right(fast) else NoFastCalls()
