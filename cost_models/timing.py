"""Timing one collective call the way its cost model defines it.

A cost model predicts the time from the moment every rank starts a call
together to the moment the last rank finishes it. Starting after a barrier
adds the barrier's skew (ranks leave it up to a message latency apart),
which for a microsecond collective is most of what gets measured. When
every rank reads the same monotonic clock (one kernel, which network
namespaces share), :func:`slowest_best` instead agrees on a start instant a
little in the future, every rank waits for it on the clock, and the time is
the latest finish minus that instant. A rank that reaches the agreement
after the instant makes that try void, and the lead doubles. Ranks on
different kernels fall back to starting after a barrier.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import time
import weakref
from typing import Callable

import numpy as np

__all__ = ["shared_clock", "slowest_best", "slowest_best_each", "timed_rounds", "sleep_until", "collective_call",
           "START_LEAD"]

#: First lead of the agreed start over the agreement itself (seconds).
START_LEAD = 200e-6
#: Sleep (rather than yield) while the start is further off than this.
_SLEEP_MARGIN = 300e-6

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_clock_shared: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _kernel_id() -> int:
    """A 63-bit id of the running kernel instance (its boot id), or a random one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.urandom(16)  # unknown: no two ranks will match
    return int.from_bytes(hashlib.sha256(boot).digest()[:8], "little") >> 1


def shared_clock(comm) -> bool:
    """Whether every rank of ``comm`` reads the same ``time.monotonic`` clock
    (they run on one kernel). Collective; the answer is cached per communicator."""
    known = _clock_shared.get(comm)
    if known is None:
        ids = np.zeros(comm.size, np.int64)
        comm.allgather(np.array([_kernel_id()], np.int64), ids)
        known = _clock_shared[comm] = bool((ids == ids[0]).all())
    return known


def sleep_until(instant: float) -> None:
    """Return at ``time.monotonic() >= instant``: sleep while it is far, then yield."""
    while True:
        left = instant - time.monotonic()
        if left <= 0:
            return
        if left > _SLEEP_MARGIN:
            time.sleep(left - _SLEEP_MARGIN)
        else:
            _yield()


class _Timer:
    """One timed try at a time of collective calls on ``comm``, from a common
    start where the ranks share a clock, else from a barrier."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.common_start = comm.size > 1 and shared_clock(comm)
        self.lead = START_LEAD
        self.stamp = np.zeros(2)

    def once(self, call: Callable[[], object], last_chance: bool) -> float | None:
        """``call()``'s time to the slowest rank's finish, or None (every rank
        alike) when some rank learnt the common start too late; then the lead
        doubles. With ``last_chance`` a late try counts anyway."""
        comm, stamp = self.comm, self.stamp
        if not self.common_start:
            comm.barrier()
            t0 = time.perf_counter()
            call()
            stamp[0] = time.perf_counter() - t0
            comm.allreduce(stamp[:1], op="max", algorithm="recursive_doubling")
            return float(stamp[0])
        monotonic = time.monotonic
        stamp[0] = monotonic() + self.lead
        comm.allreduce(stamp[:1], op="max", algorithm="recursive_doubling")
        start = float(stamp[0])
        stamp[1] = monotonic() - start  # > 0: this rank learnt the start too late
        sleep_until(start)
        call()
        stamp[0] = monotonic()
        comm.allreduce(stamp, op="max", algorithm="recursive_doubling")
        if stamp[1] > 0 and not last_chance:
            self.lead *= 2
            return None
        return float(stamp[0]) - start


def slowest_best(comm, call: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` (after one warm-up) of ``call()``'s time from a common
    start to the last rank's finish (see the module's docstring). Collective."""
    return slowest_best_each(comm, {None: call}, repeats)[None]


def slowest_best_each(comm, calls: dict, repeats: int) -> dict:
    """:func:`slowest_best` of every call in ``calls`` (name to function),
    interleaved (see :func:`timed_rounds`). Returns name to seconds.
    Collective (every rank passes the same names in the same order)."""
    return {name: min(times) for name, times in timed_rounds(comm, calls, repeats).items()}


def timed_rounds(comm, calls: dict, repeats: int) -> dict:
    """``repeats`` times of every call in ``calls`` (name to function),
    each from a common start to the slowest rank's finish, in rounds: each
    round times every call once, so that a slow spell of the machine falls
    on all of them rather than on whichever ran then. Each timed call
    follows an untimed one of its own, so that it finds the caches as a run
    of its own calls leaves them (a program calls one algorithm over and
    over), not as another algorithm's call left them: a window's segments,
    evicted by a ring's buffers, made a 4 MiB allreduce through the window
    look twice as slow as it runs in a loop.
    Returns name to the list of seconds, in the order taken. Collective."""
    timer = _Timer(comm)
    times: dict = {name: [] for name in calls}
    tries = 0
    while any(len(t) < repeats for t in times.values()):
        tries += 1
        for name, call in calls.items():
            if len(times[name]) < repeats:
                call()
                t = timer.once(call, last_chance=tries >= 4 * repeats)
                if t is not None:
                    times[name].append(t)
    return times


#: glibc's mallopt parameter M_MMAP_THRESHOLD.
_M_MMAP_THRESHOLD = -3


@functools.lru_cache(maxsize=1)
def _fresh_pages_for_large_buffers() -> None:
    """Keep this process's large buffers on pages of their own (glibc's
    default until the first large free): glibc raises its mmap threshold each
    time a large buffer is freed, and later ones then come from the heap, on
    other pages (no huge pages, other alignments), which can change a
    direct read's time twofold. Measurements that free and allocate as they
    go would otherwise measure the early points on one kind of memory and
    the later ones on the other."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        pass


def collective_call(comm, collective: str, count: int, dtype: np.dtype) -> Callable[[str], object]:
    """``call(algorithm)`` running one ``collective`` on buffers made once.

    ``count`` elements in the selector's size convention (the whole vector;
    blocked collectives give each rank ``count // p``, at least 1).
    """
    p = comm.size
    _fresh_pages_for_large_buffers()

    def zeros(n: int) -> np.ndarray:
        # written, not np.zeros: untouched pages all map the kernel's one zero
        # page, which a peer reading them directly finds in its cache
        # (zeros: repeated sums never overflow)
        out = np.empty(n, dtype)
        out.fill(0)
        return out

    buf = zeros(count)  # made once
    if collective == "bcast":
        return lambda algo: comm.bcast(buf, 0, algorithm=algo)
    if collective == "reduce":
        return lambda algo: comm.reduce(buf, 0, algorithm=algo)
    if collective == "allreduce":
        return lambda algo: comm.allreduce(buf, algorithm=algo)
    if collective == "barrier":
        return lambda algo: comm.barrier(algorithm=algo)
    block = max(count // p, 1)
    whole, part = zeros(block * p), zeros(block)
    if collective == "allgather":
        return lambda algo: comm.allgather(None, whole, algorithm=algo)
    if collective == "reduce_scatter":
        return lambda algo: comm.reduce_scatter(whole, part, algorithm=algo)
    if collective == "alltoall":
        out = zeros(block * p)
        return lambda algo: comm.alltoall(whole, out, algorithm=algo)
    if collective == "scatter":
        return lambda algo: comm.scatter(whole, part, 0, algorithm=algo)
    if collective == "gather":
        return lambda algo: comm.gather(part, whole, 0, algorithm=algo)
    raise ValueError(f"unknown collective {collective!r}")
