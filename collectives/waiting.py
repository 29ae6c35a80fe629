"""Backoff for busy-waits: spin, then yield the CPU, then sleep a little longer each time.

Many ranks may share few cores (the tests run 8 ranks on 2), so a waiter
must step aside quickly once the answer is not immediate, yet react within
microseconds when it is. :class:`Backoff` does both: about ``spins`` bare
checks, then ``yields`` calls to ``os.sched_yield()``, then sleeps growing
geometrically from ``first_sleep`` to ``max_sleep``.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from .errors import CollectiveTimeout

__all__ = ["Backoff", "wait_until", "SPINS", "YIELDS", "FIRST_SLEEP", "MAX_SLEEP"]

SPINS = 20
YIELDS = 20
FIRST_SLEEP = 20e-6
MAX_SLEEP = 1e-3

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_monotonic = time.monotonic


class Backoff:
    """One wait's backoff state.

    Args:
        deadline: ``time.monotonic()`` past which :meth:`pause` raises.
        what: describes the wait in the timeout message.
        spins, yields: bare checks, then ``sched_yield`` calls, before sleeping.
        first_sleep, max_sleep: the sleep grows from one to the other (seconds).
        spin_time: keep spinning at least this long (seconds); worth it only
            when every rank has a core of its own.

    Call :meth:`pause` each time the awaited condition is still false.
    """

    __slots__ = ("deadline", "what", "count", "spins", "yields", "sleep", "max_sleep", "spin_until",
                 "spin_time")

    def __init__(self, deadline: float, what: str = "wait", *, spins: int = SPINS,
                 yields: int = YIELDS, first_sleep: float = FIRST_SLEEP,
                 max_sleep: float = MAX_SLEEP, spin_time: float = 0.0) -> None:
        self.deadline = deadline
        self.what = what
        self.count = 0
        self.spins = spins
        self.spin_time = spin_time
        self.spin_until = _monotonic() + spin_time if spin_time else 0.0
        self.yields = spins + yields
        self.sleep = first_sleep
        self.max_sleep = max_sleep

    @property
    def sleeping(self) -> bool:
        """True once the wait has moved past spinning and yielding."""
        return self.count > self.yields

    def pause(self) -> None:
        """Wait a little (spin, yield or sleep); CollectiveTimeout past the deadline."""
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
        else:
            time.sleep(self.sleep)
            self.sleep = min(self.sleep * 1.5, self.max_sleep)
        if _monotonic() > self.deadline:
            raise CollectiveTimeout(f"{self.what} timed out")

    def reset(self) -> None:
        """Start over with spinning (after progress was made)."""
        self.count = 0
        self.sleep = FIRST_SLEEP
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
