"""Fault-tolerant agreement among the survivors of a shared-memory job.

The basis of ``comm.agree(flag)`` and ``comm.shrink()``: every surviving
rank decides the same set of failed ranks and the same flag (the AND of the
survivors' flags), even when another rank dies during the agreement. It runs
on the control pages the ranks already share, so it needs nothing of the
rings or the window, which a failure may have left in any state.

Each agreement has a number (the n-th of the job, the same on every rank).
A rank takes part by publishing, in its own control page: the agreement's
number, its round and phase, its flag and its *view* (the failed ranks it
knows of, a bitmask). Round r:

1. *collect*: publish (r, collect, view, flag); for every rank outside the
   view, wait until it has published round r or later (or decided), merge
   its view and flag into ours.
2. if every such rank's view equals ours: publish (r, ready) and wait until
   every rank outside the view has published (r, ready) with that view;
   then decide, and publish the decision.
3. otherwise (a view differs, or a rank died meanwhile): the next round,
   with the union of the views.

A rank that has decided keeps its decision published; a rank that sees one
adopts it at once. Failures are told by the process's death (a pidfd),
never by time: a rank's published words are read *before* its death is
looked at, and once more after, so a word written before dying always
counts, and no two survivors can tell a failure apart in different ways.
That makes the decision the same on every survivor. A rank that does not
take part within the timeout (stopped, or stuck) makes the agreement fail
with :class:`~collectives.errors.CollectiveTimeout` on every rank that
waits for it (it is not failed: it may wake); a rank that finds itself in
the decided set of failed ranks raises :class:`~collectives.errors.PeerLost`.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from collectives.errors import CollectiveTimeout, PeerLost

from .layout import (Q_AGREE, Q_AGREE_DECIDED, Q_AGREE_DECIDED_FLAG, Q_AGREE_DECIDED_VIEW, Q_AGREE_FLAG,
                     Q_AGREE_STATE, Q_AGREE_VIEW, VIEW_WORDS)

__all__ = ["agree", "MAX_RANKS"]

MAX_RANKS = 64 * VIEW_WORDS
_COLLECT, _READY = 0, 1


def _view_words(view: set[int]) -> list[int]:
    words = [0] * VIEW_WORDS
    for r in view:
        words[r // 64] |= 1 << (r % 64)
    return words


def _view_of(words: Sequence[int]) -> set[int]:
    return {64 * i + b for i, w in enumerate(words) for b in range(64) if (int(w) >> b) & 1}


class _Peer:
    """What one rank published about agreement ``number``: its decision
    (``decided``), or its round, phase, view and flag (``state`` None:
    nothing yet). A rank is never more than one agreement ahead of a
    survivor still in the last (it waits for it in the next), so its last
    decision is that of ``number`` whenever it has moved on."""

    def __init__(self, q, number: int) -> None:
        self.decided = int(q[Q_AGREE_DECIDED]) == number
        if self.decided:
            self.state, self.round, self.phase = -1, 0, _READY
            self.flag = bool(q[Q_AGREE_DECIDED_FLAG])
            self.view = _view_of([q[Q_AGREE_DECIDED_VIEW + i] for i in range(VIEW_WORDS)])
            return
        if int(q[Q_AGREE]) != number:
            self.state = None
            return
        state = int(q[Q_AGREE_STATE])
        self.round, self.phase = state >> 1, state & 1
        self.flag = bool(q[Q_AGREE_FLAG])
        self.view = _view_of([q[Q_AGREE_VIEW + i] for i in range(VIEW_WORDS)])
        if int(q[Q_AGREE]) != number or int(q[Q_AGREE_STATE]) != state:  # changed while read: look again
            self.state = None
            return
        self.state = state


def agree(rank: int, size: int, qs: Sequence, number: int, view: set[int], flag: bool, dead: Callable[[], set[int]],
          pause: Callable[[], None], deadline: float) -> tuple[set[int], bool]:
    """Agreement ``number`` among the ranks not in ``view`` (see the module
    docstring); returns (the failed ranks, the AND of the survivors' flags).

    Args:
        rank, size: this rank and the job's size.
        qs: every rank's control page as 8-byte words.
        number: this agreement's number (the same on every rank).
        view: the failed ranks this rank knows of.
        flag: this rank's flag.
        dead: the ranks whose process has exited.
        pause: a short wait between looks (it may block until a peer wakes it).
        deadline: ``time.monotonic()`` past which it gives up.

    Raises:
        CollectiveTimeout: a rank outside the view did not take part in time.
        PeerLost: the others decided that this rank failed.
    """
    if size > MAX_RANKS:
        raise PeerLost(f"rank {rank}: agreeing among {size} ranks is not supported (at most {MAX_RANKS})", rank)
    own = qs[rank]
    view = set(view) - {rank}
    rnd = 0
    while True:
        rnd += 1
        _publish(own, number, rnd, _COLLECT, view, flag)
        decided, peers = _gather(rank, size, qs, number, rnd, _COLLECT, view, dead, pause, deadline)
        if decided is not None:
            return _adopt(own, rank, number, decided)
        merged_view = set(view).union(*(p.view for p in peers.values()))
        merged_flag = flag and all(p.flag for p in peers.values())
        if merged_view != view or any(p.view != view for p in peers.values()):
            view, flag = merged_view - {rank}, merged_flag
            if rank in merged_view:
                raise PeerLost(f"rank {rank}: the other ranks count this rank as failed", rank)
            continue
        _publish(own, number, rnd, _READY, view, flag)
        decided, peers = _gather(rank, size, qs, number, rnd, _READY, view, dead, pause, deadline)
        if decided is not None:
            return _adopt(own, rank, number, decided)
        if all(p.view == view and p.phase == _READY and p.round == rnd for p in peers.values()):
            flag = flag and all(p.flag for p in peers.values())
            _publish(own, number, rnd, _READY, view, flag)
            _decide(own, number, view, flag)
            return set(view), flag
        view = set(view).union(*(p.view for p in peers.values())) - {rank}


def _publish(q, number: int, rnd: int, phase: int, view: set[int], flag: bool) -> None:
    """This rank's words, the state last (readers take the rest as of it)."""
    for i, w in enumerate(_view_words(view)):
        q[Q_AGREE_VIEW + i] = w
    q[Q_AGREE_FLAG] = 1 if flag else 0
    q[Q_AGREE] = number
    q[Q_AGREE_STATE] = (rnd << 1) | phase


def _adopt(own, rank: int, number: int, peer: _Peer) -> tuple[set[int], bool]:
    """Take a peer's decision as this rank's."""
    if rank in peer.view:
        raise PeerLost(f"rank {rank}: the other ranks decided that this rank failed", rank)
    _decide(own, number, peer.view, peer.flag)
    return set(peer.view), peer.flag


def _decide(q, number: int, view: set[int], flag: bool) -> None:
    """Publish this rank's decision of agreement ``number`` (its number last)."""
    for i, w in enumerate(_view_words(view)):
        q[Q_AGREE_DECIDED_VIEW + i] = w
    q[Q_AGREE_DECIDED_FLAG] = 1 if flag else 0
    q[Q_AGREE_DECIDED] = number


def _gather(rank: int, size: int, qs: Sequence, number: int, rnd: int, phase: int, view: set[int],
            dead: Callable[[], set[int]], pause: Callable[[], None],
            deadline: float) -> tuple[_Peer | None, dict[int, _Peer]]:
    """Wait until every rank outside ``view`` has published (``rnd``, ``phase``)
    or later; a rank that died before that joins ``view``. Returns a decided
    peer (None if none) and what every awaited rank published."""
    got: dict[int, _Peer] = {}
    waiting = [r for r in range(size) if r != rank and r not in view]
    while waiting:
        for r in list(waiting):
            peer = _Peer(qs[r], number)
            if peer.decided:
                return peer, got
            if peer.state is not None and (peer.round, peer.phase) >= (rnd, phase):
                got[r] = peer
                waiting.remove(r)
        if not waiting:
            break
        gone = dead()
        for r in [r for r in waiting if r in gone]:
            peer = _Peer(qs[r], number)  # once more: what it wrote before dying counts
            if peer.decided:
                return peer, got
            if peer.state is not None and (peer.round, peer.phase) >= (rnd, phase):
                got[r] = peer
            else:
                view.add(r)
            waiting.remove(r)
        if waiting:
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"rank {rank}: ranks {waiting} did not take part in the agreement "
                                        f"among the survivors in time (stopped or stuck; they are not failed)")
            pause()
    return None, got
