"""Peer liveness: dead, closed and aborted peers, and peers gone another way.

Every wait that has spun checks its peers every :data:`PEER_CHECK_SECONDS`:
a peer whose process exited (its pidfd turns readable) or that closed its
transport while this rank still waits on it is :class:`PeerLost`; a peer
that aborted raises the error its abort reason encodes
(:func:`~collectives.errors.from_abort`); a peer whose call record shows
another call than this rank's (:meth:`~.records.CallRecords.check_waiting`)
is a :class:`~collectives.errors.MismatchedCollective`.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable, Sequence

from collectives import signature
from collectives.errors import PeerLost, from_abort

from .layout import Q_ABORT, Q_ABORT_SEQ, Q_CLOSED, Q_INBOX, Q_PID, Q_REASON_LEN, REASON_MAX, REASON_OFFSET

__all__ = ["Liveness", "PeerWatch", "PEER_CHECK_SECONDS", "exited"]

#: How often a wait that has spun looks at its peers.
PEER_CHECK_SECONDS = 0.002


def exited(pid: int) -> bool:
    """Whether process ``pid`` has exited: it is gone, or it is a zombie (its
    parent has not reaped it yet, as ``collectives run --on-failure continue``
    leaves a dead rank). ``os.kill(pid, 0)`` alone succeeds on a zombie, so
    the state in ``/proc/<pid>/stat`` decides where there is one (``Z`` or
    ``X``: exited); a process of another user counts as alive. Cheap (one
    small read); by pid only, so it cannot tell a reused pid from the
    original: :class:`PeerWatch` (pidfds) can."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (or not readable): whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    end = stat.rfind(b")")  # the command name may hold spaces and parentheses
    return stat[end + 2:end + 3] in (b"Z", b"X")


def completed(first_failed: int, seq: int) -> bool:
    """Whether a rank whose first incomplete call is ``first_failed`` completed call ``seq``."""
    ahead = (first_failed - seq) & signature.SEQ_MASK
    return 0 < ahead < 1 << (signature.SEQ_BITS - 1)


class PeerWatch:
    """Tells whether peer processes are still alive: a pidfd per peer where
    the system has them (readable once the process exited, zombie or reaped,
    and never confused with a later process of the same pid), else
    :func:`exited` on the pid. Safe to ask from several threads at once
    (waits of one transport may run in several: a poll object is not)."""

    def __init__(self, pids: dict[int, int]) -> None:
        self._fds: dict[int, int] = {}
        self._pids = pids
        self._lock = threading.Lock()
        self._poll = select.poll() if hasattr(select, "poll") else None
        for rank, pid in pids.items():
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                continue
            self._fds[fd] = rank
            self._poll.register(fd, select.POLLIN)

    def dead(self) -> set[int]:
        """Ranks whose process has exited."""
        gone: set[int] = set()
        with self._lock:
            fds = self._fds
            if fds:
                gone.update(fds[fd] for fd, _ in self._poll.poll(0))
        for rank, pid in self._pids.items():
            if rank in gone or rank in fds.values():
                continue
            if exited(pid):
                gone.add(rank)
        return gone

    def close(self) -> None:
        with self._lock:
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds = {}


class Liveness:
    """Checks on peers while waiting, and this rank's abort; mixed into
    :class:`~.transport.SharedMemoryTransport`.

    Reads ``rank``, ``_segs``, ``_watch`` (a :class:`PeerWatch`),
    ``_records``, ``_closed`` and ``_lock``; writes ``_next_check`` (when peers are next
    looked at) and, in :meth:`abort`, this rank's abort words and reason and
    each peer's ``Q_INBOX``. Uses :meth:`~.rings.Rings._progress` (what
    arrived before a peer left still counts) and :meth:`~.waking.Waking._wake_all`.
    """

    def _maybe_check_peers(self, relevant: set[int], reqs: Sequence = ()) -> None:
        """While waiting for ``reqs`` on the ``relevant`` peers: raise when one
        was lost or has gone another way (at most every :data:`PEER_CHECK_SECONDS`)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + PEER_CHECK_SECONDS
        lost = self._lost_peer(relevant)
        if lost is None:
            lost = self._records.check_waiting(sorted(relevant), lambda peer: self._still_waiting(reqs, peer))
            if lost is not None:
                raise lost
            return
        with self._lock:  # what arrived before the peer left still counts
            self._progress()
            if reqs:
                pending = {r.peer for r in reqs if not r.done}
                if not pending:
                    return
                # A peer that closed after delivering everything it owed is not lost.
                lost = self._lost_peer(pending)
                if lost is None:
                    return
        raise lost

    def _check_counter_peer(self, peer: int, below: Callable[[], bool]) -> None:
        """While waiting for a counter of ``peer`` (``below()``: not there yet):
        raise when ``peer`` was lost or has gone another way (at most every
        :data:`PEER_CHECK_SECONDS`)."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + PEER_CHECK_SECONDS
            lost = self._lost_peer({peer})
            if lost is None and self._records is not None:
                lost = self._records.check_waiting([peer], lambda _: below())
            if lost is not None and below():
                raise lost

    def _still_waiting(self, reqs: Sequence, peer: int) -> bool:
        """Progress once; whether some request of a collective call (a receive
        from ``peer``, or a send to it: a peer that finished the call took
        every message it wanted) is still pending."""
        with self._lock:
            if not self._closed:
                self._progress()
        return any(not r.done and r.peer == peer and r.tag & 1 for r in reqs)

    def _aborted_error(self, rank: int) -> Exception:
        """The error of this rank when ``rank`` aborted the job (of the kind of
        ``rank``'s own error, see :func:`~collectives.errors.from_abort`)."""
        return from_abort(self._segs[rank].reason(), rank, self.rank)

    def _aborted_in(self, seq: int | None) -> int | None:
        """A peer that aborted without completing call ``seq`` (None: any
        peer that aborted), or None."""
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg.q[Q_ABORT]:
                if seq is None or not completed(int(seg.q[Q_ABORT_SEQ]), seq):
                    return r
        return None

    def _lost_peer(self, relevant: set[int]) -> Exception | None:
        """The error for an aborted peer, or a relevant peer that died or closed.
        Before this rank's first call (in ``init``'s exchanges) only a peer
        that aborted before its own first call counts: one that aborted in
        a call was done with ``init`` and sent what it owed, and its error
        comes with this rank's first call."""
        now = self._records.current() if self._records is not None else None
        aborted = self._aborted_in(now[0] if now is not None else 0)
        if aborted is not None:
            return self._aborted_error(aborted)
        dead = self._watch.dead() if self._watch is not None else set()
        for r in sorted(dead):
            if not self._segs[r].q[Q_CLOSED]:
                return PeerLost(f"rank {self.rank}: rank {r} (pid {self._segs[r].q[Q_PID]}) died", r)
        for r in sorted(relevant):
            if r != self.rank and (r in dead or self._segs[r].q[Q_CLOSED]):
                return PeerLost(f"rank {self.rank}: rank {r} closed its transport while rank "
                                f"{self.rank} still waited on it", r)
        return None

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Make every peer's pending and future waits raise the error
        ``reason`` encodes; a peer still finishing a call before ``seq`` (the
        first this rank did not complete) finishes it. The first reason
        stays: later aborts (echoes of the first failure) keep it."""
        try:
            seg = self._segs[self.rank]
            if seg.q[Q_ABORT]:
                return
            data = reason.encode("utf-8", "replace")[:REASON_MAX]
            seg.mv[REASON_OFFSET:REASON_OFFSET + len(data)] = data
            seg.q[Q_REASON_LEN] = len(data)
            if seq is None:  # the call it is in, or its last
                now = self._records.current() if self._records is not None else None
                seq = now[0] if now is not None else 0
            first = seq & signature.SEQ_MASK
            seg.q[Q_ABORT_SEQ] = first
            seg.q[Q_ABORT] = 1
            for r, peer in enumerate(self._segs):  # each peer looks at its own inbox first
                if r != self.rank and not peer.q[Q_INBOX]:
                    peer.q[Q_INBOX] = (first << 32) | (self.rank + 1)
            self._wake_all()
        except Exception:
            pass
