"""Point-to-point requests and waiting for them.

A send is queued until its bytes are in the receiver's ring; a receive
until its message has been copied out of the sender's ring (or out of the
unexpected-message queue, where a message that arrived before its receive
was posted waits). Every wait makes progress on all pending sends and
receives, backs off (:mod:`.waking`), has a deadline, and checks peers
(:mod:`.liveness`).
"""

from __future__ import annotations

import time
from typing import Sequence

from collectives import signature
from collectives.errors import CollectiveTimeout
from collectives.signature import NO_SIG
from collectives.transport import Request

from .layout import align
from .records import WAIT_MESSAGE
from .rings import HEADER_BYTES, bytes_view

__all__ = ["ShmRequest", "SendRequest", "RecvRequest", "Unexpected", "Incoming", "RequestWaits", "bytes_view"]


class ShmRequest(Request):
    """A pending send or receive of ``nbytes`` to or from ``peer`` with ``tag``."""

    __slots__ = ("transport", "peer", "tag", "mv", "nbytes", "done", "error", "sig")

    kind = "request"

    def __init__(self, transport, peer: int, tag: int, mv: memoryview, sig: signature.Sig = NO_SIG) -> None:
        self.transport = transport
        self.peer = peer
        self.tag = tag
        self.mv = mv
        self.nbytes = len(mv)
        self.done = False
        self.error: BaseException | None = None
        self.sig = sig

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self.transport._wait((self,), timeout)
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self.done:
            self.transport._progress_locked()
        if self.error is not None:
            raise self.error
        return self.done

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} of {self.nbytes} B {way} rank {self.peer}"


class SendRequest(ShmRequest):
    """A send; ``sent`` counts the wire bytes pushed (header, payload, padding) of ``wire``."""

    __slots__ = ("sent", "wire")
    kind = "send"

    def __init__(self, transport, peer, tag, mv, sig) -> None:
        super().__init__(transport, peer, tag, mv, sig)
        self.sent = 0
        self.wire = HEADER_BYTES + align(self.nbytes, 16)


class RecvRequest(ShmRequest):
    """A receive of exactly ``nbytes``."""

    __slots__ = ()
    kind = "receive"


class Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("data", "done", "sig")

    def __init__(self, nbytes: int, sig: signature.Sig) -> None:
        self.data = bytearray(nbytes)
        self.done = False
        self.sig = sig


class Incoming:
    """The message being copied out of one sender's ring."""

    __slots__ = ("tag", "nbytes", "wire", "got", "dest", "target")

    def __init__(self, tag: int, nbytes: int, dest: memoryview | None, target) -> None:
        self.tag = tag
        self.nbytes = nbytes
        self.wire = align(nbytes, 16)
        self.got = 0  # wire bytes consumed after the header
        self.dest = dest  # None: discard (a receive that failed)
        self.target = target  # RecvRequest, Unexpected or None


class RequestWaits:
    """Waiting for requests; mixed into :class:`~.transport.SharedMemoryTransport`.

    Reads ``rank``, ``timeout``, ``_lock``, ``_closed``, ``_moved`` (bytes
    moved through the rings so far: a wait that sees it change starts its
    backoff again) and ``_records``; a wait for one request first tries
    :meth:`~.matching.Matching._claim` or ``_claim_send``; uses :meth:`~.rings.Rings._progress`,
    :meth:`~.waking.Waking._backoff`, :meth:`~.waking.Waking._blocker` and
    :meth:`~.liveness.Liveness._maybe_check_peers`.
    """

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request, progressing all of them together."""
        own = [r for r in requests if isinstance(r, ShmRequest)]
        if own:
            self._wait(own, timeout)
            for r in own:
                if r.error is not None:
                    raise r.error
        for r in requests:
            r.wait(timeout)

    def _wait(self, reqs: Sequence[ShmRequest], timeout: float | None, claim: bool = True) -> None:
        """Wait for every request of ``reqs``; ``claim``: a wait for one tries
        the C paths first (False: the caller just did)."""
        pending = [r for r in reqs if not r.done]
        if claim and len(pending) == 1 and (self._claim(pending[0]) if pending[0].kind == "receive"
                                            else self._claim_send(pending[0])):
            return  # its message was next in its ring (see Matching._claim, _claim_send)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        backoff = None
        block = None
        lock = self._lock
        while True:
            with lock:
                self._check_usable()
                moved = self._moved
                self._progress()
                if all(r.done for r in reqs) or any(r.error is not None for r in reqs):
                    if block is not None:
                        self._records.waiting(0, 0)
                    return  # a failed request ends the wait: its error is what counts
                moved = self._moved != moved
            if backoff is None:
                backoff = self._backoff(deadline)
            elif moved:
                backoff.reset()
            elif block is None and backoff.count >= backoff.yields:
                block = self._blocker(lambda: self._nothing_new(reqs))
                pending = [r for r in reqs if not r.done]
                if pending:
                    self._records.waiting(WAIT_MESSAGE, pending[0].peer)
            try:
                backoff.pause(block)
            except CollectiveTimeout:
                pending = [r for r in reqs if not r.done]
                self._records.waiting(0, 0)
                where = self._records.diagnose(pending[0].peer)
                raise CollectiveTimeout(f"rank {self.rank}: {pending[0].describe()} not complete "
                                        f"({len(pending)} pending); {where}") from None
            if backoff.count > backoff.spins:
                self._maybe_check_peers({r.peer for r in reqs if not r.done}, reqs)

    def _nothing_new(self, reqs: Sequence[ShmRequest]) -> bool:
        """Progress once; True when nothing moved and some request is still pending."""
        with self._lock:
            if self._closed:
                return False
            moved = self._moved
            self._progress()
            return moved == self._moved and not all(r.done for r in reqs)
