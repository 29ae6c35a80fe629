"""Waking and waiting: the backoff policy, futex sleep words, waiting on a
peer's counter.

When every rank has a core of its own, a wait spins for
:data:`OWN_CORE_SPIN_SECONDS`; when ranks share cores, it yields at once
(a spin would only delay the rank it waits for). Either way it then yields
for :func:`yield_seconds` (``COLLECTIVES_SHM_YIELD_US``). Then it blocks on a futex over its own
``Q_SLEEP`` word, which a peer wakes (:meth:`Waking._wake`) after writing
anything the sleeper may wait for (a ring's head or tail, the fence
epoch, a window post, the closed and abort flags). Timed sleeps would cost
50 to 100 us each (timer slack, the hypervisor's timer) and wake late; a
woken block returns when the answer is there.
"""

from __future__ import annotations

from typing import Any

from collectives import config
from collectives.errors import CollectiveTimeout
from collectives.waiting import Backoff, futex_wait, futex_wake

from .layout import Q_PID, Q_SLEEP
from .records import WAIT_WINDOW

__all__ = ["Waking", "OWN_CORE_SPIN_SECONDS", "BLOCK_FIRST", "BLOCK_MAX", "spin_seconds", "yield_seconds",
           "compiled_wait_ns"]

#: Spin this long before yielding when every rank has a core of its own.
OWN_CORE_SPIN_SECONDS = 50e-6
#: A blocked wait sleeps until a peer wakes it, but at most this long at first,
#: growing to BLOCK_MAX: the bound on a lost wake-up, and how often a blocked
#: rank looks whether its peers are still alive.
BLOCK_FIRST, BLOCK_MAX = 20e-6, 1e-3


def spin_seconds(size: int, cores: int) -> float:
    """How long a wait spins: :data:`OWN_CORE_SPIN_SECONDS` when the ``size``
    ranks have a core each among ``cores``, else 0 (yield at once)."""
    return OWN_CORE_SPIN_SECONDS if size <= cores else 0.0


def yield_seconds() -> float:
    """How long a wait yields the CPU before it blocks (``COLLECTIVES_SHM_YIELD_US``).

    Blocking hands the core to other work, but a blocked rank runs again
    only when the scheduler wakes it: on a busy machine that costs 100 us
    or more, and once the ranks fall out of step every call pays it (a
    "slow mode" of about 110 us per call, at every size, measured with four
    competing processes on two cores). A rank that yields stays runnable
    and answers within microseconds of being scheduled, as MPI's polling
    ranks do; it blocks only when its peers stay away longer than this.
    """
    return float(config.get("SHM_YIELD_US")) * 1e-6


def compiled_wait_ns(spin: float) -> tuple[int, int]:
    """(spin, yield) in nanoseconds of the compiled window's bounded waits, for
    a transport that spins ``spin`` seconds (see :func:`spin_seconds`)."""
    return int(spin * 1e9), int(yield_seconds() * 1e9)


class Waking:
    """Sleeping on this rank's ``Q_SLEEP`` word, waking peers, and waiting for
    a peer's counter; mixed into :class:`~.transport.SharedMemoryTransport`.

    Reads ``rank``, ``_segs`` (every rank's :class:`~.layout.Segment`),
    ``_sleep_words`` (every rank's ``Q_SLEEP`` address), ``_spin`` (see
    :func:`spin_seconds`) and ``_records``; writes ``Q_SLEEP`` words (its
    own while it blocks, a peer's back to 0 when it wakes it). Waiting on a
    counter checks peers through :meth:`~.liveness.Liveness._check_counter_peer`.
    """

    def _blocker(self, still_waiting) -> Any:
        """A ``block(seconds)`` for :meth:`Backoff.pause`: mark this rank asleep,
        check once more, then block on its sleep word until a peer wakes it
        (:meth:`_wake`) or the time passes."""
        own = self._segs[self.rank].q
        word = self._sleep_words[self.rank]

        def block(seconds: float) -> None:
            own[Q_SLEEP] = 1
            try:
                if still_waiting():
                    futex_wait(word, 1, seconds)
            finally:
                own[Q_SLEEP] = 0
        return block

    def _wake(self, rank: int) -> None:
        """Wake ``rank`` if it sleeps (after this rank wrote something it may wait for)."""
        q = self._segs[rank].q
        if q[Q_SLEEP]:
            q[Q_SLEEP] = 0  # a sleeper that has not blocked yet then returns at once
            futex_wake(self._sleep_words[rank])

    def _wake_all(self) -> None:
        """Wake every peer that sleeps."""
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg is not None:
                self._wake(r)

    def _backoff(self, deadline: float, block_now: bool = False) -> Backoff:
        """The wait policy: spin first when every rank has a core of its own;
        when ranks share cores, yield at once and for a while, then block
        (at once with ``block_now``)."""
        if block_now:
            return Backoff(deadline, "", spins=0, yields=0, first_sleep=BLOCK_FIRST, max_sleep=BLOCK_MAX)
        return Backoff(deadline, "", spins=0 if not self._spin else 20, spin_time=self._spin,
                       yield_time=self._yield, first_sleep=BLOCK_FIRST, max_sleep=BLOCK_MAX)

    def _wait_counter(self, q: memoryview, index: int, target: int, peer: int, deadline: float,
                      what: str, block_now: bool = False) -> None:
        """Wait until ``q[index] >= target`` (a counter owned by ``peer``);
        ``block_now``: the caller has spun and yielded already.

        Raises:
            CollectiveTimeout past ``deadline`` (naming ``what`` and where every
            rank is), or the error of a lost, aborted or diverging peer.
        """
        backoff = self._backoff(deadline, block_now)
        block = None
        below = lambda: q[index] < target  # noqa: E731
        try:
            while q[index] < target:
                if block is None and backoff.count >= backoff.yields:
                    block = self._blocker(below)
                    if self._records is not None:
                        self._records.waiting(WAIT_WINDOW, peer)
                try:
                    backoff.pause(block)
                except CollectiveTimeout:
                    where = f"; {self._records.diagnose(peer)}" if self._records is not None else ""
                    raise CollectiveTimeout(f"rank {self.rank}: {what}: waited for rank {peer} "
                                            f"(pid {self._segs[peer].q[Q_PID]}){where}") from None
                if backoff.count > backoff.spins and q[index] < target:
                    self._check_counter_peer(peer, below)
        finally:
            if block is not None and self._records is not None:
                self._records.waiting(0, 0)

