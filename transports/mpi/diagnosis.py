"""Timeouts of the MPI transport: who has not arrived, and where each rank is.

Every rank learns every peer's host and process id when the transport
opens (one small allgather of fixed-size records on the control
communicator: nothing is unpickled). A wait of a collective call that runs
out asks every peer where it is over the control communicator (a QUERY;
peers answer from any wait's slow path, with a STATUS: the call they are
in, its signature, whom they wait for, for how long) and, within
:data:`QUERY_SECONDS`, decides: the ranks that did not answer (stopped,
hung, or busy outside the library) or are still in an earlier call have not
arrived; when every rank is in the call, their signatures are compared. When
a lower rank is deciding too, its verdict (its abort) is waited for a while,
so that every survivor raises the same one. The verdict aborts the
transport, so that every peer raises it too:

``allreduce #5 (ring): rank 0 (host h, pid 11) timed out after 2.0 s (timeout
2.0 s) receiving from rank 1 (host h, pid 12); verdict: rank 1 (host h, pid
12) has not arrived: no answer within 0.4 s (stopped, hung, or busy outside
the library); where each rank is: rank 0 in allreduce #5 for 2.0 s, waiting
for rank 1; rank 1 did not answer; rank 2 in allreduce #5 for 2.0 s, waiting
for rank 1``
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import TYPE_CHECKING, NamedTuple

from collectives.errors import CollectiveError, CollectiveTimeout, abort_reason
from collectives.signature import NO_SIG, SEQ_MASK, Sig, check_all, describe
from collectives.timeout_verdict import timeout_verdict

from .tags import before

if TYPE_CHECKING:
    from .waits import MpiRequest

__all__ = ["Diagnosis", "QUERY", "STATUS", "QUERY_SECONDS", "DEFER_SECONDS"]

#: Control-communicator tags of a status query and its answer.
QUERY, STATUS = 3, 4
#: How long a rank that timed out waits for its peers' answers.
QUERY_SECONDS = 0.4
#: How long it waits for a lower rank's verdict when that rank is deciding too.
DEFER_SECONDS = 0.5
#: A peer's host and pid, as exchanged at opening: pid, then the host name (UTF-8, cut).
_NAME = struct.Struct("<q56s")
#: A STATUS: query id, call number (-1: none), signature words, rank waited for (-1: none),
#: flags (1: deciding too), seconds in the call.
_STATUS = struct.Struct("<qq3Qqqd")
_DECIDING = 1


class Peer(NamedTuple):
    host: str
    pid: int


class Status(NamedTuple):
    seq: int
    sig: Sig
    waiting: int
    deciding: bool
    seconds: float


class Diagnosis:
    """The timeout's verdict: a part of :class:`~.transport.MpiTransport`
    (a base class of it). It uses the transport's ``rank``, ``size``,
    ``_MPI``, ``_BYTE``, ``_control``, ``_kept``, ``_aborted``, ``_call``
    and ``_last_tag``, and keeps ``_peers``, ``_call_since``, ``_waiting``,
    ``_deciding``, ``_queried_by``, ``_replies`` and ``_next_query``."""

    def _exchange_names(self) -> None:
        """Every rank's host and pid (a collective of the control communicator)."""
        self._call_since = time.monotonic()
        self._waiting = -1
        self._deciding = False
        self._queried_by: set[int] = set()
        self._replies: dict[int, dict[int, Status]] = {}
        self._next_query = 0
        mine = _NAME.pack(os.getpid(), socket.gethostname().encode("utf-8", "replace")[:_NAME.size - 8])
        everyone = bytearray(_NAME.size * self.size)
        self._control.Allgather([mine, self._BYTE], [everyone, self._BYTE])
        self._peers = []
        for r in range(self.size):
            pid, host = _NAME.unpack_from(everyone, r * _NAME.size)
            self._peers.append(Peer(host.rstrip(b"\0").decode("utf-8", "replace"), pid))

    def _name(self, peer: int) -> str:
        """``rank 2 (host h, pid 123)`` (as much as is known)."""
        if 0 <= peer < len(self._peers):
            p = self._peers[peer]
            return f"rank {peer} (host {p.host}, pid {p.pid})"
        return f"rank {peer}"

    # ------------------------------------------------- answering the peers

    def _on_query(self, peer: int, data: bytes) -> None:
        """Answer ``peer``'s status query: this rank's call, whom it waits for."""
        self._queried_by.add(peer)
        qid = struct.unpack_from("<q", data)[0] if len(data) >= 8 else 0
        sig, _ = self._call
        tag = self._last_tag
        seq = (tag >> 1) & SEQ_MASK if tag >= 0 and tag & 1 else -1
        body = _STATUS.pack(qid, seq, *sig, self._waiting, _DECIDING if self._deciding else 0,
                            time.monotonic() - self._call_since if seq >= 0 else 0.0)
        try:
            self._kept += [body, self._control.Isend([body, self._BYTE], peer, STATUS)]
        except self._MPI.Exception:
            pass

    def _on_status(self, peer: int, data: bytes) -> None:
        if len(data) < _STATUS.size:
            return
        qid, seq, w0, w1, w2, waiting, flags, seconds = _STATUS.unpack_from(data)
        replies = self._replies.get(qid)
        if replies is not None:
            replies[peer] = Status(seq, (w0, w1, w2), waiting, bool(flags & _DECIDING), seconds)

    # ------------------------------------------------------- the verdict

    def _timed_out(self, req: "MpiRequest", start: float, limit: float) -> CollectiveError:
        """The error of ``req``'s wait that ran out (begun at ``start``, for
        ``limit`` seconds): for a collective call, the verdict on who has not
        arrived, with which this transport aborts (see the module docstring)."""
        what, ended = req._what(), time.monotonic()
        if not req._tag & 1 or self.size == 1 or self._aborted is not None or self._closed:
            if self._aborted is not None and self._refuses(req._tag):
                return self._unusable()
            error = CollectiveTimeout(f"rank {self.rank}: {what} did not complete within {limit:.3g} s "
                                      "(the timeout)")
            error.origin = self.rank  # (the time is said: nothing to add)
            return error
        self._deciding = True
        try:
            replies = self._query_peers()
            if self._aborted is None:
                self._defer_to_lower(replies)
            if self._aborted is not None:
                return self._unusable()
            error = self._verdict(req, start, limit, ended, replies)
        finally:
            self._deciding = False
        self.abort(abort_reason(error), req._tag >> 1)
        return error

    def _query_peers(self) -> dict[int, Status]:
        """Every peer's status that comes within QUERY_SECONDS."""
        self._next_query += 1
        qid = self._next_query
        replies = self._replies[qid] = {}
        self._tell_everyone(QUERY, struct.pack("<q", qid))
        deadline = time.monotonic() + QUERY_SECONDS
        while len(replies) < self.size - 1 and self._aborted is None and time.monotonic() < deadline:
            self._read_control()
            time.sleep(1e-4)
        return dict(self._replies.pop(qid))

    def _defer_to_lower(self, replies: dict[int, Status]) -> None:
        """When a lower rank is deciding too, wait (a while) for its verdict."""
        deciding = {p for p, st in replies.items() if st.deciding} | self._queried_by
        if any(p < self.rank for p in deciding):
            deadline = time.monotonic() + DEFER_SECONDS
            while self._aborted is None and time.monotonic() < deadline:
                self._read_control()
                time.sleep(1e-4)

    def _verdict(self, req: "MpiRequest", start: float, limit: float, ended: float,
                 replies: dict[int, Status]) -> CollectiveError:
        tag = req._tag
        seq = (tag >> 1) & SEQ_MASK
        sig = self._call[0] if tag == self._last_tag else NO_SIG
        call = describe(sig) if sig != NO_SIG else f"call #{seq}"
        since = self._call_since if tag == self._last_tag else start
        elapsed, total = ended - since, start + limit - since
        silent = [p for p in range(self.size) if p != self.rank and p not in replies]
        behind = [p for p, st in sorted(replies.items()) if before(2 * st.seq + 1 if st.seq >= 0 else -1, tag)]
        mismatch = None if silent or behind else self._disagreement(seq, sig, replies)
        waited = f" {self._name(req._peer)}" if req._peer >= 0 else ""
        return timeout_verdict(call, self._name(self.rank), elapsed, total, f"{req.action}{waited}",
                               [self._name(p) for p in silent], [self._name(p) for p in behind], mismatch,
                               [self._where(p, replies, req._peer, seq, sig, elapsed) for p in range(self.size)],
                               QUERY_SECONDS, self.rank)

    def _disagreement(self, seq: int, sig: Sig, replies: dict[int, Status]) -> CollectiveError | None:
        sigs = [sig if p == self.rank else replies[p].sig for p in range(self.size)]
        if NO_SIG in sigs or any(st.seq != seq for st in replies.values()):
            return None
        return check_all(sigs, self.rank)

    def _where(self, p: int, replies: dict[int, Status], peer: int, seq: int, sig: Sig, elapsed: float) -> str:
        if p == self.rank:
            st = Status(seq, sig, peer if peer >= 0 else -2, True, elapsed)
        elif p in replies:
            st = replies[p]
        else:
            return f"rank {p} did not answer"
        if st.seq < 0:
            return f"rank {p} has made no collective call"
        waits = (f"waiting for rank {st.waiting}" if st.waiting >= 0
                 else "waiting for every rank" if st.waiting == -2 else "not waiting")
        call = describe(st.sig) if st.sig != NO_SIG else f"call #{st.seq}"
        return f"rank {p} in {call} for {st.seconds:.1f} s, {waits}"
