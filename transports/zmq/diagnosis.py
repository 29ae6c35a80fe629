"""Timeouts of the TCP transport: a rank whose collective timed out asks
every peer where it is and decides, the same on every survivor, who has not
arrived (see the package docstring)."""

from __future__ import annotations

import time
from typing import Any


from collectives.errors import CollectiveError, CollectiveTimeout, abort_reason
from collectives.signature import NO_SIG, Sig, check_all, describe
from collectives.timeout_verdict import timeout_verdict

from .wire import (DEFER_SECONDS, DIAGNOSING, HEADER, KIND_QUERY, KIND_STATUS, QUERY_SECONDS, STATUS, PeerStatus,
                   call_name, copy_error, older)


class Diagnosis:
    """Who has not arrived (a part of :class:`~.transport.ZmqTransport`)."""


    def _timed_out(self, peer: int, tag: int, action: str, start: float, timeout: float) -> CollectiveError:
        """The error of a wait that ran out: for a collective, the verdict of
        :meth:`_diagnose` (every peer raises it too)."""
        if self._broken is not None:
            return copy_error(self._broken)
        if not tag & 1 or self.size == 1:
            return CollectiveTimeout(f"rank {self.rank}: {action} {self._name(peer)} (tag {tag}) did not "
                                     f"complete within {timeout:.3g} s (the timeout)")
        since = self._call_since if tag == self._call_tag else start
        return self._diagnose(peer, tag, action, since, start + timeout)

    def _diagnose(self, peer: int, tag: int, action: str, since: float, deadline: float) -> CollectiveError:
        """Ask every peer where it is, decide who has not arrived, abort with
        that verdict and return it (or the verdict or error that reached this
        rank meanwhile)."""
        self._diagnosing = True
        try:
            replies = self._query_peers(peer)
            if self._broken is None:
                self._defer_to_lower(replies, peer)
            if self._broken is not None:
                return copy_error(self._broken)
            error = self._verdict(peer, tag, action, since, deadline, replies)
        finally:
            self._diagnosing = False
        self.abort(abort_reason(error), tag >> 1)
        return error

    def _query_peers(self, peer: int) -> dict[int, PeerStatus]:
        """Every peer's status that comes within QUERY_SECONDS."""
        with self._cv:
            self._next_query += 1
            qid = self._next_query
            replies = self._replies[qid] = {}
        self._broadcast(HEADER.pack(KIND_QUERY, qid, 0, 0, 0, 0, 0))
        want = self.size - 1
        self._drive_until(lambda: len(replies) >= want or self._broken is not None,
                          time.monotonic() + QUERY_SECONDS, peer)
        with self._cv:
            return dict(self._replies.pop(qid))

    def _defer_to_lower(self, replies: dict[int, PeerStatus], peer: int) -> None:
        """When a lower rank is diagnosing too, wait (a while) for its verdict."""
        diagnosing = {p for p, st in replies.items() if st.diagnosing} | self._queried_by
        if any(p < self.rank for p in diagnosing):
            self._drive_until(lambda: self._broken is not None, time.monotonic() + DEFER_SECONDS, peer)

    def _answer(self, peer: int, qid: int) -> None:
        """Answer ``peer``'s status query: this rank's call, whom it waits for."""
        self._queried_by.add(peer)
        body = STATUS.pack(qid, self._call_seq, *self._call_sig, self._waiting,
                           DIAGNOSING if self._diagnosing else 0,
                           time.monotonic() - self._call_since if self._call_seq >= 0 else 0.0)
        self._send_frame(HEADER.pack(KIND_STATUS, qid, 0, 0, 0, 0, 0) + body, [peer])

    def _note_status(self, peer: int, body: Any) -> None:
        if len(body) < STATUS.size:
            return
        qid, seq, w0, w1, w2, waiting, flags, seconds = STATUS.unpack_from(body)
        with self._cv:
            replies = self._replies.get(qid)
            if replies is not None:
                replies[peer] = PeerStatus(seq, (w0, w1, w2), waiting, bool(flags & DIAGNOSING), seconds)
                self._cv.notify_all()

    def _verdict(self, peer: int, tag: int, action: str, since: float, deadline: float,
                 replies: dict[int, PeerStatus]) -> CollectiveError:
        """Who has not arrived at the call of ``tag``, and where each rank is:
        a CollectiveTimeout, or, when every rank is in this call but their
        signatures differ (ranks that only wait, such as roots that disagree),
        the mismatch."""
        seq = tag >> 1
        sig = self._call_sig if tag == self._call_tag else NO_SIG
        call = describe(sig) if sig != NO_SIG else f"call #{seq}"
        elapsed, limit = time.monotonic() - since, deadline - since
        silent = [p for p in range(self.size) if p != self.rank and p not in replies]
        behind = [p for p, st in sorted(replies.items()) if older(st.seq, seq)]
        mismatch = None if silent or behind else self._disagreement(seq, sig, replies)
        return timeout_verdict(call, f"rank {self.rank}", elapsed, limit, f"{action} rank {peer}",
                               [self._name(p) for p in silent], [self._name(p) for p in behind], mismatch,
                               [self._where(p, replies, peer, seq, sig) for p in range(self.size)], QUERY_SECONDS,
                               self.rank)

    def _disagreement(self, seq: int, sig: Sig, replies: dict[int, PeerStatus]) -> CollectiveError | None:
        """The mismatch of every rank's signature when all are in call ``seq``
        and signed (None when they agree or cannot be compared)."""
        sigs = [sig if p == self.rank else replies[p].sig for p in range(self.size)]
        if NO_SIG in sigs or any(replies[p].seq != seq for p in replies):
            return None
        return check_all(sigs, self.rank)

    def _where(self, p: int, replies: dict[int, PeerStatus], peer: int, seq: int, sig: Sig) -> str:
        if p == self.rank:
            st = PeerStatus(seq, sig, peer, True, time.monotonic() - self._call_since)
        elif p in replies:
            st = replies[p]
        else:
            return f"rank {p} did not answer"
        waits = f"waiting for rank {st.waiting}" if st.waiting >= 0 else "not waiting"
        since = f" for {st.seconds:.1f} s" if st.seq >= 0 else ""
        return f"rank {p} in {call_name(st.seq, st.sig)}{since}, {waits}"

