"""What an algorithm sees of one collective call.

An algorithm is a plain function ``f(ctx, ...)`` over point-to-point calls.
:class:`CallContext` carries the transport, this call's tag and its deadline,
so algorithms never thread timeouts or tags through their code.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .signature import NO_SIG, Sig
from .transport import Request, Transport

__all__ = ["CallContext", "SEGMENT_BYTES"]

#: The timeout of a wait begun past the call's deadline: enough to look once.
_SLIVER = 1e-6

#: Large buffers are cut into pieces of this many bytes so that
#: communication and reduction overlap (pipelined algorithms, window paths).
SEGMENT_BYTES = 1 << 20


class CallContext:
    """One collective call: transport, tag, deadline and scratch space.

    Attributes:
        transport: the transport the call runs on.
        rank, size: this rank and the number of ranks.
        tag: the tag every message of this call carries.
        sig: the call's signature (sequence number included), carried by
            every message and every shared-window post of the call.
        deadline: ``time.monotonic()`` past which waits raise CollectiveTimeout.
        segment_bytes: pipeline segment size for large messages.
    """

    __slots__ = ("transport", "rank", "size", "tag", "sig", "deadline", "segment_bytes", "_scratch", "tracer")

    def __init__(self, transport: Transport, tag: int, deadline: float,
                 segment_bytes: int = SEGMENT_BYTES, scratch: dict | None = None, sig: Sig = NO_SIG) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.tag = tag
        self.sig = sig
        self.tracer = None  # the timeline's tracer while tracing (phases of the call)
        self.deadline = deadline
        self.segment_bytes = segment_bytes
        self._scratch = scratch if scratch is not None else {}

    def remaining(self) -> float:
        """Seconds left before the deadline, for the next wait; a sliver when
        none is left, so that the transport's wait, not this, times out: it
        says who the call waits for and where each rank is."""
        return max(self.deadline - time.monotonic(), _SLIVER)

    def isend(self, arr: np.ndarray, peer: int) -> Request:
        return self.transport.isend(arr, peer, self.tag, self.sig)

    def irecv(self, arr: np.ndarray, peer: int) -> Request:
        return self.transport.irecv(arr, peer, self.tag, self.sig)

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, op, tmp: np.ndarray) -> Request:
        """Receive from ``peer`` and set ``out = mine (op) received`` (see
        :meth:`~collectives.transport.Transport.irecv_reduce`; ``tmp`` is scratch
        of ``out``'s size)."""
        return self.transport.irecv_reduce(out, mine, peer, self.tag, op, tmp, self.sig)

    def wait(self, req: Request) -> None:
        """Wait for one request of this call, within its deadline."""
        if self.tracer is None:
            req.wait(self.remaining())
        else:
            self._traced("receiving" if getattr(req, "kind", "receive") == "receive" else "sending",
                         req.wait, self.remaining())

    def send(self, arr: np.ndarray, peer: int) -> None:
        if self.tracer is None:
            self.transport.send(arr, peer, self.tag, self.sig, self.remaining())
        else:
            self._traced("sending", self.transport.isend(arr, peer, self.tag, self.sig).wait, self.remaining())

    def recv(self, arr: np.ndarray, peer: int) -> None:
        if self.tracer is None:
            self.transport.recv(arr, peer, self.tag, self.sig, self.remaining())
        else:
            self._traced("receiving", self.transport.irecv(arr, peer, self.tag, self.sig).wait, self.remaining())

    def sendrecv(self, sendarr: np.ndarray, dst: int, recvarr: np.ndarray, src: int) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time (the send
        first: the peer's message may then already be there to take)."""
        s = self.transport.isend(sendarr, dst, self.tag, self.sig)
        r = self.transport.irecv(recvarr, src, self.tag, self.sig)
        self.waitall((r, s))

    def waitall(self, requests: Sequence[Request]) -> None:
        if requests:
            if self.tracer is None:
                self.transport.waitall(requests, self.remaining())
            else:
                self._traced("exchanging", self.transport.waitall, requests, self.remaining())

    def _traced(self, name: str, wait, *args) -> None:
        """``wait(*args)``, timed as the call's phase ``name`` (tracing only)."""
        t0 = time.monotonic()
        try:
            wait(*args)
        finally:
            self.tracer.phase(name, t0, time.monotonic())

    def scratch(self, count: int, dtype: np.dtype, slot: int = 0) -> np.ndarray:
        """A reusable scratch array of ``count`` elements of ``dtype``.

        Distinct ``slot`` numbers give distinct memory; the same slot may be
        reused by a later call, so never keep a scratch array across calls.
        """
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._scratch[slot] = buf
        return buf[:nbytes].view(dtype)
