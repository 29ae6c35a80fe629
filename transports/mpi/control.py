"""The control communicator: aborts, goodbyes and status queries.

Failures: :meth:`ControlChannel.abort` never calls ``MPI_Abort``: it sends
its reason (and the first call it did not complete) to every peer over the
control communicator; waits look there after their spin (at least every
0.2 ms) and raise ``errors.from_abort(reason, peer, rank)``, and every later
operation raises the same at once, but for those of earlier calls, which
may finish; a rank that received an abort does not pass it on.
:meth:`ControlChannel.close` tells every peer that this rank is gone (with
the last call it took part in); a peer waiting on it raises PeerLost at
once when the closed rank never entered the call, and after
:data:`~.waits.CONFIRM_SECONDS` when it did (what it sent has had time to
land). Status queries and their answers are :mod:`.diagnosis`'s.
"""

from __future__ import annotations

import struct
import time

from collectives.errors import CollectiveError, PeerLost, from_abort
from collectives.signature import SEQ_MASK

from .diagnosis import QUERY, STATUS
from .tags import before, call_of
from .waits import MpiRequest

__all__ = ["ControlChannel", "ABORT", "GOODBYE", "REASON_BYTES"]

#: Control-communicator tags.
ABORT, GOODBYE = 1, 2
#: Longest abort reason sent (bytes of UTF-8); longer ones are cut.
REASON_BYTES = 8192


class ControlChannel:
    """The control communicator's part of :class:`~.transport.MpiTransport`
    (a base class of it): reading and sending aborts and goodbyes, and what
    they make of later operations.

    It uses the transport's ``rank``, ``size``, ``_MPI``, ``_BYTE``,
    ``_control`` (the control communicator), ``_probe`` (an MPI status),
    ``_kept``, ``_last_tag``, and keeps its state there: ``_closed``,
    ``_aborted`` ((reason, the rank that aborted, the first call it did not
    complete or -1), or None) and ``_gone`` (closed peer -> the last
    collective tag it took part in).
    """

    def _read_control(self) -> None:
        """Take every abort and goodbye the peers sent."""
        MPI, status = self._MPI, self._probe
        while True:
            msg = self._control.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                return
            peer, tag = status.Get_source(), status.Get_tag()
            data = bytearray(status.Get_count(self._BYTE))
            if not self._receive_matched(msg, data):
                data = bytearray(b"(the reason did not arrive)")
            if tag == ABORT and self._aborted is None:
                first = struct.unpack_from("<q", data)[0] if len(data) >= 8 else -1
                self._aborted = (data[8:].decode("utf-8", "replace"), peer, first)
            elif tag == GOODBYE:
                self._gone[peer] = struct.unpack_from("<q", data)[0] if len(data) >= 8 else -1
            elif tag == QUERY:
                self._on_query(peer, data)
            elif tag == STATUS:
                self._on_status(peer, data)

    def _receive_matched(self, msg, buf: bytearray, seconds: float = 1.0) -> bool:
        """Receive the probed message ``msg`` into ``buf`` (a truncated one
        too); False when it is not in within ``seconds``."""
        req = msg.Irecv([buf, self._BYTE])
        deadline = time.monotonic() + seconds
        try:
            while not req.Test():
                if time.monotonic() > deadline:
                    self._kept += [buf, req]
                    return False
                time.sleep(0)
        except self._MPI.Exception as exc:
            return exc.Get_error_class() == self._MPI.ERR_TRUNCATE
        return True

    def _gone_peer(self, req: MpiRequest):
        """(key, at once, error) when a peer ``req`` waits on closed its
        communicator: at once when it never entered the call, after
        :data:`CONFIRM_SECONDS` otherwise (what it sent before it closed has
        landed by then); None when none did, and for MPI's own collectives
        when every closed rank had entered the call (it may have finished
        its part: the call's timeout decides)."""
        if not self._gone or (req.receives and not req._pending_header()):
            return None  # a payload whose header is in was sent: it will come
        if req._peer >= 0:
            last = self._gone.get(req._peer)
            if last is None:
                return None
            lost, at_once = [req._peer], bool(req._tag & 1) and before(last, req._tag)
        else:
            lost, at_once = sorted(p for p, last in self._gone.items() if before(last, req._tag)), True
            if not lost:
                return None
        who = " and ".join(f"rank {p}" for p in lost)
        return ("gone", tuple(lost)), at_once, lambda: PeerLost(
            f"rank {self.rank}: {who} closed its communicator while rank {self.rank} waited on it "
            f"in {call_of(req._tag)}", lost[0])

    # --------------------------------------------- after an abort or close

    def _refuses(self, tag: int) -> bool:
        """Whether an operation with ``tag`` fails on a closed or aborted
        transport: always, but for one of a collective call before the first
        call the aborting rank did not complete (it may still finish)."""
        if self._closed or self._aborted is None:
            return True
        first = self._aborted[2]
        return first < 0 or not tag & 1 or not before(tag, 2 * first + 1)

    def _unusable(self) -> CollectiveError:
        """The error of every operation on an aborted or closed transport."""
        if self._aborted is not None:
            reason, origin, _ = self._aborted
            return from_abort(reason, origin, self.rank)
        return PeerLost(f"rank {self.rank}: transport is closed", self.rank)

    # ------------------------------------------------------------ shutdown

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Tell every peer ``reason`` over the control communicator: their waits
        and later operations raise ``errors.from_abort(reason, this rank, peer)``,
        and this rank's later operations the same, but for those of collective
        calls before ``seq`` (the first call this rank did not complete; None:
        unknown), which may finish. A transport that a peer aborted tells no
        one (that peer told everyone). Never blocks, never raises; never calls
        MPI_Abort."""
        if self._closed or self._aborted is not None:
            return
        first = -1 if seq is None else seq & SEQ_MASK
        self._aborted = (reason, self.rank, first)
        self._tell_everyone(ABORT, struct.pack("<q", first) + reason.encode("utf-8", "replace")[:REASON_BYTES])

    def close(self) -> None:
        """Tell every peer that this rank is gone (unless it aborted) and refuse
        every later operation (idempotent). The duplicated communicators stay
        until MPI_Finalize: a peer may still send to them."""
        if self._closed:
            return
        if self._aborted is None:
            self._tell_everyone(GOODBYE, struct.pack("<q", self._last_tag))
        self._closed = True

    def _tell_everyone(self, tag: int, data: bytes) -> None:
        """Send ``data`` with ``tag`` to every peer on the control communicator, without waiting."""
        try:
            if self._MPI.Is_finalized():
                return
            self._kept.append(data)
            for peer in range(self.size):
                if peer != self.rank:
                    self._kept.append(self._control.Isend([data, self._BYTE], peer, tag))
        except Exception:  # best effort: never raises
            pass
