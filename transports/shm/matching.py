"""Sends and receives, and matching arriving messages to receives.

A message that arrives before its receive is posted is drained into an
unexpected-message queue (by sender and tag), so different tags never
block each other and two ranks that both send before receiving never
deadlock. A message meets its receive by sender and tag; then their
signatures and sizes must agree (:func:`~collectives.signature.check_message`),
and a collective message of another call than a pending collective
receive's fails that receive (:func:`~collectives.signature.out_of_step`).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from collectives import signature
from collectives.errors import MismatchedCollective
from collectives.signature import NO_SIG, Sig
from collectives.transport import COMPLETED, Request, Transport

from .requests import Incoming, RecvRequest, SendRequest, Unexpected, bytes_view
from .rings import HEADER_BYTES

__all__ = ["Matching"]

#: Call numbers wrap around here (the communicator's tag space).
_CALLS = 1 << 27


class Matching:
    """``isend``, ``irecv``, ``irecv_reduce``, the blocking ``recv`` (a
    blocking send is ``isend`` and a wait, which goes on in C:
    :meth:`_claim_send`), and routing what arrives; mixed into
    :class:`~.transport.SharedMemoryTransport`.

    Reads and writes the ring state of :class:`~.rings.Rings`: the send
    queues (``_tx_queue``, ``_tx_busy``), the receives and early messages
    (``_posted``, ``_unexpected``) and the message being copied out
    (``_rx_cur``); reads ``rank``, ``_ring_bytes``, ``_ranks``, ``_rx_q``,
    ``_rx_head_i``, ``_rx_tail``, ``_rx_data``, ``_streams`` and
    ``_recv_spin_ns``; moves bytes with the rings' ``_push``, ``_pull``,
    ``_progress``, ``_send_whole``, ``_take_whole``, ``_send_stream``,
    ``_take_stream``, ``_ready_payload`` and ``_consume``; holds ``_lock``
    while it does.
    """

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start sending ``buf``'s bytes to ``peer``; completes once they are in the ring."""
        with self._lock:
            self._check_usable()
            queue = self._tx_queue[peer]
            if not queue and self._send_whole(peer, tag, buf, sig):
                return COMPLETED
            req = SendRequest(self, peer, tag, bytes_view(buf), sig)
            queue.append(req)
            self._tx_busy.add(peer)
            if len(queue) == 1:
                if self._streamed(req.nbytes):  # in C, a chunk at a time, up to a ring's worth
                    req.sent = self._send_stream(peer, tag, buf, sig, 0, eager=True)
                    if req.sent == req.wire:
                        req.done = True
                        queue.popleft()
                        self._tx_busy.discard(peer)
                else:
                    self._push(peer)
        return COMPLETED if req.done else req

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start receiving exactly ``buf.nbytes`` bytes from ``peer`` with ``tag``."""
        with self._lock:
            self._check_usable()
            if self._take_whole(peer, tag, buf, sig):  # the common case of small messages: already here
                return COMPLETED
            req = RecvRequest(self, peer, tag, bytes_view(buf), sig)
            early = self._unexpected[peer].get(tag)
            if early:
                entry = early.popleft()
                if not early:
                    del self._unexpected[peer][tag]
                self._take_unexpected(req, entry)
            elif tag & 1 and self._other_call_queued(peer, tag, req):
                pass
            else:
                self._posted[peer].setdefault(tag, collections.deque()).append(req)
                if self._rx_q[self._rx_head_i[peer]] != self._rx_tail[peer]:
                    self._pull(peer)
        return req

    def recv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG, timeout: float | None = None) -> None:
        """Receive (blocking): a whole message at the head of its ring is
        taken at once, or after a short spin where each rank has a core of
        its own (in C, the lock held); where the extension is built, one of
        more than a quarter of the ring streams out as it arrives
        (:meth:`_take_stream`); otherwise, and for the rest, as
        :meth:`irecv` and wait."""
        with self._lock:
            self._check_usable()
            rest = self._take_now(peer, tag, buf, sig)
            if rest is True:
                return
        if rest is not False:
            rest.wait(timeout)  # the rest of a stream, in C first (the lock let go while it waits)
            return
        rest = self.irecv(buf, peer, tag, sig)
        if rest is COMPLETED:
            return
        if not rest.done:  # the spin above found nothing: no second one
            self._wait((rest,), timeout, claim=False)
        if rest.error is not None:
            raise rest.error

    def _take_now(self, peer: int, tag: int, buf: Any, sig: Sig,
                  claimed: RecvRequest | None = None) -> RecvRequest | bool:
        """With the lock held: take a receive's message now if it is next in
        its ring, whole or, when large, streamed in C as it arrives, after a
        spin where each rank has a core of its own (docs/shared-memory.md
        weighs it for posted receives). True: it is all in ``buf``; False:
        none of it was taken; else the receive (``claimed``, or a new one)
        that now waits for the rest as the message being copied out
        (``_rx_cur``)."""
        if not self._streamed(buf.nbytes):
            return self._take_whole(peer, tag, buf, sig, self._recv_spin_ns, claimed is not None)
        taken = self._take_stream(peer, tag, buf, sig, claimed is not None)
        if not taken:
            return False
        req = claimed or RecvRequest(self, peer, tag, bytes_view(buf), sig)
        cur = Incoming(tag, req.nbytes, req.mv, req)
        cur.got = taken - HEADER_BYTES
        if cur.got >= cur.wire:
            return True
        self._rx_cur[peer] = cur  # the rest as it arrives, in Python
        return req

    def _claim(self, req: RecvRequest) -> bool:
        """A wait for the receive ``req`` alone: when it is the first receive
        of its tag posted for its peer, take its message now as :meth:`recv`
        does; when its message is the one being copied out, go on with it in
        C (in C only). True when ``req`` completed."""
        if self._streams is None:
            return False
        with self._lock:
            cur = self._rx_cur[req.peer]
            if cur is not None and cur.target is req and cur.dest is req.mv and not self._closed:
                cur.got += self._take_stream(req.peer, req.tag, req.mv, req.sig, taken=HEADER_BYTES + cur.got)
                if cur.got >= cur.wire:
                    self._rx_cur[req.peer] = None
                    req.done = True
                return req.done
            queues = self._posted[req.peer]
            posted = queues.get(req.tag)
            if self._closed or not posted or posted[0] is not req:
                return False
            posted.popleft()
            got = self._take_now(req.peer, req.tag, req.mv, req.sig, claimed=req)
            if got is False:
                posted.appendleft(req)  # still the first: it waits as any receive
                return False
            if not posted:
                del queues[req.tag]
            req.done = got is True
            return req.done

    def _claim_send(self, req: SendRequest) -> bool:
        """A wait for the queued send ``req`` alone: when it is the first in
        its peer's queue, stream the rest of it in C while the receiver takes
        it out (as long as room keeps coming within a spin). True when
        ``req`` completed."""
        if self._streams is None:
            return False
        with self._lock:
            queue = self._tx_queue[req.peer]
            if self._closed or not queue or queue[0] is not req:
                return False
            req.sent += self._send_stream(req.peer, req.tag, req.mv, req.sig, req.sent)
            if req.sent < req.wire:
                return False
            req.done = True
            queue.popleft()
            if queue:
                self._push(req.peer)
            else:
                self._tx_busy.discard(req.peer)
            return True

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Reduce straight from the ring when the whole message is already there
        in one piece; otherwise receive into ``tmp`` and reduce on completion."""
        n = out.nbytes
        if n and out.flags.c_contiguous:
            with self._lock:
                self._check_usable()
                pos = self._ready_payload(peer, tag, n, sig)
                if 0 <= pos <= self._ring_bytes - n:
                    received = self._rx_data[peer][pos:pos + n]
                    op.reduce_into(out, mine, np.frombuffer(received, out.dtype).reshape(out.shape))
                    self._consume(peer, n)
                    return COMPLETED
        return Transport.irecv_reduce(self, out, mine, peer, tag, op, tmp, sig)

    def _other_call_queued(self, peer: int, tag: int, req: RecvRequest) -> bool:
        """Fail ``req`` (a collective receive) when a message of another call
        from ``peer`` waits unclaimed: ``peer`` moved past this call."""
        for other, queue in self._unexpected[peer].items():
            if other & 1 and other != tag and queue:
                req.error, req.done = signature.out_of_step(self.rank, peer, tag, other, queue[0].sig), True
                return True
        return False

    def _take_unexpected(self, req: RecvRequest, entry: Unexpected) -> None:
        """Hand an early message to ``req``: copy it, or redirect the rest of it."""
        err = self._disagreement(req, entry.sig, len(entry.data))
        if err is not None:
            req.error, req.done = err, True
            if not entry.done:  # the rest of it is dropped as it arrives
                cur = self._rx_cur[req.peer]
                cur.dest, cur.target = None, None
            return
        if entry.done:
            req.mv[:] = entry.data
            req.done = True
            return
        cur = self._rx_cur[req.peer]  # the entry is still arriving: stream the rest straight in
        got = min(cur.got, cur.nbytes)
        req.mv[:got] = entry.data[:got]
        cur.dest, cur.target = req.mv, req

    def _match(self, src: int, tag: int, nbytes: int, sig: signature.Sig) -> Incoming:
        """Route a newly arrived message to its posted receive, or queue it as
        unexpected; a receive whose signature or size disagrees fails (the
        message is then read and dropped), and so does a collective receive
        from ``src`` for another call (see :func:`~collectives.signature.out_of_step`)."""
        posted = self._posted[src].get(tag)
        if posted:
            req = posted.popleft()
            if not posted:
                del self._posted[src][tag]
            err = self._disagreement(req, sig, nbytes)
            if err is not None:
                req.error, req.done = err, True
                return Incoming(tag, nbytes, None, None)
            return Incoming(tag, nbytes, req.mv, req)
        if tag & 1:
            self._fail_out_of_step(src, tag, sig)
        entry = Unexpected(nbytes, sig)
        self._unexpected[src].setdefault(tag, collections.deque()).append(entry)
        return Incoming(tag, nbytes, memoryview(entry.data), entry)

    def _disagreement(self, req: RecvRequest, sig: signature.Sig, nbytes: int) -> Exception | None:
        """Why a message with ``sig`` and ``nbytes`` cannot complete ``req`` (None: it can)."""
        if sig != req.sig:
            err = signature.check_message(req.sig, sig, self.rank, req.peer)
            if err is not None:
                return err
        if req.nbytes != nbytes:
            return MismatchedCollective(
                f"rank {self.rank}: expected {req.nbytes} bytes from rank {req.peer}, got {nbytes} "
                f"(in {signature.describe(req.sig)}; ranks disagree about the collective or its size)")
        return None

    def _fail_out_of_step(self, src: int, tag: int, sig: signature.Sig) -> None:
        """A collective message from ``src`` for call ``tag`` arrived: fail every
        pending collective receive from ``src`` for another call."""
        for other, queue in list(self._posted[src].items()):
            if other & 1 and other != tag:
                for req in queue:
                    req.error, req.done = signature.out_of_step(self.rank, src, other, tag, sig), True
                del self._posted[src][other]

    def _check_leftovers(self, seq: int) -> None:
        """Raise when a message of an earlier call from some peer was never
        received: that peer and this rank made different calls then (both
        only sent, so neither noticed). Messages of this or later calls (a
        peer ahead) and point-to-point ones are left alone."""
        if not any(self._rx_q[self._rx_head_i[src]] != self._rx_tail[src] for src in self._ranks) \
                and not any(self._unexpected):
            return
        with self._lock:
            self._progress()
            for src, queues in enumerate(self._unexpected):
                for tag, queue in queues.items():
                    old = (seq - signature.seq_of_tag(tag)) % _CALLS
                    if tag & 1 and queue and 0 < old < _CALLS // 2:
                        raise MismatchedCollective(
                            f"rank {self.rank}: rank {src} sent a message of call #{signature.seq_of_tag(tag)} "
                            f"({signature.describe(queue[0].sig)}) that no receive of this rank took: the two "
                            "ranks made different calls then")
