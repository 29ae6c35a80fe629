"""The algorithms' view of a window: how they lay out a region, the halves
used in turns, and views made once per window.

Each rank's region is a metadata block (:data:`META_BYTES`, where the
direct paths publish their buffers) and two halves (:attr:`WindowState.half`
bytes each) used on alternate steps, so that a rank may fill one half for
the next step while slower ranks still read the other. The window counts
the steps (see :class:`~collectives.window_contract.SharedWindow`): step k
uses half ``(k - 1) % 2``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...prepared import BoundedCache
from .tuning import PIECE_BYTES, one_fence_limit

__all__ = ["META_BYTES", "DATA_OFFSET", "PAGE", "WindowState", "state_of", "window_state", "single_fence",
           "two_step_call", "budget", "region"]

#: Bytes at the start of each region for the direct paths' metadata.
META_BYTES = 4096
#: The halves start this far into the region and are whole pages long, so
#: that both sit half a page off the page grid. Memory copies out of a half
#: into a buffer that starts 1 to 31 bytes past the same place in a page run
#: about 8 times slower here (the string-copy instruction stalls on 4 KiB
#: aliasing), and that is where malloc puts large arrays: 16 bytes past a
#: page. Half a page off, no common alignment of user buffers comes near.
DATA_OFFSET = META_BYTES + 2048
PAGE = 4096

class WindowState:
    """Per-window bookkeeping shared by the algorithms: the halves, every
    rank's region, and a cache (``cache``) of what is made once per buffer
    shape or call signature (views, pieces, prepared calls)."""

    def __init__(self, window, size: int) -> None:
        cap = window.capacity
        self.half = max(((cap - DATA_OFFSET) // 2) // PAGE * PAGE, 0)
        self.window = window
        self.regions = [window.region(r) for r in range(size)]
        self.cache = BoundedCache()

    def next_half(self, deadline: float) -> int:
        """Byte offset of the half to use for the next step (they alternate;
        the window counts the steps, its compiled calls' too, and makes sure
        the half is free)."""
        return DATA_OFFSET + ((self.window.step(deadline) - 1) & 1) * self.half

    def views(self, offset: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's region bytes [offset, offset + nbytes) as ``dtype`` (cached)."""
        key = (offset, nbytes, dtype)
        got = self.cache.get(key)
        if got is None:
            got = [reg[offset:offset + nbytes].view(dtype) for reg in self.regions]
            self.remember(key, got)
        return got

    def remember(self, key: tuple, value: object) -> object:
        """Keep ``value`` under ``key`` (see :class:`~collectives.prepared.BoundedCache`); returns it."""
        return self.cache.keep(key, value)


def state_of(ctx) -> tuple[object, WindowState]:
    """(window, its state) of the call's transport."""
    return window_state(ctx.transport.window, ctx.size)


def window_state(window, size: int) -> tuple[object, WindowState]:
    """(``window``, its :class:`WindowState`, made on first use and kept
    in the window's ``kept``, which the window empties when released)."""
    st = window.kept.get(WindowState)
    if st is None:
        st = window.kept[WindowState] = WindowState(window, size)
    return window, st


def single_fence(nbytes: int, p: int, st: WindowState, limit: int | None = None) -> bool:
    """Whether ``nbytes`` take the one-fence path (every rank's copy in the
    window): up to ``limit`` (default :func:`~.tuning.one_fence_limit`) and a half."""
    return nbytes <= min(one_fence_limit(p) if limit is None else limit, st.half)


def two_step_call(window, st: WindowState, buf: np.ndarray, rule: Callable[[int, int, int], bool]) -> bool:
    """Whether ``buf`` takes a compiled call of two steps: the collective's
    ``rule(nbytes, p, cores)`` says so (:func:`~.tuning.allreduce_two_steps`,
    :func:`~.tuning.reduce_two_steps`), ``buf`` has an element for every
    rank, and it fits a half."""
    return (rule(buf.nbytes, window.size, window.cores)
            and buf.size >= window.size and buf.nbytes <= st.half)


def budget(st: WindowState) -> int:
    """Bytes one rank may put in a half at a time."""
    return min(st.half, PIECE_BYTES)


def region(st: WindowState, rank: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``offset`` of ``rank``'s region."""
    return st.regions[rank][offset:offset + count * dtype.itemsize].view(dtype)
