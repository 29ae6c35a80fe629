"""Byte rings: streaming messages through one ring per pair of ranks.

The ring from rank s to rank d lives in d's segment: s writes the data and
its head counter, d its tail counter. Counters are monotonically
increasing 64-bit integers, each written by one process only (aligned
8-byte stores; x86 keeps stores in order, so no atomics are needed).
Messages are a :data:`HEADER` (tag, length, the call's signature) followed
by the payload, padded to 16 bytes, streamed through the ring as space
frees up, so large messages pipeline: the sender copies in while the
receiver copies out. A whole small message that fits goes in (and comes
out) in one piece (:meth:`Rings._send_whole`, :meth:`Rings._take_whole`),
in C where the extension is built (``collectives/_rings.c``: the same
header, checked the same way).
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import numpy as np

from collectives import compiled, signature
from collectives.errors import BadArgument
from collectives.numpy_layout import reads_numpy_right
from collectives.ops import SUPPORTED_DTYPES

from .layout import Q_SLEEP, align

__all__ = ["Rings", "HEADER", "HEADER_BYTES", "STREAM_CHUNK", "write_header", "read_header", "bytes_view"]

HEADER = struct.Struct("<qqQQQq")  # tag, payload length, the call's signature (3 words), padding
HEADER_BYTES = HEADER.size
#: A message streamed in C (:meth:`Rings._send_stream`, :meth:`Rings._take_stream`)
#: publishes its counter after each of these many bytes, so that the other
#: side copies while this one does.
STREAM_CHUNK = 64 * 1024


def bytes_view(buf: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat 'B' memoryview (zero-copy)."""
    if buf.ndim != 1:
        buf = buf.reshape(-1)
    return memoryview(buf.view(np.uint8))


def write_header(ring: memoryview, pos: int, size: int, tag: int, nbytes: int, sig: signature.Sig) -> None:
    """Write a message's header at ``pos`` of a ring of ``size`` bytes. Messages
    start on 16-byte boundaries and a header is 48 bytes, so one that starts in
    the last 32 bytes goes on at the ring's start."""
    if size - pos >= HEADER_BYTES:
        HEADER.pack_into(ring, pos, tag, nbytes, *sig, 0)
    else:
        raw, k = HEADER.pack(tag, nbytes, *sig, 0), size - pos
        ring[pos:size] = raw[:k]
        ring[:HEADER_BYTES - k] = raw[k:]


def read_header(ring: memoryview, pos: int, size: int) -> tuple[int, int, int, int, int, int]:
    """The header at ``pos`` (see :func:`write_header`)."""
    if size - pos >= HEADER_BYTES:
        return HEADER.unpack_from(ring, pos)
    k = size - pos
    return HEADER.unpack(bytes(ring[pos:size]) + bytes(ring[:HEADER_BYTES - k]))


class Rings:
    """The rings of one rank; mixed into :class:`~.transport.SharedMemoryTransport`.

    :meth:`_setup_rings` (after the rendezvous) reads ``rank``, ``size``,
    ``_layout`` and ``_segs``, and sets the ring state: ``_ring_bytes``;
    sending, ``_tx_q`` (every rank's control words), ``_tx_head_i``,
    ``_tx_tail_i``, ``_tx_data``, ``_tx_head``, ``_tx_tail``, ``_tx_queue``
    (sends not yet wholly in the ring, by peer), ``_tx_busy`` (peers with
    such sends); receiving, ``_rx_q``, ``_rx_head_i``, ``_rx_tail_i``,
    ``_rx_data``, ``_rx_tail``, ``_rx_cur`` (the message being copied out,
    by sender), ``_posted`` and ``_unexpected`` (receives and early messages,
    by sender and tag); ``_moved`` (bytes moved so far) and ``_ranks``.
    Also reads ``_closed``; routes arriving messages with
    :meth:`~.matching.Matching._match` and wakes peers with
    :meth:`~.waking.Waking._wake`. Call with ``_lock`` held.
    """

    def _setup_rings(self) -> None:
        lay, me = self._layout, self._segs[self.rank]
        p = self.size
        self._ring_bytes = lay.ring
        # Sending to dst: ring (self.rank -> dst) lives in dst's segment.
        self._tx_q = [s.q for s in self._segs]
        self._tx_head_i = lay.head_index(self.rank)
        self._tx_tail_i = lay.tail_index(self.rank)
        self._tx_data = [s.mv[lay.ring_slice(self.rank)] for s in self._segs]
        self._tx_head = [0] * p
        self._tx_tail = [0] * p
        self._tx_queue: list[collections.deque] = [collections.deque() for _ in range(p)]
        self._tx_busy: set[int] = set()
        # Receiving from src: ring (src -> self.rank) lives in this segment.
        self._rx_q = me.q
        self._rx_head_i = [lay.head_index(s) for s in range(p)]
        self._rx_tail_i = [lay.tail_index(s) for s in range(p)]
        self._rx_data = [me.mv[lay.ring_slice(s)] for s in range(p)]
        self._rx_tail = [0] * p
        self._rx_cur: list = [None] * p  # the Incoming message of each sender, or None
        self._posted: list[dict[int, collections.deque]] = [{} for _ in range(p)]
        self._unexpected: list[dict[int, collections.deque]] = [{} for _ in range(p)]
        self._moved = 0
        self._ranks = range(p)
        rings = compiled.rings_enabled()
        self._put = rings.put if rings is not None else None
        self._take = rings.take if rings is not None else None
        self._streams = (rings.send_stream, rings.recv_stream) if rings is not None else None
        self._recv_spin_ns = int(self._spin * 1e9)  # a blocking receive's wait in C (0 where cores are shared)

    def compiled_p2p(self, gate: Any) -> Any:
        """The communicator's blocking send and receive of a whole message
        from C (``collectives._rings.Messages``: the checks of the Python
        path's common case, then the ring; anything else takes the Python
        path), or None where the extension is off or reads numpy's arrays
        otherwise than numpy lays them out."""
        rings = compiled.rings_enabled()
        if rings is None or self._closed:
            return None
        lay, me, bases = self._layout, self.rank, self._bases
        tx = tuple((bases[d] + lay.ring_slice(me).start, bases[d] + 8 * lay.head_index(me),
                    bases[d] + 8 * lay.tail_index(me), self._sleep_words[d]) for d in self._ranks)
        rx = tuple((bases[me] + lay.ring_slice(s).start, bases[me] + 8 * lay.head_index(s),
                    bases[me] + 8 * lay.tail_index(s), self._sleep_words[s]) for s in self._ranks)
        state = (self._tx_head, self._tx_queue, self._rx_tail, self._rx_cur, self._posted, self._unexpected)
        whole_max = self._ring_bytes // 4 - HEADER_BYTES  # above: streamed (see _streamed)
        messages = rings.Messages(self, gate, self._lock, np.ndarray, tuple(SUPPORTED_DTYPES),
                                  tuple(d.itemsize for d in SUPPORTED_DTYPES), self._ring_bytes, whole_max,
                                  self._recv_spin_ns, tx, rx, state)
        return messages if reads_numpy_right(messages) else None

    def _push(self, dst: int) -> None:
        """Copy as much of the queued sends to ``dst`` into its ring as fits."""
        queue = self._tx_queue[dst]
        size = self._ring_bytes
        ring = self._tx_data[dst]
        head = self._tx_head[dst]
        tail = self._tx_tail[dst]
        start = head
        while queue:
            req = queue[0]
            free = size - (head - tail)
            if free < req.wire - req.sent:
                tail = self._tx_tail[dst] = self._tx_q[dst][self._tx_tail_i]
                free = size - (head - tail)
            if req.sent == 0:
                if free < HEADER_BYTES:
                    break
                write_header(ring, head % size, size, req.tag, req.nbytes, req.sig)
                head += HEADER_BYTES
                free -= HEADER_BYTES
                req.sent = HEADER_BYTES
            lo = req.sent - HEADER_BYTES
            n = min(req.nbytes - lo, free)
            if n > 0:
                pos = head % size
                first = min(n, size - pos)
                ring[pos:pos + first] = req.mv[lo:lo + first]
                if first < n:
                    ring[:n - first] = req.mv[lo + first:lo + n]
                head += n
                free -= n
                req.sent += n
            if req.sent - HEADER_BYTES >= req.nbytes:
                pad = min(req.wire - req.sent, free)
                head += pad
                req.sent += pad
            if req.sent < req.wire:
                break
            req.done = True
            queue.popleft()
        if head != start:
            self._tx_head[dst] = head
            q = self._tx_q[dst]
            q[self._tx_head_i] = head
            if q[Q_SLEEP]:
                self._wake(dst)
            self._moved += head - start
        if not queue:
            self._tx_busy.discard(dst)

    def _pull(self, src: int) -> None:
        """Copy whatever has arrived from ``src`` to its receives."""
        q = self._rx_q
        tail = self._rx_tail[src]
        avail = q[self._rx_head_i[src]] - tail
        if not avail:
            return
        start = tail
        size = self._ring_bytes
        ring = self._rx_data[src]
        cur = self._rx_cur[src]
        while avail:
            if cur is None:
                tag, nbytes, w0, w1, w2, _ = read_header(ring, tail % size, size)
                tail += HEADER_BYTES
                avail -= HEADER_BYTES
                cur = self._match(src, tag, nbytes, (w0, w1, w2))
            n = min(cur.nbytes - cur.got, avail)
            if n > 0:
                dest = cur.dest
                if dest is not None:
                    pos = tail % size
                    first = min(n, size - pos)
                    lo = cur.got
                    dest[lo:lo + first] = ring[pos:pos + first]
                    if first < n:
                        dest[lo + first:lo + n] = ring[:n - first]
                tail += n
                avail -= n
                cur.got += n
            if cur.got >= cur.nbytes:
                pad = min(cur.wire - cur.got, avail)
                tail += pad
                avail -= pad
                cur.got += pad
            if cur.got < cur.wire:
                break
            if cur.target is not None:
                cur.target.done = True
            cur = None
        self._rx_cur[src] = cur
        self._rx_tail[src] = tail
        q[self._rx_tail_i[src]] = tail
        if self._tx_q[src][Q_SLEEP]:
            self._wake(src)  # it may wait for room
        self._moved += tail - start

    def _progress(self) -> None:
        """Push every queued send as far as it goes and pull whatever arrived."""
        if self._tx_busy:
            for dst in tuple(self._tx_busy):
                self._push(dst)
        q, heads, tails = self._rx_q, self._rx_head_i, self._rx_tail
        for src in self._ranks:
            if q[heads[src]] != tails[src]:
                self._pull(src)

    def _progress_locked(self) -> None:
        with self._lock:
            self._check_usable()
            self._progress()

    def _check_usable(self) -> None:
        if self._closed:
            raise BadArgument("the shared-memory transport is closed")

    def _send_whole(self, dst: int, tag: int, buf: np.ndarray, sig: signature.Sig) -> bool:
        """Fast path: put a whole message (the bytes of the C-contiguous
        ``buf``) into an idle ring if it fits now."""
        if self._put is not None:
            old = self._tx_head[dst]
            head = self._put(self._tx_data[dst], self._tx_q[dst], self._tx_head_i, self._tx_tail_i, Q_SLEEP,
                             old, tag, sig[0], sig[1], sig[2], buf)
            if head < 0:
                return False
            self._tx_head[dst] = head
            self._moved += head - old
            return True
        mv = bytes_view(buf)
        nbytes = len(mv)
        wire = HEADER_BYTES + ((nbytes + 15) & ~15)
        size = self._ring_bytes
        head = self._tx_head[dst]
        if size - (head - self._tx_tail[dst]) < wire:
            tail = self._tx_tail[dst] = self._tx_q[dst][self._tx_tail_i]
            if size - (head - tail) < wire:
                return False
        ring = self._tx_data[dst]
        pos = head % size
        write_header(ring, pos, size, tag, nbytes, sig)
        if nbytes:
            pos = (pos + HEADER_BYTES) % size
            first = min(nbytes, size - pos)
            ring[pos:pos + first] = mv[:first] if first < nbytes else mv
            if first < nbytes:
                ring[:nbytes - first] = mv[first:]
        head += wire
        self._tx_head[dst] = head
        q = self._tx_q[dst]
        q[self._tx_head_i] = head
        if q[Q_SLEEP]:
            self._wake(dst)
        self._moved += wire
        return True

    def _next_for(self, src: int, tag: int, claimed: bool) -> bool:
        """Whether the message at the head of ``src``'s ring is the next one a
        receive with ``tag`` may take: none half copied out, no early message
        of that tag, and no receive of that tag posted before (``claimed``:
        the receive was the first posted, and is taken off the queue)."""
        return self._rx_cur[src] is None and not self._unexpected[src].get(tag) \
            and (claimed or not self._posted[src].get(tag))

    def _take_whole(self, src: int, tag: int, buf: np.ndarray, sig: signature.Sig, spin: int = 0,
                    claimed: bool = False) -> bool:
        """Fast path: copy a whole message from ``src`` with ``tag``, ``sig``
        and exactly ``buf.nbytes`` bytes into the C-contiguous ``buf`` when it
        waits at the head of its ring with nothing ahead of it for this
        receive (:meth:`_next_for`); in C, wait for it up to ``spin`` ns
        first. False: not there (or another message is: the caller routes
        it)."""
        if self._take is None:
            mv = bytes_view(buf)
            pos = self._ready_payload(src, tag, len(mv), sig)
            if pos < 0:
                return False
            n, ring = len(mv), self._rx_data[src]
            first = min(n, self._ring_bytes - pos)
            mv[:first] = ring[pos:pos + first]
            if first < n:
                mv[first:] = ring[:n - first]
            self._consume(src, n)
            return True
        if not self._next_for(src, tag, claimed):
            return False
        old = self._rx_tail[src]
        tail = self._take(self._rx_data[src], self._rx_q, self._rx_head_i[src], self._rx_tail_i[src], old,
                          tag, sig[0], sig[1], sig[2], buf, spin)
        if tail < 0:
            return False
        self._rx_tail[src] = tail
        self._moved += tail - old
        if self._tx_q[src][Q_SLEEP]:
            self._wake(src)  # it may wait for room
        return True

    def _streamed(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` streams in C (more than a quarter of
        the ring, where the extension is built: then both sides copy at
        once, a chunk apart)."""
        return self._streams is not None and HEADER_BYTES + nbytes > self._ring_bytes // 4

    def _send_stream(self, dst: int, tag: int, buf: Any, sig: signature.Sig, sent: int = 0,
                     eager: bool = False) -> int:
        """In C, with nothing ahead of this message for ``dst``: stream it
        into the ring (the rest of it: ``sent`` wire bytes are in already)
        while the receiver takes it out, until it is all in or no room came
        for a spin; ``eager`` (a send that does not wait): no more than a
        ring's worth, and no spin. Returns the wire bytes put now (header
        included); the caller queues the rest. Only where the extension is
        built."""
        old = self._tx_head[dst]
        head = self._streams[0](self._tx_data[dst], self._tx_q[dst], self._tx_head_i, self._tx_tail_i, Q_SLEEP,
                                old, tag, sig[0], sig[1], sig[2], buf, sent, self._ring_bytes if eager else 0,
                                STREAM_CHUNK, 0 if eager else self._recv_spin_ns)
        self._tx_head[dst] = head
        self._moved += head - old
        return head - old

    def _take_stream(self, src: int, tag: int, buf: Any, sig: signature.Sig, claimed: bool = False,
                     taken: int = 0) -> int:
        """In C: copy the message from ``src`` with ``tag``, ``sig`` and
        ``buf.nbytes`` bytes out of its ring as it arrives, when nothing is
        ahead of it for this receive (:meth:`_next_for`; or go on with the
        message being copied out into ``buf``, ``taken`` wire bytes of it
        taken already), until it is all out or nothing came for a spin.
        Returns the wire bytes taken now (header included; 0: none, or
        another message waits there), after which the caller takes the rest
        as :meth:`_pull` does. Only where the extension is built."""
        if not taken and not self._next_for(src, tag, claimed):
            return 0
        old = self._rx_tail[src]
        tail = self._streams[1](self._rx_data[src], self._rx_q, self._rx_head_i[src], self._rx_tail_i[src], old,
                                tag, sig[0], sig[1], sig[2], buf, taken, self._tx_q[src], Q_SLEEP, STREAM_CHUNK,
                                self._recv_spin_ns)
        if tail <= old:
            return 0
        self._rx_tail[src] = tail
        self._moved += tail - old
        return tail - old

    def _ready_payload(self, src: int, tag: int, nbytes: int, sig: signature.Sig) -> int:
        """Ring offset of a whole message from ``src`` with ``tag`` and
        ``nbytes`` waiting at the head of its ring, with nothing ahead of it
        for this receive (no earlier posted receive, no early message, no
        message half copied); -1 otherwise. Call with the lock held."""
        if not self._next_for(src, tag, False):
            return -1
        tail = self._rx_tail[src]
        if self._rx_q[self._rx_head_i[src]] - tail < HEADER_BYTES + align(nbytes, 16):
            return -1  # not all there yet (its padding included: a sender may add that last)
        size = self._ring_bytes
        got_tag, got_bytes, w0, w1, w2, _ = read_header(self._rx_data[src], tail % size, size)
        if got_tag != tag or got_bytes != nbytes or (w0, w1, w2) != sig:
            return -1
        return (tail + HEADER_BYTES) % size

    def _consume(self, src: int, nbytes: int) -> None:
        """Release the message just read at the head of ``src``'s ring."""
        tail = self._rx_tail[src] + HEADER_BYTES + align(nbytes, 16)
        self._rx_tail[src] = tail
        self._rx_q[self._rx_tail_i[src]] = tail
        if self._tx_q[src][Q_SLEEP]:
            self._wake(src)  # it may wait for room
        self._moved += HEADER_BYTES + align(nbytes, 16)
