"""Whether one cross-memory read beats the window's two copies on this host.

Between two ranks with a core each, a message either goes through the
shared window (the sender copies it in, the receiver copies it out) or the
receiver reads it from the sender's private memory in one system call
(cross-memory attach). Which is faster depends on the host, not the
library: a kernel that pins the sender's pages one at a time pays about
0.25 us per 4 KiB page (a 1 MiB read in 73 us here, against 19 for a
copy in user space), so the window's two copies win; where the caches
hand lines between cores slowly, each copy costs more than the pinning
and the single read wins. The rendezvous measures it once (:func:`race`):
rank 1 fills 256 KiB of its window region and of its private memory,
rank 0 times its copy out of the one and its read of the other, three
rounds, and tells every rank. The window's algorithms then take their
direct compiled calls only where the read won
(:func:`~collectives.algorithms.window.tuning.compiled_direct`).
``shm_cma_faster`` / ``COLLECTIVES_SHM_CMA_FASTER`` (1 or 0, rank 0's
counts) sets the answer instead.
"""

from __future__ import annotations

import time

import numpy as np

from collectives import compiled

from . import cma
from .layout import (Q_PID, Q_RACE_BUFFER, Q_RACE_COPY_IN, Q_RACE_DONE, Q_RACE_ROUND, Q_RACE_VERDICT,
                     WINDOW_HEADER_BYTES)
from .pages import PAGE

__all__ = ["race", "RACE_BYTES", "ROUNDS", "FASTER", "SLOWER", "MEASURING"]

RACE_BYTES = 256 << 10  # bytes each round moves both ways (in the L2 cache of one core)
ROUNDS = 3              # the fastest of each is kept
MEASURING, FASTER, SLOWER = 1, 2, 3  # rank 0's Q_RACE_VERDICT (0 until it knows)
_WHAT = "shared-memory rendezvous (copy race)"


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned private buffer (the kernel's copy is slow for some skews, see :mod:`.cma`)."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes]


def _ns(t0: float) -> int:
    return int((time.perf_counter() - t0) * 1e9)


def race(t, deadline: float, forced: bool | None) -> bool:
    """Agree whether a cross-memory read is faster than the window's two copies.

    ``t`` is the transport in its rendezvous (its segments mapped, ``cma``
    and ``cores`` agreed). Rank 0 decides: ``forced`` when set, else a
    measurement with rank 1 when both may read each other's memory, have a
    core each and the window holds the bytes; else the answer is True (the
    direct calls' tables hold for it). Returns the agreed answer.
    """
    q = [s.q for s in t._segs]
    if t.rank == 0:
        measure = (forced is None and t.cma and t.size >= 2 and t.cores >= t.size
                   and t._layout.window >= WINDOW_HEADER_BYTES + RACE_BYTES)
        if measure:
            q[0][Q_RACE_VERDICT] = MEASURING
            t._wake_all()
            faster = _reader(t, q, deadline)
        else:
            faster = True if forced is None else forced
        q[0][Q_RACE_VERDICT] = FASTER if faster else SLOWER
        t._wake_all()
        return faster
    t._wait_counter(q[0], Q_RACE_VERDICT, MEASURING if t.rank == 1 else FASTER, 0, deadline, _WHAT)
    if t.rank == 1 and q[0][Q_RACE_VERDICT] == MEASURING:
        _writer(t, q, deadline)
        t._wait_counter(q[0], Q_RACE_VERDICT, FASTER, 0, deadline, _WHAT)
    return q[0][Q_RACE_VERDICT] == FASTER


def _region(t, rank: int) -> np.ndarray:
    """``RACE_BYTES`` of ``rank``'s window region, past the algorithms' header."""
    lay = t._layout
    start = lay.window_off + WINDOW_HEADER_BYTES
    return np.frombuffer(t._segs[rank].mm, np.uint8, RACE_BYTES, start)


def _writer(t, q, deadline: float) -> None:
    """Rank 1: each round, copy into its window region (timed: lines rank 0
    holds), dirty its private buffer, and post the round."""
    src, private = _aligned(RACE_BYTES), _aligned(RACE_BYTES)
    region = _region(t, 1)
    q[1][Q_RACE_BUFFER] = private.ctypes.data
    best = 1 << 62
    for k in range(1, ROUNDS + 1):
        t._wait_counter(q[0], Q_RACE_DONE, k - 1, 0, deadline, _WHAT)
        src.fill(k)
        t0 = time.perf_counter()
        compiled.copy(region, src)
        best = min(best, _ns(t0))
        private.fill(k)
        q[1][Q_RACE_COPY_IN] = best
        q[1][Q_RACE_ROUND] = k  # after the copy-in's time (x86 keeps stores in order)
        t._wake_all()
    t._wait_counter(q[0], Q_RACE_DONE, ROUNDS, 0, deadline, _WHAT)  # rank 0 read the private buffer
    del region


def _reader(t, q, deadline: float) -> bool:
    """Rank 0: time each round's copy out of rank 1's region and read of
    its private buffer; the read wins when it beats the copy in plus out."""
    out, via = _aligned(RACE_BYTES), _aligned(RACE_BYTES)
    region = _region(t, 1)
    pid = int(q[1][Q_PID])
    best_out = best_read = 1 << 62
    readable = True
    for k in range(1, ROUNDS + 1):
        t._wait_counter(q[1], Q_RACE_ROUND, k, 1, deadline, _WHAT)
        t0 = time.perf_counter()
        compiled.copy(out, region)
        best_out = min(best_out, _ns(t0))
        t0 = time.perf_counter()
        readable = cma.cma_read(pid, int(q[1][Q_RACE_BUFFER]), via) and readable
        best_read = min(best_read, _ns(t0))
        q[0][Q_RACE_DONE] = k
        t._wake_all()
    del region
    best_in = int(q[1][Q_RACE_COPY_IN])
    t.copy_race = {"copy_in_ns": best_in, "copy_out_ns": best_out, "read_ns": best_read}
    return readable and best_read < best_in + best_out
