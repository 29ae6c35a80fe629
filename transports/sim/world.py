"""The virtual world: every rank's clock, the scheduler, the matching queues.

The real algorithm code runs, one thread per rank, but only one rank runs at
a time: the one with the earliest virtual clock (a conservative
discrete-event simulation). Every message is scheduled on the network
(:mod:`.network`) when it is posted, in virtual-time order, so the result
is deterministic.

* A send completes when its message arrives (eager: the transfer does not
  wait for the receive to be posted);
* a receive completes at ``max(arrival, post time of the receive)``;
* a rank that waits jumps its clock to the completion time of what it waits
  for; local work (:meth:`SimWorld.charge`) advances the rank's clock.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from typing import Sequence

import numpy as np

from collectives import signature
from collectives.errors import MismatchedCollective, PeerLost
from collectives.signature import NO_SIG, Sig
from collectives.transport import Request

from .network import Network, SimParams

__all__ = ["SimWorld", "SimRequest"]


class SimRequest(Request):
    """A send or receive; ``done_at`` is its completion time once known."""

    __slots__ = ("world", "rank", "done_at", "buf")

    def __init__(self, world: "SimWorld", rank: int, buf: np.ndarray | None) -> None:
        self.world, self.rank, self.buf = world, rank, buf
        self.done_at: float | None = None

    def wait(self, timeout: float | None = None) -> None:
        self.world.wait(self.rank, (self,))

    def test(self) -> bool:
        self.world.check_error()
        return self.done_at is not None and self.done_at <= self.world.clock[self.rank]


class _Message:
    __slots__ = ("data", "arrival", "sig")

    def __init__(self, data: np.ndarray, arrival: float, sig: Sig) -> None:
        self.data, self.arrival, self.sig = data, arrival, sig


class _Posted:
    __slots__ = ("req", "posted_at", "sig", "src")

    def __init__(self, req: SimRequest, posted_at: float, sig: Sig, src: int) -> None:
        self.req, self.posted_at, self.sig, self.src = req, posted_at, sig, src


class SimWorld:
    """The virtual machine: clocks, the scheduler, the matching queues and the network.

    Exactly one rank thread runs at a time; a rank that waits hands the
    baton to the rank with the earliest wake-up time (ties broken by order
    of arrival in the queue).
    """

    def __init__(self, size: int, params: SimParams | None = None, topology: str = "full") -> None:
        self.size = size
        self.params = params or SimParams()
        self.net = Network(size, self.params, topology)
        self.clock = [0.0] * size
        # One binary semaphore per rank: released to hand the rank the baton.
        self._wake = [threading.Lock() for _ in range(size)]
        for lock in self._wake:
            lock.acquire()
        self._wake_at: list[float] = [0.0] * size
        self._heap: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self._waiting: list[Sequence[SimRequest] | None] = [None] * size
        self._done = [False] * size
        self._recvs: dict[tuple[int, int, int], deque[_Posted]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[_Message]] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._joined = 0
        self._started = False
        self.switches = 0

    # -- scheduling

    def start(self) -> None:
        """Queue every rank at time 0 and let the first one run."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for r in range(self.size):
            self._push(r, 0.0)
        self._handoff(None)

    def join(self) -> None:
        """Called once per rank thread before its first operation: the world
        starts when every rank has joined; then this rank waits for its turn."""
        with self._lock:
            self._joined += 1
            last = self._joined == self.size
        if last:
            self.start()

    def enter(self, rank: int) -> None:
        """Block the calling rank thread until the scheduler gives it the baton."""
        self._wake[rank].acquire()
        self.clock[rank] = max(self.clock[rank], self._wake_at[rank])

    def _push(self, rank: int, at: float) -> None:
        self._wake_at[rank] = at
        heapq.heappush(self._heap, (at, next(self._seq), rank))

    def _handoff(self, me: int | None) -> bool:
        """Give the baton to the earliest queued rank. Returns True if that is ``me``."""
        if not self._heap:
            self._deadlock()
            return False
        _, _, nxt = heapq.heappop(self._heap)
        if nxt == me:
            self.clock[me] = max(self.clock[me], self._wake_at[me])
            return True
        self.switches += 1
        self._wake[nxt].release()
        return False

    def _deadlock(self) -> None:
        blocked = [r for r in range(self.size) if not self._done[r]]
        if not blocked:
            return
        if self._error is None:
            self._error = MismatchedCollective(
                f"simulated ranks {blocked[:8]}{'...' if len(blocked) > 8 else ''} wait for "
                "messages nobody sends (mismatched collective or a failed rank)")
        for r in blocked:
            self._wake_at[r] = self.clock[r]
            if self._wake[r].locked():
                try:
                    self._wake[r].release()
                except RuntimeError:
                    pass

    def _yield(self, rank: int, at: float) -> None:
        """Sleep the running rank until virtual time ``at``."""
        if not self._heap or at <= self._heap[0][0]:
            self.clock[rank] = at  # nobody can run earlier: no switch needed
            return
        self._push(rank, at)
        if not self._handoff(rank):
            self.enter(rank)
            self.check_error()

    def check_error(self) -> None:
        if self._error is not None:
            raise self._error

    def charge(self, rank: int, seconds: float) -> None:
        """Advance ``rank``'s clock by ``seconds`` of local work."""
        if seconds > 0:
            self._yield(rank, self.clock[rank] + seconds)

    def finish(self, rank: int, error: BaseException | None = None) -> None:
        """The rank's thread is done (with ``error`` if it failed)."""
        self._done[rank] = True
        if error is not None and self._error is None:
            self._error = PeerLost(f"simulated rank {rank} failed: {type(error).__name__}: {error}", rank)
        if all(self._done):
            return
        if self._error is not None:
            self._deadlock()
            return
        self._handoff(None)

    # -- messages

    def isend(self, src: int, buf: np.ndarray, dst: int, tag: int, sig: Sig = NO_SIG) -> SimRequest:
        self.check_error()
        now = self.clock[src]
        arrival = self.net.schedule(src, dst, buf.nbytes, now)
        req = SimRequest(self, src, None)
        req.done_at = arrival
        key = (src, dst, tag)
        posted = self._recvs.get(key)
        if posted:
            self._deliver(posted.popleft(), buf, arrival, sig)
        else:
            self._unexpected.setdefault(key, deque()).append(_Message(buf.copy(), arrival, sig))
        return req

    def irecv(self, dst: int, buf: np.ndarray, src: int, tag: int, sig: Sig = NO_SIG) -> SimRequest:
        self.check_error()
        req = SimRequest(self, dst, buf)
        posted = _Posted(req, self.clock[dst], sig, src)
        key = (src, dst, tag)
        queue = self._unexpected.get(key)
        if queue:
            msg = queue.popleft()
            self._deliver(posted, msg.data, msg.arrival, msg.sig)
        else:
            self._recvs.setdefault(key, deque()).append(posted)
        return req

    def _deliver(self, posted: _Posted, data: np.ndarray, arrival: float, sig: Sig) -> None:
        req = posted.req
        if sig != posted.sig:
            err = signature.check_message(posted.sig, sig, req.rank, posted.src)
            if err is not None:
                self._error = err
                return
        if data.nbytes != req.buf.nbytes:
            self._error = MismatchedCollective(
                f"simulated rank {req.rank} posted a receive of {req.buf.nbytes} bytes, "
                f"the message has {data.nbytes}")
            return
        if data.nbytes:
            req.buf.view(np.uint8).reshape(-1)[:] = data.view(np.uint8).reshape(-1)
        req.done_at = max(arrival, posted.posted_at)
        req.buf = None
        waiting = self._waiting[req.rank]
        if waiting is not None and all(r.done_at is not None for r in waiting):
            self._waiting[req.rank] = None
            self._push(req.rank, max(r.done_at for r in waiting))

    def wait(self, rank: int, reqs: Sequence[SimRequest]) -> None:
        """Block ``rank`` until every request completes (in virtual time)."""
        self.check_error()
        if any(r.done_at is None for r in reqs):
            self._waiting[rank] = reqs
            self._handoff(rank)  # never ``rank`` itself: it is not queued
            self.enter(rank)
            self.check_error()
            return
        at = max((r.done_at for r in reqs), default=self.clock[rank])
        if at > self.clock[rank]:
            self._yield(rank, at)

    @property
    def elapsed(self) -> float:
        """Virtual time at which the last rank finished."""
        return max(self.clock)
