"""The message format: a header, then the payload, in one MPI message or two.

Every message starts with a 32-byte header, the call's signature (three
64-bit words, see :mod:`collectives.signature`) and the payload's byte
count. Payloads of up to :data:`SMALL_BYTES` travel with their header as
one MPI message (staged on both sides: :class:`Send`, :class:`SmallRecv`);
larger ones as a header message and then a payload message with the same
tag (:class:`LargeSend`, :class:`LargeRecv`), which MPI's non-overtaking
rule keeps in order. The receiver checks the header
(:func:`~collectives.signature.check_message`, then the size) before it
posts the payload's receive, so a mismatched message never touches the
receive's buffer. A receive posted while a large one from the same peer
with the same tag still waits for its header is held back until that one's
payload receive is posted, so that every header and payload meets its own
receive. A message larger or smaller than its receive is a
MismatchedCollective naming both sizes; the rest of it is received and
dropped, so later messages from that peer still match.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from collectives.errors import CollectiveError, MismatchedCollective
from collectives.signature import Sig, check_message

from .tags import call_of
from .waits import MpiRequest

if TYPE_CHECKING:
    from .transport import MpiTransport

__all__ = ["SMALL_BYTES", "HEADER", "HEADER_BYTES", "Send", "LargeSend", "Recv", "SmallRecv", "LargeRecv",
           "byte_view"]

#: Payloads up to this many bytes travel in one MPI message with their header.
SMALL_BYTES = 64 << 10
#: Every message's header: signature words w0, w1, w2 and the payload's byte count.
HEADER = struct.Struct("<4Q")
HEADER_BYTES = HEADER.size


def byte_view(buf: np.ndarray) -> memoryview:
    """The bytes of the C-contiguous array ``buf``, writable where it is."""
    try:
        return memoryview(buf).cast("B")
    except (TypeError, ValueError, NotImplementedError):  # dtypes without a buffer format (bfloat16)
        return memoryview(buf.reshape(-1).view(np.uint8))


class Send(MpiRequest):
    """A send of one message, header and payload staged together (``keep``)."""

    __slots__ = ("_req", "_keep")
    action = "sending to"

    def __init__(self, transport: "MpiTransport", peer: int, tag: int, req: Any, keep: Any) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done, self._error, self._suspect = False, None, None
        self._req, self._keep = req, keep

    def _poll(self) -> bool:
        if self._req.Test():
            self._done, self._keep = True, None
            return True
        return False

    def _what(self) -> str:
        return f"MPI send to rank {self._peer} in {call_of(self._tag)}"


class LargeSend(Send):
    """A send of a header message (``keep``) and a payload message: ``req``
    holds both requests."""

    __slots__ = ()

    def _poll(self) -> bool:
        if self._t._MPI.Request.Testall(self._req):
            self._done, self._keep = True, None
            return True
        return False


class Recv(MpiRequest):
    """A receive of ``buf.nbytes`` bytes whose header must carry ``sig``.

    It is posted to MPI at once unless a large receive from the same peer
    with the same tag still waits for its header: it is then held, and
    posted (in order) once that one's payload receive is posted, so that
    MPI matches every header and payload with the receive it belongs to
    (:meth:`~.transport.MpiTransport._release`)."""

    __slots__ = ("_req", "_buf", "_sig", "_staging")
    receives = True
    action = "receiving from"

    def __init__(self, transport: "MpiTransport", peer: int, tag: int, buf: np.ndarray, sig: Sig) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done, self._error, self._suspect = False, None, None
        self._buf, self._sig = buf, sig
        self._req = self._staging = None

    def _post(self) -> None:
        """Post the receive of the message (or of its header) to MPI."""
        raise NotImplementedError

    def _arrived(self, req) -> bool:
        """Test ``req``; True when its message is in (a truncated one too: its
        header, at the start, is in)."""
        try:
            return req.Test()
        except self._t._MPI.Exception as exc:
            if exc.Get_error_class() != self._t._MPI.ERR_TRUNCATE:
                raise
            return True

    def _check_header(self, head: bytearray) -> int:
        """The payload's byte count from the header at the start of ``head``;
        raises (and finishes the request) when it disagrees with this receive.
        A refused header's payload message, if one follows, is dropped."""
        t = self._t
        w0, w1, w2, nbytes = HEADER.unpack_from(head)
        error = check_message(self._sig, (w0, w1, w2), t.rank, self._peer) if (w0, w1, w2) != self._sig else None
        if error is None and nbytes != self._buf.nbytes:
            error = MismatchedCollective(
                f"rank {t.rank}: expected {self._buf.nbytes} bytes from rank {self._peer}, got {nbytes} "
                "(ranks disagree about the collective or its size)")
        if error is not None:
            if nbytes > SMALL_BYTES:  # sent as a header message and a payload message
                t._drop_next(self._peer, self._tag)
            raise self._fail(error)
        return nbytes

    def _pending_header(self) -> bool:
        """Whether the message (or its header) has not arrived yet."""
        raise NotImplementedError

    def _what(self) -> str:
        return f"MPI receive from rank {self._peer} in {call_of(self._tag)}"


class SmallRecv(Recv):
    """A message of header and payload together, received into staging."""

    __slots__ = ()

    def _post(self) -> None:
        t = self._t
        self._staging = bytearray(HEADER_BYTES + self._buf.nbytes)
        self._req = t.comm.Irecv([self._staging, t._BYTE], self._peer, self._tag % t.tag_bound)

    def _poll(self) -> bool:
        req = self._req
        if req is None:
            return False
        try:  # _arrived, inline: the common case
            if not req.Test():
                return False
        except self._t._MPI.Exception as exc:  # a larger message than this receive: its header is in
            if exc.Get_error_class() != self._t._MPI.ERR_TRUNCATE:
                raise
        staging = self._staging
        w0, w1, w2, nbytes = HEADER.unpack_from(staging)
        if nbytes != self._buf.nbytes or (w0, w1, w2) != self._sig:
            self._check_header(staging)
        if nbytes:
            try:
                memoryview(self._buf).cast("B")[:] = memoryview(staging)[HEADER_BYTES:]
            except (TypeError, ValueError, NotImplementedError):  # a dtype without a buffer format
                byte_view(self._buf)[:] = memoryview(staging)[HEADER_BYTES:]
        self._done, self._staging = True, None
        return True

    def _pending_header(self) -> bool:
        return not self._done


class LargeRecv(Recv):
    """A header message, checked before the payload's receive is posted into
    the user's buffer. Until the header is in, the transport advances it from
    every wait (:meth:`~.transport.MpiTransport._advance`), so that two ranks each waiting
    on a send to the other still post each other's payload receives."""

    __slots__ = ()

    def _post(self) -> None:
        t = self._t
        self._staging = bytearray(HEADER_BYTES)
        self._req = t.comm.Irecv([self._staging, t._BYTE], self._peer, self._tag % t.tag_bound)
        t._awaiting.append(self)
        t._hold(self._peer, self._tag)

    def _poll(self) -> bool:
        if self._staging is not None or self._req is None:
            if not self._take_header():
                return False
        if self._req.Test():
            self._done = True
            return True
        return False

    def _take_header(self) -> bool:
        """Post the payload's receive once the header is in and agrees (and then
        the receives held behind this one); False while it is not in."""
        if self._req is None or not self._arrived(self._req):
            return False
        t = self._t
        t._awaiting.remove(self)
        try:
            nbytes = self._check_header(self._staging)
            self._staging = None
            self._req = t.comm.Irecv([self._buf.reshape(-1).view(np.uint8), nbytes, t._BYTE], self._peer,
                                     self._tag % t.tag_bound)
        finally:
            t._release(self._peer, self._tag)
        return True

    def _fail(self, error: CollectiveError) -> CollectiveError:
        if self in self._t._awaiting:
            self._t._awaiting.remove(self)
        return super()._fail(error)

    def _pending_header(self) -> bool:
        return self._staging is not None or self._req is None

