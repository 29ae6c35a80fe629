"""Backoff for busy-waits: spin, then yield the CPU, then sleep or block.

Many ranks may share few cores (the tests run 8 ranks on 2), so a waiter
must step aside quickly once the answer is not immediate, yet react within
microseconds when it is. :class:`Backoff` does both: about ``spins`` bare
checks, then ``yields`` calls to ``os.sched_yield()``, then sleeps growing
geometrically from ``first_sleep`` to ``max_sleep``.

A sleep of a few microseconds costs 50 to 100 us on Linux (timer slack and
the hypervisor's timer), far more than the wait it replaces. Where the
writer can tell a sleeper (shared memory), the waiter blocks instead on a
futex (:func:`futex_wait`) that the writer rings (:func:`futex_wake`): the
waiter leaves the CPU to the ranks that have work, and wakes as soon as its
answer is written. A block is bounded like a sleep, so a lost wake-up costs
at most that bound.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from typing import Callable

from .errors import CollectiveTimeout

__all__ = ["Backoff", "wait_until", "futex_wait", "futex_wake", "HAVE_FUTEX",
           "SPINS", "YIELDS", "FIRST_SLEEP", "MAX_SLEEP"]

SPINS = 20
YIELDS = 20
FIRST_SLEEP = 20e-6
MAX_SLEEP = 1e-3

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_monotonic = time.monotonic

# ------------------------------------------------------------------ futex

_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word lives in shared memory
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _load_syscall():
    if _FUTEX_SYSCALL is None or not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn


_syscall = _load_syscall()
#: True where :func:`futex_wait` blocks (Linux on x86-64 or AArch64); elsewhere it sleeps.
HAVE_FUTEX = _syscall is not None


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Block until the 32-bit word at ``address`` is woken by :func:`futex_wake`,
    or ``seconds`` pass; return at once if it no longer holds ``expected``.

    The word must lie in memory shared between the processes (a file or
    /dev/shm mapping). Without futexes this is ``time.sleep(seconds)``.
    """
    if _syscall is None:
        time.sleep(seconds)
        return
    sec = int(seconds)
    ts = _Timespec(sec, int((seconds - sec) * 1e9))
    _syscall(_FUTEX_SYSCALL, address, _FUTEX_WAIT, expected, ctypes.addressof(ts), None, 0)


def futex_wake(address: int) -> None:
    """Wake every process blocked in :func:`futex_wait` on the word at ``address``."""
    if _syscall is not None:
        _syscall(_FUTEX_SYSCALL, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


class Backoff:
    """One wait's backoff state.

    Args:
        deadline: ``time.monotonic()`` past which :meth:`pause` raises.
        what: describes the wait in the timeout message.
        spins, yields: bare checks, then ``sched_yield`` calls, before sleeping.
        first_sleep, max_sleep: the sleep grows from one to the other (seconds).
        spin_time: keep spinning at least this long (seconds); worth it only
            when every rank has a core of its own.
        yield_time: keep yielding at least this long (seconds); for ranks
            that share cores, where a spin only delays the rank waited for
            and a sleep or a block leaves the core idle until a slow wake-up.

    Call :meth:`pause` each time the awaited condition is still false.
    """

    __slots__ = ("deadline", "what", "count", "spins", "yields", "sleep", "max_sleep", "spin_until",
                 "spin_time", "yield_time", "yield_until")

    def __init__(self, deadline: float, what: str = "wait", *, spins: int = SPINS,
                 yields: int = YIELDS, first_sleep: float = FIRST_SLEEP,
                 max_sleep: float = MAX_SLEEP, spin_time: float = 0.0, yield_time: float = 0.0) -> None:
        self.deadline = deadline
        self.what = what
        self.count = 0
        self.spins = spins
        self.spin_time = spin_time
        self.spin_until = _monotonic() + spin_time if spin_time else 0.0
        self.yields = spins + yields
        self.yield_time = yield_time
        self.yield_until = 0.0
        self.sleep = first_sleep
        self.max_sleep = max_sleep

    @property
    def sleeping(self) -> bool:
        """True once the wait has moved past spinning and yielding."""
        return self.count > self.yields

    def pause(self, block: Callable[[float], None] | None = None) -> None:
        """Wait a little (spin, yield, then sleep, or ``block(seconds)`` when given:
        a wait that a writer may end early, see :func:`futex_wait`);
        CollectiveTimeout past the deadline."""
        self.count = n = self.count + 1
        if n <= self.spins:
            return
        if self.spin_until:
            if _monotonic() < self.spin_until:
                self.count = self.spins
                return
            self.spin_until = 0.0
        if n <= self.yields:
            _yield()
        elif self.yield_time and self._yielding():
            self.count = self.yields
            _yield()
        else:
            if block is None:
                time.sleep(self.sleep)
            else:
                block(min(self.sleep, max(self.deadline - _monotonic(), 0.0)))
            self.sleep = min(self.sleep * 1.5, self.max_sleep)
        if _monotonic() > self.deadline:
            raise CollectiveTimeout(f"{self.what} timed out")

    def _yielding(self) -> bool:
        """Whether the timed yield phase (``yield_time``) still runs; starts it."""
        now = _monotonic()
        if not self.yield_until:
            self.yield_until = now + self.yield_time
        return now < self.yield_until

    def reset(self) -> None:
        """Start over with spinning (after progress was made)."""
        self.count = 0
        self.sleep = FIRST_SLEEP
        self.yield_until = 0.0
        if self.spin_time:
            self.spin_until = _monotonic() + self.spin_time


def wait_until(predicate: Callable[[], bool], deadline: float, on_check: Callable[[], None] | None = None,
               what: str = "wait", check_every: float = 0.005) -> None:
    """Return once ``predicate()`` is true.

    Args:
        predicate: the awaited condition.
        deadline: ``time.monotonic()`` past which CollectiveTimeout is raised.
        on_check: called about every ``check_every`` seconds while waiting
            (e.g. to raise PeerLost when a peer died).
        what: describes the wait in the timeout message.
        check_every: seconds between ``on_check`` calls.

    Raises:
        CollectiveTimeout: the deadline passed first.
    """
    if predicate():
        return
    backoff = Backoff(deadline, what)
    next_check = _monotonic() + check_every
    while not predicate():
        backoff.pause()
        if on_check is not None and backoff.count > backoff.spins:
            now = _monotonic()
            if now >= next_check:
                on_check()
                next_check = now + check_every
