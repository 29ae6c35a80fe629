"""The TCP transport's requests: zero-copy ZeroMQ sends, lane sends, and
receives filled segment by segment (checked against the message's signature)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from collectives.errors import MismatchedCollective
from collectives.signature import NO_SIG, REFUSED, Sig, check_message
from collectives.transport import Request

from .lanes import LaneSend
from .wire import POLL_SLICE

if TYPE_CHECKING:
    from .transport import ZmqTransport

class SendRequest(Request):
    """A zero-copy send: complete when libzmq has released every segment."""

    __slots__ = ("_transport", "_trackers", "_buf", "peer", "tag")
    action = "sending to"

    def __init__(self, transport: "ZmqTransport", trackers: list, buf: np.ndarray, peer: int, tag: int) -> None:
        self._transport = transport
        self._trackers = trackers
        self._buf = buf  # kept alive until sent
        self.peer = peer
        self.tag = tag

    def test(self) -> bool:
        self._trackers = [t for t in self._trackers if not t.done]
        if not self._trackers:
            self._buf = None
            return True
        self._transport._raise_if_broken(self.peer, self.tag)
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        timeout = t.timeout if timeout is None else timeout
        start = time.monotonic()
        t._waiting = self.peer
        try:
            while not self.test():
                left = start + timeout - time.monotonic()
                if left <= 0:
                    raise t._timed_out(self.peer, self.tag, self.action, start, timeout)
                try:
                    self._trackers[0].wait(min(left, POLL_SLICE))
                except zmq.NotDone:
                    pass
                t._progress_nowait()
        finally:
            t._waiting = -1


class LaneRequest(Request):
    """A send over a TCP lane whose bytes are not all in the kernel yet."""

    __slots__ = ("_transport", "_pending", "peer", "tag")
    action = "sending to"

    def __init__(self, transport: "ZmqTransport", pending: LaneSend, peer: int, tag: int) -> None:
        self._transport = transport
        self._pending = pending
        self.peer = peer
        self.tag = tag

    def test(self) -> bool:
        pending = self._pending
        if not pending.done:
            self._transport._progress_nowait()
        if pending.done:
            if pending.lost:  # the lane's read side tells how it ended
                self._transport._check_lost_send(self.peer, self.tag)
                return False
            return True
        self._transport._raise_if_broken(self.peer, self.tag)
        return False

    def wait(self, timeout: float | None = None) -> None:
        self._transport._wait_for(self.test, self.peer, self.tag, self.action, timeout)


class RecvRequest(Request):
    """A receive, or an unexpected message waiting for its receive.

    Filled segment by segment; ``buf`` is None while the message is
    unexpected (its frames are kept in ``frames``). A reducing receive
    (``reduce`` set to ``(out, mine, op)``) reduces each segment straight
    from the received frame: ``out = mine (op) segment``. ``sig`` is the
    receive's signature, ``theirs`` the message's; once an ``error`` is
    set, the rest of the message is read and dropped.
    """

    __slots__ = ("_transport", "peer", "tag", "buf", "total", "received", "frames", "error", "started",
                 "reduce", "sig", "theirs")
    action = "receiving from"

    def __init__(self, transport: "ZmqTransport", peer: int, tag: int, buf: np.ndarray | None,
                 reduce: tuple | None = None, sig: Sig = NO_SIG) -> None:
        self._transport = transport
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.total = -1
        self.received = 0
        self.frames: list[tuple[int, Any]] = []
        self.error: Exception | None = None
        self.started = False
        self.reduce = reduce
        self.sig = sig
        self.theirs = NO_SIG

    @property
    def complete(self) -> bool:
        return self.started and self.received >= self.total

    def start(self, total: int, theirs: Sig) -> None:
        """The first segment of the message arrived, announcing ``total`` bytes and its signature."""
        self.started = True
        self.total = total
        self.theirs = theirs
        buf = self.buf
        if buf is not None and (theirs != self.sig or theirs[0] & REFUSED or total != buf.nbytes):
            self._check()

    def _check(self) -> None:
        """Compare the message with the receive: signatures, then sizes."""
        if self.error is not None:
            return
        theirs = self.theirs
        if theirs != self.sig or theirs[0] & REFUSED:
            self.error = check_message(self.sig, theirs, self._transport.rank, self.peer)
            if self.error is not None:
                return
        if self.total != self.buf.nbytes:
            t = self._transport
            self.error = MismatchedCollective(
                f"rank {t.rank}: expected {self.buf.nbytes} bytes from {t._name(self.peer)} "
                f"(tag {self.tag}), got {self.total} (ranks disagree about the collective or its size)")

    def target(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Where a segment goes: a view of the user's buffer, or None (keep, reduce or drop the frame)."""
        if self.buf is None or self.error is not None or self.reduce is not None:
            return None
        return self.buf[offset:offset + nbytes]

    def feed(self, offset: int, data: Any, nbytes: int, landed: bool) -> None:
        """Account for a segment; copy, reduce or keep ``data`` unless it already ``landed`` (or failed)."""
        if not landed:
            if self.buf is None:
                self.frames.append((offset, data))
            elif self.error is None and nbytes:
                self._place(offset, data, nbytes)
        self.received += nbytes

    def _place(self, offset: int, data: Any, nbytes: int) -> None:
        if self.reduce is None:
            self.buf[offset:offset + nbytes] = np.frombuffer(data, np.uint8, nbytes)
            return
        out, mine, op = self.reduce
        item = out.itemsize
        a, b = offset // item, (offset + nbytes) // item
        op.reduce_into(out[a:b], mine[a:b], np.frombuffer(data, out.dtype, b - a))

    def attach(self, buf: np.ndarray, reduce: tuple | None, sig: Sig) -> None:
        """A receive was posted for this unexpected message: check it, place what arrived."""
        self.buf = buf
        self.reduce = reduce
        self.sig = sig
        self._check()
        if self.error is None:
            for offset, data in self.frames:
                self._place(offset, data, len(memoryview(data).cast("B")))
        if self._transport._lanes is not None:
            self._transport._lanes.recycle([data for _, data in self.frames])
        self.frames = []

    def test(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.complete:
            return True
        self._transport._raise_if_broken(self.peer, self.tag, receiving=True)
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        if timeout is None:
            timeout = t.timeout
        start = time.monotonic()
        if not t._drive_until(self.test, start + timeout, self.peer):
            raise t._timed_out(self.peer, self.tag, self.action, start, timeout)


OWN_REQUESTS = (RecvRequest, LaneRequest, SendRequest)

