"""Direct TCP lanes: the data path of the ZeroMQ transport.

One TCP connection per pair of ranks (opened by :mod:`.handshake`), then
non-blocking and driven by whichever thread of the rank waits. A message is
a header (tag, length, signature) and its payload, written with one
``sendmsg`` straight from the user's buffer and read with ``recv_into``
straight into the posted receive's buffer; no I/O thread stands between
the ranks. A lane that ends without a goodbye means the peer died or
dropped the connection: the transport hears of it at once, as
:class:`~collectives.errors.PeerLost` only. The frames, the lane's own tags
and the callbacks into the transport's matching: docs/tcp.md.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from collectives.errors import PeerLost

from .handshake import open_lanes
from collectives.signature import NO_SIG, Sig

__all__ = ["Lanes", "LaneSend", "BYE_TAG", "ABORT_TAG"]

log = logging.getLogger("collectives.zmq")

HEADER = struct.Struct("<qQQQQ")  # tag, total bytes, signature (three words)
#: The peer closes its transport cleanly (its end of file follows).
BYE_TAG = -1
#: The peer aborted; the payload is the abort's text.
ABORT_TAG = -2
#: Longest abort text a lane accepts (a longer one is garbage: the lane ends).
ABORT_BYTES = 4096
#: A message of the transport's own (an agreement's state or decision, a
#: rendezvous key): in-band, so that it arrives before the lane's end.
CONTROL_TAG = -3
#: Longest such message a lane accepts.
CONTROL_BYTES = 1 << 16
#: A payload that cannot land in a posted buffer (a reducing receive, or no
#: receive yet) is read in chunks of this many bytes (a multiple of every item size).
CHUNK = 256 * 1024
#: Chunks of early messages kept for reuse (fresh memory costs a page fault
#: per page: 64 MiB ring allreduces took twice as long without them).
POOLED_CHUNKS = 256



class LaneSend:
    """A send whose bytes are not all in the kernel yet (see :meth:`Lanes.send`)."""

    __slots__ = ("parts", "done", "lost", "buf")

    def __init__(self, parts: list[memoryview], buf: Any) -> None:
        self.parts = parts
        self.done = False
        self.lost = False  # done because the lane ended, not delivered
        self.buf = buf  # kept alive until sent


class _Incoming:
    """The message being read from one lane."""

    __slots__ = ("tag", "total", "got", "req", "chunk", "fill")

    def __init__(self, tag: int, total: int, req: Any) -> None:
        self.tag, self.total, self.got, self.req = tag, total, 0, req
        self.chunk: Any = None  # a buffer for payloads that cannot land in place
        self.fill = 0


class _Text:
    """The payload of an abort frame, collected whole (and its call number)."""

    __slots__ = ("buf", "first", "origin")

    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(nbytes, np.uint8)
        self.first = self.origin = -1

    def target(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset:offset + nbytes]

    def feed(self, offset: int, data: Any, nbytes: int, landed: bool) -> None:
        pass

    def text(self) -> str:
        return self.buf.tobytes().decode("utf-8", "replace")

    def payload(self) -> bytes:
        return self.buf.tobytes()


class _Lane:
    __slots__ = ("peer", "sock", "out", "header", "header_got", "cur", "open", "sendable", "scratch", "bye")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.out: collections.deque[LaneSend] = collections.deque()
        self.header = bytearray(HEADER.size)
        self.header_got = 0
        self.cur: _Incoming | None = None
        self.open = True  # still read (until end of file or an error)
        self.sendable = True  # a write has not failed
        self.scratch = bytearray(CHUNK)  # chunks a posted receive consumes at once (it reduces them)
        self.bye = False  # the peer said goodbye on this lane


class Lanes:
    """Every peer's lane of one rank.

    Args:
        rank: this rank.
        socks: the authenticated socket of every peer (None for this rank).
        start: ``start(peer, tag, total, sig)`` -> the request a new message fills.
        lost: ``lost(peer, said_bye)``, called once when a lane ends.
        matching: held while arrivals are delivered (the transport's lock
            over its receives; one thread reads the lanes at a time).
        aborted: ``aborted(peer, text, first, origin)``, called when an abort arrives.
    """

    def __init__(self, rank: int, socks: Sequence[socket.socket | None],
                 start: Callable[[int, int, int, Sig], Any], lost: Callable[[int, bool], None],
                 matching: ContextManager, aborted: Callable[[int, str, int, int], None] | None = None) -> None:
        self.rank = rank
        self._lanes = {p: _Lane(p, s) for p, s in enumerate(socks) if s is not None}
        self._start = start
        self._lost = lost
        self._aborted = aborted or (lambda peer, text, first, origin: None)
        self._matching = matching
        self._out_lock = threading.Lock()  # senders and the reading thread both push and end lanes
        self._sending = False  # a LaneSend is queued on some lane
        self._chunks: list[np.ndarray] = []  # pooled CHUNK-sized buffers for early messages
        self._ended: collections.deque[tuple[int, bool]] = collections.deque()  # to tell the transport
        #: ``on_control(peer, payload)``: a CONTROL_TAG frame arrived whole.
        self.on_control: Callable[[int, bytes], None] = lambda peer, payload: None

    # -- opening -------------------------------------------------------------

    @classmethod
    def connect(cls, rank: int, size: int, address: str, key: bytes, job: str,
                publish: Callable[[str], None], lookup: Callable[[int, float], str], timeout: float,
                start: Callable[[int, int, int, Sig], Any], lost: Callable[[int, bool], None],
                matching: ContextManager, aborted: Callable[[int, str, int, int], None] | None = None,
                name: Callable[[int], str] = lambda peer: f"rank {peer}",
                watch: Callable[[], None] = lambda: None) -> "Lanes":
        """The lanes of ``rank``, each connection opened and authenticated by
        :func:`~.handshake.open_lanes` (same arguments)."""
        socks = open_lanes(rank, size, address, key, job, publish, lookup, timeout, name, watch)
        return cls(rank, socks, start, lost, matching, aborted)

    # -- sending -------------------------------------------------------------

    def send(self, peer: int, tag: int, data: memoryview, buf: Any, sig: Sig = NO_SIG) -> LaneSend | None:
        """Send ``data`` (bytes) to ``peer`` with the call's signature ``sig``:
        None when every byte is in the kernel already, else the
        :class:`LaneSend` that :meth:`progress` completes (``buf`` is kept
        alive until then).

        Raises:
            PeerLost: the lane has ended (the peer is gone).
        """
        lane = self._lanes[peer]
        parts = [memoryview(HEADER.pack(tag, data.nbytes, sig[0], sig[1], sig[2]))]
        if data.nbytes:
            parts.append(data)
        with self._out_lock:
            if lane.sendable:
                if not lane.out:
                    parts = self._write(lane, parts)
                    if not parts and lane.sendable:
                        return None
                if lane.sendable:
                    pending = LaneSend(parts, buf)
                    lane.out.append(pending)
                    self._sending = True
                    return pending
        self._report()
        raise PeerLost(f"rank {self.rank}: the TCP lane to rank {peer} has ended", peer)

    def _write(self, lane: _Lane, parts: list[memoryview]) -> list[memoryview]:
        """Write what the kernel takes now; return what is left ([] also when
        the write failed: check ``lane.sendable``)."""
        while parts:
            try:
                n = lane.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                return parts
            except OSError:
                self._drop_sends(lane)
                return []
            while n and parts:
                if n >= parts[0].nbytes:
                    n -= parts[0].nbytes
                    parts.pop(0)
                else:
                    parts[0] = parts[0][n:]
                    n = 0
        return parts

    def flush(self) -> int:
        """Push queued sends; returns how many completed."""
        if not self._sending:
            return 0
        done, queued = 0, False
        with self._out_lock:
            for lane in self._lanes.values():
                while lane.out and lane.sendable:
                    head = lane.out[0]
                    head.parts = self._write(lane, head.parts)
                    if not lane.sendable:  # the write failed, which dropped the queue
                        break
                    if head.parts:
                        queued = True
                        break
                    head.done, head.buf = True, None
                    lane.out.popleft()
                    done += 1
            self._sending = queued
        if self._ended:
            self._report()
        return done

    def abort(self, text: str, first: int = -1, origin: int = -1) -> None:
        """Queue an abort frame carrying ``text`` and ``first`` (the first
        call the aborting rank did not complete; -1: unknown) on every open
        lane, after what is queued there (so that it arrives whole); never
        raises. ``origin``: the aborting rank when this rank relays its
        abort (-1: this rank aborts)."""
        payload = text.encode("utf-8", "replace")[:ABORT_BYTES]
        for peer, lane in list(self._lanes.items()):
            if lane.sendable:
                try:
                    self.send(peer, ABORT_TAG, memoryview(payload), payload,
                              (max(first, -1) + 1, max(origin, -1) + 1, 0))
                except PeerLost:
                    pass

    def send_control(self, peer: int, payload: bytes) -> bool:
        """Queue a message of the transport's own to ``peer`` (False: its lane
        takes no more); never raises."""
        lane = self._lanes.get(peer)
        if lane is None or not lane.sendable or len(payload) > CONTROL_BYTES:
            return False
        try:
            self.send(peer, CONTROL_TAG, memoryview(payload), payload)
        except PeerLost:
            return False
        return True

    # -- receiving -----------------------------------------------------------

    def sockets(self) -> list[socket.socket]:
        """The open lanes' sockets (to poll)."""
        return [lane.sock for lane in self._lanes.values() if lane.open]

    def socket_of(self, peer: int) -> socket.socket | None:
        """``peer``'s lane socket, open or not (None: no lane to that peer)."""
        lane = self._lanes.get(peer)
        return None if lane is None else lane.sock

    def sending(self) -> list[socket.socket]:
        """The sockets of open lanes with queued sends (to poll for room)."""
        if not self._sending:
            return []
        with self._out_lock:
            return [lane.sock for lane in self._lanes.values() if lane.out and lane.sendable]

    def progress(self) -> int:
        """Read whatever has arrived on every lane and deliver it; push
        queued sends. Returns the bytes read and sends completed (0: nothing
        moved). One thread at a time."""
        moved = self.flush()
        with self._matching:
            for lane in self._lanes.values():
                if lane.open:
                    moved += self._read(lane)
        if self._ended:
            self._report()
        return moved

    def _read(self, lane: _Lane) -> int:
        """Read and deliver what has arrived on ``lane``; a lane that ends
        (end of file, a reset, any socket error, a malformed frame) is ended
        here and never raises."""
        total = 0
        sock = lane.sock
        while True:
            cur = lane.cur
            try:
                if cur is None:
                    n = sock.recv_into(memoryview(lane.header)[lane.header_got:])
                    if n == 0:
                        self._end(lane)
                        return total
                    total += n
                    lane.header_got += n
                    if lane.header_got < HEADER.size:
                        continue
                    lane.header_got = 0
                    tag, size, w0, w1, w2 = HEADER.unpack(lane.header)
                    if tag < 0:
                        if not self._begin_control(lane, tag, size, w0, w1):
                            return total
                        continue
                    cur = lane.cur = _Incoming(tag, size, self._start(lane.peer, tag, size, (w0, w1, w2)))
                    if size == 0:
                        cur.req.feed(0, None, 0, True)
                        lane.cur = None
                    continue
                total += self._payload(lane, cur)
                if cur.got >= cur.total:
                    lane.cur = None
                    if cur.tag < 0:
                        self._controlled(lane, cur)
            except (BlockingIOError, InterruptedError):
                return total
            except OSError:  # a reset, a timeout of keepalive, a socket closed under us
                self._end(lane)
                return total

    def _begin_control(self, lane: _Lane, tag: int, size: int, first: int, origin: int) -> bool:
        """A frame of the lanes' own starts (False: it is malformed and the lane ended)."""
        text = self._control(tag, size)
        if text is None:
            log.warning("rank %d: a malformed frame (tag %d, %d bytes) on the TCP lane of rank %d",
                        self.rank, tag, size, lane.peer)
            self._end(lane)
            return False
        text.first, text.origin = first - 1, origin - 1
        cur = lane.cur = _Incoming(tag, size, text)
        if size == 0:
            lane.cur = None
            self._controlled(lane, cur)
        return True

    def _control(self, tag: int, size: int) -> Any:
        """What a lane frame with a negative tag fills (None: malformed)."""
        if tag == BYE_TAG and size == 0:
            return _Text(0)
        if tag == ABORT_TAG and size <= ABORT_BYTES:
            return _Text(size)
        if tag == CONTROL_TAG and size <= CONTROL_BYTES:
            return _Text(size)
        return None

    def _controlled(self, lane: _Lane, cur: _Incoming) -> None:
        """A lane frame of the lanes' own arrived whole."""
        if cur.tag == BYE_TAG:
            lane.bye = True
        elif cur.tag == ABORT_TAG:
            self._aborted(lane.peer, cur.req.text(), cur.req.first, cur.req.origin)
        elif cur.tag == CONTROL_TAG:
            self.on_control(lane.peer, cur.req.payload())

    def _payload(self, lane: _Lane, cur: _Incoming) -> int:
        """Read more of the current message's payload (raises BlockingIOError when none is there)."""
        left = cur.total - cur.got
        target = cur.req.target(cur.got, left) if cur.chunk is None else None
        if target is not None:
            n = lane.sock.recv_into(memoryview(target).cast("B"))
            if n == 0:
                self._end(lane)
                raise BlockingIOError
            cur.req.feed(cur.got, None, n, True)
            cur.got += n
            return n
        if cur.chunk is None:  # a receive consumes the chunk at once; an early message keeps it
            want = min(CHUNK, left)
            cur.chunk = memoryview(lane.scratch)[:want] if cur.req.buf is not None else self._chunk(want)
            cur.fill = 0
        n = lane.sock.recv_into(memoryview(cur.chunk)[cur.fill:])
        if n == 0:
            self._end(lane)
            raise BlockingIOError
        cur.fill += n
        if cur.fill == len(cur.chunk):  # a whole chunk: reduce it or keep it
            cur.req.feed(cur.got, cur.chunk, cur.fill, False)
            cur.got += cur.fill
            cur.chunk = None
        return n

    def _chunk(self, nbytes: int) -> np.ndarray:
        """A buffer for part of an early message (pooled when whole-sized)."""
        if nbytes == CHUNK and self._chunks:
            return self._chunks.pop()
        return np.empty(nbytes, np.uint8)  # no zeroing, unlike a bytearray

    def recycle(self, buffers: Sequence[Any]) -> None:
        """Take back early messages' chunks once their receive has consumed
        them (call with the matching lock held)."""
        for b in buffers:
            if isinstance(b, np.ndarray) and b.nbytes == CHUNK and len(self._chunks) < POOLED_CHUNKS:
                self._chunks.append(b)

    @staticmethod
    def _drop_sends(lane: _Lane) -> None:
        """No more sending on ``lane`` (a write failed: the peer closed or
        reset; or the lane ended): queued sends are dropped and marked lost.
        A lane whose write failed is still read: what the peer sent before
        it went (an abort, a goodbye) and its end of file decide how the
        transport hears of it. Call with the send lock held."""
        lane.sendable = False
        for pending in lane.out:
            pending.done, pending.lost, pending.buf = True, True, None
        lane.out.clear()

    def _end(self, lane: _Lane) -> None:
        """The lane ended (end of file, a reset, an error): queued sends are
        dropped and marked lost (the peer is gone), and the transport hears
        of it once (see :meth:`_report`)."""
        with self._out_lock:
            if not lane.open:
                return
            lane.open = False
            self._drop_sends(lane)
            try:
                lane.sock.close()
            except OSError:
                pass
            self._ended.append((lane.peer, lane.bye))

    def _report(self) -> None:
        """Tell the transport of lanes that ended (outside the send lock:
        the transport takes its own)."""
        while self._ended:
            try:
                peer, bye = self._ended.popleft()
            except IndexError:  # another thread took it
                return
            self._lost(peer, bye)

    def is_open(self, peer: int) -> bool:
        """Whether ``peer``'s lane still runs (it ends when the peer closes or dies)."""
        lane = self._lanes.get(peer)
        return lane is not None and lane.open

    def close(self, deadline: float, bye: bool = True) -> None:
        """Say goodbye on every lane (``bye``), push what is queued (until
        ``deadline``), then close every lane."""
        if bye:
            for peer, lane in list(self._lanes.items()):
                if lane.sendable:
                    try:
                        self.send(peer, BYE_TAG, memoryview(b""), None)
                    except PeerLost:
                        pass
        while self._sending and time.monotonic() < deadline:
            if not self.flush():
                socks = self.sending()
                if socks:
                    select.select([], socks, [], min(0.01, max(deadline - time.monotonic(), 0.0)))
        with self._out_lock:
            lanes = list(self._lanes.values())
            for lane in lanes:
                if lane.open:
                    lane.open = False
                    self._drop_sends(lane)
                    try:
                        lane.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    lane.sock.close()


