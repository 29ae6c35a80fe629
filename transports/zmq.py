"""ZeroMQ over TCP: the transport for many machines.

Sockets: each rank binds one ROUTER (inbound) and connects one DEALER to
every peer's ROUTER (outbound), so each ordered pair of ranks has its own
TCP connection and messages between them keep their order. Every socket
authenticates with the job's credentials during the ZeroMQ handshake (see
:mod:`collectives.transports.rendezvous`); a stranger is refused by libzmq
before any of its bytes reach the application, and logged.

Data: unless the job asked for encryption (CURVE) or turned them off
(``zmq_lanes`` / ``COLLECTIVES_ZMQ_LANES=0``), every message travels on a
direct TCP lane per pair of ranks (:mod:`collectives.transports.lanes`),
authenticated with the job's secret and driven by the waiting thread, with
no I/O thread in between: on loopback here an 8-byte exchange takes a
tenth, and 16 MiB half, of the time the same takes over ZeroMQ sockets.
ZeroMQ keeps the rendezvous, the abort and goodbye messages and the
heartbeats. Otherwise the data goes over ZeroMQ as follows.

Messages: a message is cut into segments of ``zmq_segment_bytes`` (4 MiB by
default). Each segment is one ZeroMQ message ``[header, payload]`` where the
header is ``(kind, tag, total bytes, offset)``; the segments of one message
are queued together, so they reach the peer back to back. Small messages
travel as one frame (header and payload copied together); large ones are
sent zero-copy (``copy=False``) and their send request completes when
libzmq has released the memory. Receives are matched by (peer, tag), first
come first served per (peer, tag); a segment whose receive is posted lands
straight in the user's buffer (``recv_into``), one that arrives early is
kept (zero-copy frame) in an unexpected-message queue.

Progress: there is no data thread. Whichever thread waits drives the
inbound socket (one at a time; the others sleep on a condition), so a
single-threaded rank pays no thread hand-off. libzmq's own I/O thread
sends, keeps heartbeats and notices dead connections.

Failures: a peer's process that dies closes its connections (its lane
ends at once); a cut link stops answering heartbeats
(``zmq_heartbeat_timeout``, default 10 s). A
disconnected peer that has not said goodbye becomes :class:`PeerLost` on
every wait after a short grace period. :meth:`ZmqTransport.abort` sends an
abort message to every peer, whose waits raise PeerLost at once.

Options (``options`` dict; all ranks must agree where it matters):
``secret`` (job secret, set by the launcher), ``auth`` (``"plain"`` or
``"curve"``), ``addr`` / ``ifname`` (listening address), ``store``,
``master_addr``, ``master_port`` (rendezvous), ``zmq_segment_bytes``,
``zmq_heartbeat_timeout`` (seconds), ``zmq_lanes`` (default true),
``zmq_reuse_buffers`` (default true;
``COLLECTIVES_ZMQ_REUSE_BUFFERS=0`` turns it off): see
:func:`reuse_message_buffers`.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import hashlib
import logging
import os
import struct
import threading
import time
import warnings
from typing import Any, Sequence

import numpy as np
import zmq

from collectives.errors import BadArgument, CollectiveTimeout, MismatchedCollective, PeerLost
from collectives.signature import NO_SIG, Sig
from collectives.transport import COMPLETED, Request, Transport

from .lanes import Lanes, LaneSend
from .rendezvous import JobCredentials, ZapHandler, choose_address, exchange_endpoints, open_store, wait_for_key

__all__ = ["ZmqTransport", "SEGMENT_BYTES"]

log = logging.getLogger("collectives.zmq")

#: Large messages travel in segments of this many bytes.
SEGMENT_BYTES = 4 << 20
#: Below this size a payload is copied into one frame with its header.
COPY_BELOW = 64 << 10
#: A disconnected peer that has not said goodbye is declared lost after this long.
GRACE_SECONDS = 0.5
#: Longest single poll, so that other threads' progress and aborts are seen.
POLL_SLICE = 0.05
#: Seconds between looks at the connection monitors (peer loss, handshakes).
MONITOR_EVERY = 0.02
#: Seconds of yielding the CPU (each yield followed by a look at the socket) before a blocking poll.
SPIN_SECONDS = 0.0002

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))

HEADER = struct.Struct("<BqQQ")  # kind, tag, total bytes, offset
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum flags cost microseconds
KIND_DATA, KIND_ABORT, KIND_BYE = 1, 2, 3

_open_counts: collections.Counter = collections.Counter()
_open_lock = threading.Lock()


class _SendRequest(Request):
    """A zero-copy send: complete when libzmq has released every segment."""

    __slots__ = ("_transport", "_trackers", "_buf", "_peer")

    def __init__(self, transport: "ZmqTransport", trackers: list, buf: np.ndarray, peer: int) -> None:
        self._transport = transport
        self._trackers = trackers
        self._buf = buf  # kept alive until sent
        self._peer = peer

    def test(self) -> bool:
        self._trackers = [t for t in self._trackers if not t.done]
        if not self._trackers:
            self._buf = None
            return True
        self._transport._raise_if_broken()
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        deadline = time.monotonic() + (t.timeout if timeout is None else timeout)
        while not self.test():
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(f"rank {t.rank}: send to rank {self._peer} did not complete "
                                        f"within {timeout if timeout is not None else t.timeout:.3g}s")
            try:
                self._trackers[0].wait(min(left, POLL_SLICE))
            except zmq.NotDone:
                pass
            t._progress_nowait()


class _LaneRequest(Request):
    """A send over a TCP lane whose bytes are not all in the kernel yet."""

    __slots__ = ("_transport", "_pending", "_peer")

    def __init__(self, transport: "ZmqTransport", pending: LaneSend, peer: int) -> None:
        self._transport = transport
        self._pending = pending
        self._peer = peer

    def test(self) -> bool:
        if not self._pending.done:
            self._transport._progress_nowait()
        if self._pending.done:
            return True
        self._transport._raise_if_broken()
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        timeout = t.timeout if timeout is None else timeout
        t._drive_until(self.test, time.monotonic() + timeout,
                       lambda: f"rank {t.rank}: send to rank {self._peer} did not complete "
                               f"within {timeout:.3g}s")


class _RecvRequest(Request):
    """A receive, or an unexpected message waiting for its receive.

    Filled segment by segment; ``buf`` is None while the message is
    unexpected (its frames are kept in ``frames``). A reducing receive
    (``reduce`` set to ``(out, mine, op)``) reduces each segment straight
    from the received frame: ``out = mine (op) segment``.
    """

    __slots__ = ("_transport", "peer", "tag", "buf", "total", "received", "frames", "error", "started",
                 "reduce")

    def __init__(self, transport: "ZmqTransport", peer: int, tag: int, buf: np.ndarray | None,
                 reduce: tuple | None = None) -> None:
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

    @property
    def complete(self) -> bool:
        return self.started and self.received >= self.total

    def start(self, total: int) -> None:
        """The first segment of the message arrived, announcing ``total`` bytes."""
        self.started = True
        self.total = total
        self._check_size()

    def _check_size(self) -> None:
        if self.buf is not None and self.total != self.buf.nbytes and self.error is None:
            self.error = MismatchedCollective(
                f"rank {self._transport.rank}: expected {self.buf.nbytes} bytes from rank {self.peer} "
                f"(tag {self.tag}), got {self.total} (ranks disagree about the collective or its size)")

    def target(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Where a segment goes: a view of the user's buffer, or None (keep or reduce the frame)."""
        if self.buf is None or self.error is not None or self.reduce is not None:
            return None
        return self.buf[offset:offset + nbytes]

    def feed(self, offset: int, data: Any, nbytes: int, landed: bool) -> None:
        """Account for a segment; copy, reduce or keep ``data`` unless it already ``landed``."""
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

    def attach(self, buf: np.ndarray, reduce: tuple | None = None) -> None:
        """A receive was posted for this unexpected message: place what arrived."""
        self.buf = buf
        self.reduce = reduce
        self._check_size()
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
        self._transport._raise_if_broken(self.peer)
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        timeout = t.timeout if timeout is None else timeout
        t._drive_until(self.test, time.monotonic() + timeout,
                       lambda: f"rank {t.rank}: receive from rank {self.peer} (tag {self.tag}) "
                               f"timed out after {timeout:.3g}s")


class ZmqTransport(Transport):
    """Point-to-point over ZeroMQ/TCP with authenticated connections (see the module docstring)."""

    name = "zmq"
    capabilities = frozenset()
    released_on_delivery = True  # see Transport

    def __init__(self, rank: int, size: int, ctx: zmq.Context, timeout: float,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.segment_bytes = segment_bytes
        self._ctx = ctx
        self._zap: ZapHandler | None = None
        self._router: zmq.Socket | None = None
        self._dealers: dict[int, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, int] = {}
        self._next_monitor_check = 0.0
        self._router_poller = zmq.Poller()
        self._send_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._cv = threading.Condition()
        self._driving = False
        self._posted: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._current: dict[int, _RecvRequest] = {}
        self._connected: set[int] = set()
        self._said_bye: set[int] = set()
        self._lost_since: dict[int, float] = {}
        self._broken: PeerLost | None = None
        self._aborted = False
        self._closed = False
        self._lanes: Lanes | None = None
        self.endpoint = ""

    # -- opening -------------------------------------------------------------

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "ZmqTransport":
        """Rendezvous, bind, connect to every peer and authenticate.

        Raises:
            CollectiveTimeout: a peer did not show up in time.
            TransportUnavailable: the rendezvous port is taken.
            PeerLost: a peer refused this rank's credentials (different job secret).
        """
        credentials = JobCredentials(_secret(options, job), str(options.get("auth") or "plain"))
        t = cls(rank, size, zmq.Context(), timeout, int(options.get("zmq_segment_bytes") or SEGMENT_BYTES))
        try:
            t._open(job, options, credentials)
        except BaseException:
            t.close()
            raise
        return t

    def _open(self, job: str, options: dict[str, Any], credentials: JobCredentials) -> None:
        self._zap = ZapHandler(self._ctx, credentials, f"zap-rank{self.rank}")
        heartbeat = float(options.get("zmq_heartbeat_timeout") or 10.0)
        reuse = options.get("zmq_reuse_buffers", os.environ.get("COLLECTIVES_ZMQ_REUSE_BUFFERS", "1"))
        if str(reuse).lower() not in ("0", "false", "no", "off"):
            reuse_message_buffers(self.segment_bytes)
        self._router = self._socket(zmq.ROUTER, heartbeat)
        credentials.server(self._router)
        self._zap.watch(self._router, f"rank {self.rank}")
        addr = choose_address(options)
        self._router.bind(f"tcp://{_bracket(addr)}:0")
        self.endpoint = self._router.last_endpoint.decode()
        self._router_poller.register(self._router, zmq.POLLIN)
        if self.size == 1:
            return
        with _open_lock:
            _open_counts[job] += 1
            prefix = f"collectives/{job}/zmq/{_open_counts[job]}"
        store, close_store = open_store(self._ctx, self.rank, options, credentials, self._zap, self.timeout)
        try:
            endpoints = exchange_endpoints(store, prefix, self.rank, self.size, self.endpoint, self.timeout)
            self._connect_all(endpoints, credentials, heartbeat)
            if _lanes_wanted(options, credentials):
                self._open_lanes(store, prefix, addr, credentials, job)
            store.set(f"{prefix}/ready/{self.rank}", b"1")
            if self.rank == 0:  # the store must outlive every rank's reads
                for r in range(1, self.size):
                    wait_for_key(store, f"{prefix}/ready/{r}", self.timeout)
        finally:
            close_store()

    def _open_lanes(self, store: Any, prefix: str, addr: str, credentials: JobCredentials, job: str) -> None:
        """The direct TCP lanes that carry every message (see :mod:`.lanes`)."""
        self._lanes = Lanes.connect(
            self.rank, self.size, addr, credentials.lane_key(), job,
            lambda where: store.set(f"{prefix}/lane/{self.rank}", where.encode()),
            lambda peer, left: wait_for_key(store, f"{prefix}/lane/{peer}", left).decode(),
            self.timeout, self._lane_message, self._lane_ended, self._cv)
        for sock in self._lanes.sockets():
            self._router_poller.register(sock, zmq.POLLIN)
        # A lane is read as it arrives: what comes before its receive is copied
        # aside, so pipelined algorithms should post their receives early.
        self.receives_ahead = 1 << 10

    def _lane_message(self, peer: int, tag: int, total: int) -> _RecvRequest:
        """A message starts on ``peer``'s lane: the request it fills (called with the lock held)."""
        req = self._match(peer, tag)
        req.start(total)
        return req

    def _lane_ended(self, peer: int) -> None:
        """``peer``'s lane ended: lost, unless it said goodbye first."""
        if peer not in self._said_bye and not self._closed:
            self._lost_since.setdefault(peer, time.monotonic())

    def _socket(self, kind: int, heartbeat: float) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.linger = 1000
        s.sndhwm = 0
        s.rcvhwm = 0
        s.heartbeat_ivl = 1000
        s.heartbeat_timeout = int(heartbeat * 1000)
        s.heartbeat_ttl = int(heartbeat * 1000)
        s.tcp_keepalive = 1
        return s

    def _connect_all(self, endpoints: list[str], credentials: JobCredentials, heartbeat: float) -> None:
        events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        for peer, endpoint in enumerate(endpoints):
            if peer == self.rank:
                continue
            d = self._socket(zmq.DEALER, heartbeat)
            d.routing_id = b"%d" % self.rank
            credentials.client(d)
            mon_addr = f"inproc://collectives-mon-{id(self):x}-{peer}"
            d.monitor(mon_addr, events)
            mon = self._ctx.socket(zmq.PAIR)
            mon.linger = 0
            mon.connect(mon_addr)
            self._monitors[mon] = peer
            d.connect(endpoint)
            self._dealers[peer] = d
        deadline = time.monotonic() + self.timeout
        while len(self._connected) < self.size - 1:
            self._raise_if_broken()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self._dealers) - self._connected)
                raise CollectiveTimeout(f"rank {self.rank}: could not connect to ranks {missing} "
                                        f"within {self.timeout:.3g}s (endpoints {[endpoints[m] for m in missing]})")
            self._poll(min(left, POLL_SLICE))

    # -- sending -------------------------------------------------------------

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        self._check_peer(peer)
        data = _bytes_view(buf)
        if peer == self.rank:
            self._deliver_to_self(data, tag)
            return COMPLETED
        self._raise_if_broken()
        if self._lanes is not None:
            pending = self._lanes.send(peer, tag, memoryview(data), buf)
            return COMPLETED if pending is None else _LaneRequest(self, pending, peer)
        total = data.nbytes
        seg = self.segment_bytes
        trackers = []
        with self._send_lock:
            sock = self._dealers[peer]
            if total < COPY_BELOW:
                sock.send(HEADER.pack(KIND_DATA, tag, total, 0) + data.tobytes(), copy=True)
                return COMPLETED
            for offset in range(0, total, seg):
                n = min(seg, total - offset)
                sock.send(HEADER.pack(KIND_DATA, tag, total, offset), zmq.SNDMORE)
                trackers.append(sock.send(data[offset:offset + n], copy=False, track=True))
        return _SendRequest(self, trackers, buf, peer)

    def _deliver_to_self(self, data: np.ndarray, tag: int) -> None:
        with self._cv:
            req = self._match(self.rank, tag)
            req.start(data.nbytes)
            target = req.target(0, data.nbytes)
            if target is not None:
                target[...] = data
                req.feed(0, None, data.nbytes, True)
            else:
                req.feed(0, data.copy(), data.nbytes, req.buf is not None)
            self._cv.notify_all()

    # -- receiving -----------------------------------------------------------

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        return self._post_recv(_bytes_view(buf, writable=True), peer, tag, None)

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Receive and reduce each segment straight from its frame: no copy into ``tmp``."""
        if peer == self.rank or not out.size or self.segment_bytes % out.itemsize:
            return super().irecv_reduce(out, mine, peer, tag, op, tmp, sig)
        return self._post_recv(_bytes_view(out, writable=True), peer, tag, (out, mine, op))

    def _post_recv(self, data: np.ndarray, peer: int, tag: int, reduce: tuple | None) -> Request:
        self._check_peer(peer)
        with self._cv:
            queue = self._unexpected.get((peer, tag))
            if queue:
                req = queue.popleft()
                req.attach(data, reduce)
                return req
            req = _RecvRequest(self, peer, tag, data, reduce)
            self._posted[(peer, tag)].append(req)
            return req

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for r in requests:
            r.wait(max(deadline - time.monotonic(), 1e-6))

    def _match(self, peer: int, tag: int) -> _RecvRequest:
        """The receive a new message from (peer, tag) fills: a posted one or a new unexpected one."""
        posted = self._posted.get((peer, tag))
        if posted:
            req = posted.popleft()
            if not posted:
                del self._posted[(peer, tag)]
            return req
        req = _RecvRequest(self, peer, tag, None)
        self._unexpected[(peer, tag)].append(req)
        return req

    # -- progress ------------------------------------------------------------

    def _drive_until(self, done, deadline: float, what) -> None:
        """Make progress until ``done()`` is true; one thread at a time polls the sockets."""
        while True:
            with self._cv:
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(what())
                if self._driving:
                    self._cv.wait(min(left, POLL_SLICE))
                    continue
                self._driving = True
            try:
                self._poll(min(left, POLL_SLICE))
            finally:
                with self._cv:
                    self._driving = False
                    self._cv.notify_all()

    def _progress_nowait(self) -> None:
        with self._cv:
            if self._driving:
                return
            self._driving = True
        try:
            self._poll(0)
        finally:
            with self._cv:
                self._driving = False
                self._cv.notify_all()

    def _poll(self, timeout: float) -> None:
        """Handle what has arrived; if nothing has, wait up to ``timeout`` seconds for traffic.
        Connection events are looked at every MONITOR_EVERY seconds."""
        if self._closed:
            raise PeerLost(f"rank {self.rank}: transport is closed", self.rank)
        if self._lost_since:
            timeout = max(0.0, min(timeout, min(self._lost_since.values()) + GRACE_SECONDS - time.monotonic()))
        if not self._drain_all() and timeout > 0:
            spin_until = time.perf_counter() + min(timeout, SPIN_SECONDS)
            while time.perf_counter() < spin_until:  # the answer is often microseconds away
                _yield()
                if self._drain_all():
                    break
            else:
                self._poll_sockets(timeout)
        now = time.monotonic()
        if now >= self._next_monitor_check:
            self._next_monitor_check = now + MONITOR_EVERY
            for mon, peer in self._monitors.items():
                self._drain_monitor(mon, peer)
        if self._lost_since:
            self._drain_router()
            self._declare_lost()

    def _poll_sockets(self, timeout: float) -> None:
        """Block until something arrives (or a lane with queued sends can take
        more), at most ``timeout`` seconds; then handle it."""
        sending = self._lanes.sending() if self._lanes is not None else []
        poller = self._router_poller
        for sock in sending:
            poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        try:
            if poller.poll(max(1, int(timeout * 1000))):
                self._drain_all()
        finally:
            for sock in sending:
                poller.register(sock, zmq.POLLIN)

    def _drain_all(self) -> int:
        """What has arrived on the inbound socket and the lanes (queued lane
        sends pushed too); returns how much moved."""
        moved = self._drain_router()
        if self._lanes is not None:
            if self._lanes.progress():
                moved += 1
                with self._cv:
                    self._cv.notify_all()
        return moved

    def _drain_router(self) -> int:
        """Handle every message waiting on the inbound socket; return how many."""
        sock = self._router
        count = 0
        while sock.get(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
            count += 1
            header = sock.recv(copy=False)
            more = sock.rcvmore
            try:
                peer = int(ident)
            except ValueError:
                peer = -1
            if not 0 <= peer < self.size or len(header) < HEADER.size:
                log.warning("rank %d: dropped a malformed message (routing id %r)", self.rank, ident[:16])
                while more:
                    sock.recv(copy=False)
                    more = sock.rcvmore
                continue
            self._handle(sock, peer, header, more)
        return count

    def _handle(self, sock: zmq.Socket, peer: int, header: zmq.Frame, more: bool) -> None:
        kind, tag, total, offset = HEADER.unpack_from(header.buffer)
        if kind == KIND_ABORT:
            reason = bytes(header.buffer[HEADER.size:]).decode(errors="replace")
            self._fail(PeerLost(f"rank {peer} aborted: {reason}", peer))
            return
        if kind == KIND_BYE:
            with self._cv:
                self._said_bye.add(peer)
                self._lost_since.pop(peer, None)
                self._cv.notify_all()
            return
        with self._cv:
            req = self._current.get(peer) if offset else None
            if req is None:
                req = self._match(peer, tag)
                req.start(total)
            if req.tag != tag:
                self._fail(PeerLost(f"rank {self.rank}: garbled stream from rank {peer}", peer))
                return
            nbytes = min(self.segment_bytes, total - offset)
            if not more:  # header and payload in one frame
                req.feed(offset, header.buffer[HEADER.size:HEADER.size + nbytes], nbytes, False)
            else:
                target = req.target(offset, nbytes)
                if target is not None:
                    sock.recv_into(target)
                    req.feed(offset, None, nbytes, True)
                else:
                    req.feed(offset, sock.recv(copy=False).buffer, nbytes, False)
            if req.complete:
                self._current.pop(peer, None)
            else:
                self._current[peer] = req
            self._cv.notify_all()

    def _drain_monitor(self, mon: zmq.Socket, peer: int) -> None:
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            event, _ = struct.unpack("=hi", frames[0])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected.add(peer)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail(PeerLost(f"rank {self.rank}: rank {peer} refused this rank's credentials "
                                    "(do all ranks have the same job secret?)", peer))
            elif event == zmq.EVENT_DISCONNECTED and peer not in self._said_bye and not self._closed:
                self._lost_since.setdefault(peer, time.monotonic())

    def _declare_lost(self) -> None:
        now = time.monotonic()
        for peer, since in list(self._lost_since.items()):
            if peer in self._said_bye:
                del self._lost_since[peer]
            elif now - since >= GRACE_SECONDS:
                self._fail(PeerLost(f"rank {self.rank}: lost the connection to rank {peer} "
                                    "(process died or link cut)", peer))

    def _fail(self, error: PeerLost) -> None:
        with self._cv:
            if self._broken is None:
                self._broken = error
                log.info("%s", error)
            self._cv.notify_all()

    def _raise_if_broken(self, peer: int | None = None) -> None:
        if self._broken is not None:
            raise PeerLost(str(self._broken), self._broken.peer)
        if peer is not None and peer in self._said_bye and (self._lanes is None or not self._lanes.is_open(peer)):
            raise PeerLost(f"rank {self.rank}: rank {peer} closed its transport before sending "
                           "the awaited message", peer)
        if self._closed:
            raise PeerLost(f"rank {self.rank}: transport is closed", self.rank)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise BadArgument(f"peer {peer} is not a rank of this {self.size}-rank transport")

    # -- shutdown ------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every peer to raise PeerLost(reason); local waits raise it too."""
        if self._aborted or self._closed:
            return
        self._aborted = True
        self._fail(PeerLost(f"rank {self.rank} aborted: {reason}", self.rank))
        self._broadcast(HEADER.pack(KIND_ABORT, 0, 0, 0) + reason.encode("utf-8", "replace")[:2000])

    def _broadcast(self, frame: bytes) -> None:
        acquired = self._send_lock.acquire(timeout=1.0)
        try:
            for sock in self._dealers.values():
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        finally:
            if acquired:
                self._send_lock.release()

    def close(self) -> None:
        """Say goodbye to the peers, close every socket and stop the threads (idempotent)."""
        with self._close_lock:
            if self._closed:
                return
            if self._broken is None:
                self._broadcast(HEADER.pack(KIND_BYE, 0, 0, 0))
            self._closed = True
            linger = 0 if self._broken is not None else 1000
            if self._lanes is not None:
                self._lanes.close(time.monotonic() + linger / 1000)
            for sock in [*self._dealers.values(), *self._monitors, self._router]:
                if sock is not None:
                    try:
                        sock.close(linger)
                    except zmq.ZMQError:
                        pass
            if self._zap is not None and not self._zap.close():
                log.warning("rank %d: the authentication thread did not stop; leaving its context", self.rank)
                return
            self._ctx.term()  # waits at most the sockets' linger


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_reused_up_to = 0


def reuse_message_buffers(largest: int) -> bool:
    """Let glibc serve libzmq's receive buffers of up to ``largest`` bytes from
    its heaps, reused message after message, instead of a fresh ``mmap`` each,
    whose pages the kernel zeroes on first touch: on loopback that zeroing was
    a tenth of a 64 MiB allreduce's CPU time. Process-wide (freed memory up
    to 4 x ``largest`` stays with the process, as MPI libraries arrange too);
    done once per size. Returns False where the C library is not glibc.
    """
    global _reused_up_to
    if largest <= _reused_up_to:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    threshold = min(largest + (1 << 20), 32 << 20)  # glibc refuses more than 32 MiB
    if not (mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, 4 * threshold)):
        return False
    _reused_up_to = largest
    return True


def _lanes_wanted(options: dict[str, Any], credentials: JobCredentials) -> bool:
    """Direct TCP lanes carry the data unless turned off (``zmq_lanes`` or
    ``COLLECTIVES_ZMQ_LANES`` false) or the job asked for encryption (CURVE:
    the lanes authenticate but do not encrypt, so ZeroMQ carries the data)."""
    wanted = options.get("zmq_lanes", os.environ.get("COLLECTIVES_ZMQ_LANES", "1"))
    return credentials.mechanism != "curve" and str(wanted).lower() not in ("0", "false", "no", "off")


def _secret(options: dict[str, Any], job: str) -> str:
    secret = options.get("secret")
    if secret:
        return str(secret)
    warnings.warn("no job secret (COLLECTIVES_SECRET or secret=...): deriving one from the job id, "
                  "which anyone who knows the job id can reproduce", RuntimeWarning, stacklevel=3)
    return hashlib.sha256(f"collectives-job:{job}".encode()).hexdigest()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bytes_view(buf: np.ndarray, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of the C-contiguous array ``buf``."""
    if not buf.flags.c_contiguous:
        raise BadArgument("zmq transport needs C-contiguous buffers")
    if writable and not buf.flags.writeable:
        raise BadArgument("receive buffer is read-only")
    return buf.reshape(-1).view(np.uint8) if buf.size else np.empty(0, np.uint8)
