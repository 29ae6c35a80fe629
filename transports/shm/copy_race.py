"""From which size one cross-memory read beats the window's two copies here.

Between two ranks, a message either goes through the shared window (the sender copies it in, the receiver copies it out) or the
receiver reads it from the sender's private memory in one system call
(cross-memory attach). Which is faster depends on the host and its state,
not the library. A kernel that pins the sender's pages one at a time pays
about 0.2 us per 4 KiB page: on the 2-core test machines a 1 MiB read took
70 us against 35 for both copies, and the window won 2 to 3 times over
from 128 KiB to 1 MiB; minutes later, on the same machine, the direct
calls (one such read each) won from 1 MiB. The rendezvous measures it once (:func:`race`): rank 1 fills
256 KiB, then 1 MiB, of its window region and of its private memory;
rank 0 times its copy out of the one and its read of the other, three
rounds each, and tells every rank from which size the read won. The
window's algorithms take their direct compiled calls by it
(:func:`~collectives.algorithms.window.tuning.compiled_direct`), whether
the ranks have a core each or share cores.
``shm_cma_faster`` / ``COLLECTIVES_SHM_CMA_FASTER`` (1: from every size,
0: from none; rank 0's counts) sets the answer instead.
"""

from __future__ import annotations

import time

import numpy as np

from collectives import compiled
from collectives.window_contract import CMA_NEVER

from . import cma
from .layout import (Q_PID, Q_RACE_BUFFER, Q_RACE_COPY_IN, Q_RACE_DONE, Q_RACE_FROM, Q_RACE_ROUND,
                     Q_RACE_VERDICT, WINDOW_HEADER_BYTES)
from .pages import PAGE

__all__ = ["race", "answer", "RACE_SIZES", "ROUNDS", "NEVER"]

RACE_SIZES = (256 << 10, 1 << 20)  # bytes raced (those the window holds), in increasing size
ROUNDS = 3                         # rounds per size; the fastest of each is kept
NEVER = CMA_NEVER                  # the answer where the read won at no size
MEASURING, DECIDED = 1, 2          # rank 0's Q_RACE_VERDICT (0 until then)
_WHAT = "shared-memory rendezvous (copy race)"


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned private buffer (the kernel's copy is slow for some skews, see :mod:`.cma`)."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes]


def _ns(t0: float) -> int:
    return int((time.perf_counter() - t0) * 1e9)


def race(t, deadline: float, forced: bool | None) -> int:
    """Agree from which size a cross-memory read beats the window's two copies.

    ``t`` is the transport in its rendezvous (its segments mapped, ``cma``
    and ``cores`` agreed). Rank 0 decides: 0 where ``forced`` is True,
    :data:`NEVER` where it is False; else it races with rank 1 when both
    may read each other's memory (the other ranks wait): the smallest raced
    size from which the read won at every raced size (0 when it won at
    the smallest, :data:`NEVER` when it lost at the largest); else 0 (the
    direct calls' tables hold). Returns the agreed bytes.
    """
    q = [s.q for s in t._segs]
    sizes = [n for n in RACE_SIZES if WINDOW_HEADER_BYTES + n <= t._layout.window]
    if t.rank == 0:
        if forced is None and t.cma and t.size >= 2 and sizes:
            q[0][Q_RACE_VERDICT] = MEASURING
            t._wake_all()
            start = answer(sizes, _reader(t, q, sizes, deadline))
        else:
            start = NEVER if forced is False else 0
        q[0][Q_RACE_FROM] = start
        q[0][Q_RACE_VERDICT] = DECIDED  # after the answer (x86 keeps stores in order)
        t._wake_all()
        return start
    t._wait_counter(q[0], Q_RACE_VERDICT, MEASURING if t.rank == 1 else DECIDED, 0, deadline, _WHAT)
    if t.rank == 1 and q[0][Q_RACE_VERDICT] == MEASURING:
        _writer(t, q, sizes, deadline)
        t._wait_counter(q[0], Q_RACE_VERDICT, DECIDED, 0, deadline, _WHAT)
    return int(q[0][Q_RACE_FROM])


def answer(sizes: list[int], wins: list[bool]) -> int:
    """The smallest of ``sizes`` (increasing) from which the read won at
    every larger one too, 0 for the smallest, :data:`NEVER` where it lost
    at the largest."""
    start = 0
    for n, won in zip(sizes, wins):
        if not won:
            start = NEVER
        elif start == NEVER:
            start = n
    return start


def _region(t, rank: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``rank``'s window region, past the algorithms' header."""
    return np.frombuffer(t._segs[rank].mm, np.uint8, nbytes, t._layout.window_off + WINDOW_HEADER_BYTES)


def _writer(t, q, sizes: list[int], deadline: float) -> None:
    """Rank 1: each round, copy into its window region (timed: lines rank 0
    holds), dirty its private buffer, and post the round."""
    src, private = _aligned(sizes[-1]), _aligned(sizes[-1])
    q[1][Q_RACE_BUFFER] = private.ctypes.data
    k = 0
    for n in sizes:
        region, best = _region(t, 1, n), NEVER
        for _ in range(ROUNDS):
            t._wait_counter(q[0], Q_RACE_DONE, k, 0, deadline, _WHAT)
            k += 1
            src[:n].fill(k)
            t0 = time.perf_counter()
            compiled.copy(region, src[:n])
            best = min(best, _ns(t0))
            private[:n].fill(k)
            q[1][Q_RACE_COPY_IN] = best
            q[1][Q_RACE_ROUND] = k  # after the copy-in's time (x86 keeps stores in order)
            t._wake_all()
        del region
    t._wait_counter(q[0], Q_RACE_DONE, k, 0, deadline, _WHAT)  # rank 0 read the private buffer


def _reader(t, q, sizes: list[int], deadline: float) -> list[bool]:
    """Rank 0: time each round's copy out of rank 1's region and read of its
    private buffer; per size, whether the read beat the copy in plus out."""
    pid = int(q[1][Q_PID])
    out, via = _aligned(sizes[-1]), _aligned(sizes[-1])
    wins, times, k = [], {}, 0
    for n in sizes:
        region, best_out, best_read, readable = _region(t, 1, n), NEVER, NEVER, True
        for _ in range(ROUNDS):
            k += 1
            t._wait_counter(q[1], Q_RACE_ROUND, k, 1, deadline, _WHAT)
            t0 = time.perf_counter()
            compiled.copy(out[:n], region)
            best_out = min(best_out, _ns(t0))
            t0 = time.perf_counter()
            readable = cma.cma_read(pid, int(q[1][Q_RACE_BUFFER]), via[:n]) and readable
            best_read = min(best_read, _ns(t0))
            best_in = int(q[1][Q_RACE_COPY_IN])
            q[0][Q_RACE_DONE] = k
            t._wake_all()
        del region
        times[n] = {"copy_in_ns": best_in, "copy_out_ns": best_out, "read_ns": best_read}
        wins.append(readable and best_read < best_in + best_out)
    t.copy_race = times
    return wins
