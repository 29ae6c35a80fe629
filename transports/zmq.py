"""ZeroMQ over TCP: the transport for many machines.

Sockets: each rank binds one ROUTER (inbound) and connects one DEALER to
every peer's ROUTER (outbound), so each ordered pair of ranks has its own
TCP connection and messages between them keep their order. Every socket
authenticates with the job's credentials during the ZeroMQ handshake (see
:mod:`collectives.transports.rendezvous`); a stranger is refused by libzmq
before any of its bytes reach the application, and logged. At the
rendezvous every rank also publishes its host name and process id, so that
errors name a peer as ``rank 2 (host h, pid 123)``, never by address alone.

Data: unless the job asked for encryption (CURVE) or turned them off
(``zmq_lanes`` / ``COLLECTIVES_ZMQ_LANES=0``), every message travels on a
direct TCP lane per pair of ranks (:mod:`collectives.transports.lanes`),
authenticated with the job's secret and driven by the waiting thread, with
no I/O thread in between: on loopback here an 8-byte exchange takes a
tenth, and 16 MiB half, of the time the same takes over ZeroMQ sockets.
ZeroMQ keeps the rendezvous, the abort and goodbye messages, the status
queries and the heartbeats. Otherwise the data goes over ZeroMQ as follows.

Messages: a message is cut into segments of ``zmq_segment_bytes`` (4 MiB by
default). Each segment is one ZeroMQ message ``[header, payload]`` where the
header is ``(kind, tag, total bytes, offset, signature)``; the segments of
one message are queued together, so they reach the peer back to back. Small
messages travel as one frame (header and payload copied together); large
ones are sent zero-copy (``copy=False``) and their send request completes
when libzmq has released the memory. Receives are matched by (peer, tag),
first come first served per (peer, tag); a segment whose receive is posted
lands straight in the user's buffer (``recv_into``), one that arrives early
is kept (zero-copy frame) in an unexpected-message queue.

Signatures: every message (lane or ZeroMQ, and one a rank sends itself)
carries its call's signature, compared with the receive's by
:func:`~collectives.signature.check_message` when the two meet (on arrival
for a posted receive, when posted for an early message). A receive that
fails the check gets the error; the message's bytes are still read off the
stream and dropped, never written into the buffer, so the stream stays in
step. A collective message (odd tag) from a peer for another call than the
one a posted receive from that peer waits for fails that receive
(:func:`~collectives.signature.out_of_step`); so does posting a collective
receive while only another call's message from that peer waits.

Progress: there is no data thread. Whichever thread waits drives the
inbound socket (one at a time; the others sleep on a condition), so a
single-threaded rank pays no thread hand-off. libzmq's own I/O thread
sends, keeps heartbeats and notices dead connections.

Failures, and how they are named:

* A peer whose process dies: its lane ends without a goodbye (end of file
  or reset), which is :class:`PeerLost` at once: ``rank 2 (host h, pid p)
  died or closed its connection``. Without lanes, its ZeroMQ connection
  drops and reconnecting is refused; it is declared after a grace period
  (``GRACE_SECONDS``) that lets a goodbye arrive first.
* A cut link (or a host that is down): no reset, the heartbeats stop, and
  ZeroMQ drops the connection after ``zmq_heartbeat_timeout`` (default
  10 s) while the lane stays open: ``no traffic from rank 2 (host h at
  10.0.0.3) for 10 s: the link is cut or the host is down``.
* A hung peer, or one that never arrives: the collective's own deadline
  fires first (heartbeats may still be flowing). The rank whose wait timed
  out asks every peer where it is (a status query over ZeroMQ, answered by
  whichever thread of the peer drives its progress: the call's sequence
  number and signature, which peer it waits for, whether it is diagnosing
  a timeout too) and waits ``QUERY_SECONDS`` for the answers. A peer that
  does not answer (stopped, hung, busy outside the library) has not
  arrived; if every peer answers, those in an earlier call have not; if
  all are in this call, their signatures are compared (ranks that only
  wait, such as roots that disagree, exchange no message that would show
  it). The verdict names them and says where each rank is; it is raised as
  :class:`CollectiveTimeout` (:class:`MismatchedCollective` for differing
  signatures) and sent to every peer as this rank's abort, so that every
  survivor raises the same verdict. When several ranks time out together,
  the lowest diagnosing rank decides: a rank that learns of a lower one
  diagnosing (from its answer or its own query) waits ``DEFER_SECONDS``
  for that rank's abort first. So a rank waiting for a live rank that
  waits for the hung one never blames the live rank.
* :meth:`ZmqTransport.abort` sends its text, with the first call this rank
  did not complete, over ZeroMQ and in-band on every lane; peers raise
  :func:`~collectives.errors.from_abort` (the aborting rank's kind of
  error) at once, but for operations of earlier calls, which may finish.
  Every later operation of an aborted or broken transport raises its first
  error again. A rank that a peer aborted does not pass the abort on,
  but for one copy to each peer as it closes (naming the aborting rank),
  so that no peer takes the end of its connections for a death.
* A call starts (:meth:`ZmqTransport.begin_call`) by looking for messages
  of earlier calls that no receive took (two ranks that both only sent in
  a call they disagreed on): a mismatch. A wait on several requests ends
  as soon as one of them fails.

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
import socket
import struct
import threading
import time
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import zmq

from collectives.errors import (BadArgument, CollectiveError, CollectiveTimeout, MismatchedCollective, PeerLost,
                                abort_reason, from_abort)
from collectives.signature import (NO_SIG, REFUSED, SEQ_MASK, Sig, check_all, check_message, describe, fields,
                                   out_of_step)
from collectives.transport import COMPLETED, Request, Transport

from .lanes import Lanes, LaneSend
from .rendezvous import (JobCredentials, PeerInfo, ZapHandler, choose_address, exchange_peers, open_store,
                         wait_for_key)

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
#: Seconds a rank whose collective timed out waits for its peers' status
#: (a live peer answers in milliseconds; this leaves room for a busy host).
QUERY_SECONDS = 0.4
#: Seconds it then waits for the verdict of a lower rank diagnosing the same hang.
DEFER_SECONDS = 0.5
#: Linger (seconds) of a broken transport's sockets when it closes: its abort must get out.
ABORT_LINGER = 0.3
#: Longest abort text sent.
ABORT_TEXT_BYTES = 2000

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))

HEADER = struct.Struct("<BqQQQQQ")  # kind, tag, total bytes, offset, signature (three words)
#: A status reply's body: query id, call seq (-1: none), signature, peer waited for (-1: none),
#: flags, seconds in the call.
STATUS = struct.Struct("<qqQQQqBd")
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum flags cost microseconds
KIND_DATA, KIND_ABORT, KIND_BYE, KIND_QUERY, KIND_STATUS = 1, 2, 3, 4, 5
_DIAGNOSING = 1  # status flag: this rank's collective timed out and it is asking its peers

_open_counts: collections.Counter = collections.Counter()
_open_lock = threading.Lock()


class _Status(NamedTuple):
    """A peer's answer to a status query."""

    seq: int  # its current call's sequence number (-1: none yet)
    sig: Sig
    waiting: int  # the peer it waits for (-1: none)
    diagnosing: bool  # its own collective timed out
    seconds: float  # how long it has been in that call


class _SendRequest(Request):
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


class _LaneRequest(Request):
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


class _RecvRequest(Request):
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
        self._transport._raise_if_broken(self.peer, self.tag)
        return False

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        if timeout is None:
            timeout = t.timeout
        start = time.monotonic()
        if not t._drive_until(self.test, start + timeout, self.peer):
            raise t._timed_out(self.peer, self.tag, self.action, start, timeout)


_OWN_REQUESTS = (_RecvRequest, _LaneRequest, _SendRequest)


def _copy_error(err: CollectiveError) -> CollectiveError:
    """A fresh error of ``err``'s kind and message (raised again and again)."""
    new = PeerLost(str(err), err.peer) if isinstance(err, PeerLost) else type(err)(str(err))
    new.origin = err.origin
    return new


def _older(seq: int, than: int) -> bool:
    """Whether call ``seq`` comes before call ``than`` (sequence numbers wrap; -1: no call)."""
    return seq < 0 or 0 < ((than - seq) & SEQ_MASK) <= SEQ_MASK >> 1


def _call_name(seq: int, sig: Sig) -> str:
    """``allreduce #12`` (``call #12`` without a signature)."""
    if seq < 0:
        return "no collective yet"
    if sig != NO_SIG:
        return f"{fields(sig, {})['collective']} #{seq}"
    return f"call #{seq}"


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
        self._posted: dict[tuple[int, int], collections.deque] = {}
        self._unexpected: dict[tuple[int, int], collections.deque] = {}
        self._current: dict[int, _RecvRequest] = {}
        self._connected: set[int] = set()
        self._said_bye: set[int] = set()
        self._lost_since: dict[int, float] = {}
        self._retries: dict[int, int] = {}  # reconnections refused since a peer's connection dropped
        self._aborts: collections.deque[tuple[int, str, int]] = collections.deque()  # received, not yet taken
        self._aborted_by: set[int] = set()
        self._stale: list[Any] = []  # ended lanes' sockets, to take out of the poller
        self._broken: CollectiveError | None = None
        self._broken_first = -1  # the error spares collective calls before this one (-1: spares none)
        self._adopted: tuple[int, str, int] | None = None  # a peer's abort that broke this rank
        self._aborted = False
        self._closed = False
        self._lanes: Lanes | None = None
        self._peers: list[PeerInfo] = []
        self._heartbeat = 10.0
        self.endpoint = ""
        # What this rank is doing, for the peers' status queries (see the module docstring).
        self._call_tag = -1
        self._call_seq = -1
        self._call_sig: Sig = NO_SIG
        self._call_since = 0.0
        self._waiting = -1
        self._diagnosing = False
        self._queried_by: set[int] = set()
        self._replies: dict[int, dict[int, _Status]] = {}
        self._next_query = 0

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
        self._heartbeat = heartbeat = float(options.get("zmq_heartbeat_timeout") or 10.0)
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
        self._peers = [PeerInfo(self.rank, self.endpoint, socket.gethostname(), os.getpid())]
        if self.size == 1:
            return
        with _open_lock:
            _open_counts[job] += 1
            prefix = f"collectives/{job}/zmq/{_open_counts[job]}"
        store, close_store = open_store(self._ctx, self.rank, options, credentials, self._zap, self.timeout)
        try:
            self._peers = exchange_peers(store, prefix, self.rank, self.size, self.endpoint, self.timeout)
            self._connect_all([p.endpoint for p in self._peers], credentials, heartbeat)
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
            self.timeout, self._arrive, self._lane_ended, self._cv, self._lane_aborted, self._name)
        for sock in self._lanes.sockets():
            self._router_poller.register(sock, zmq.POLLIN)
        # A lane is read as it arrives: what comes before its receive is copied
        # aside, so pipelined algorithms should post their receives early.
        self.receives_ahead = 1 << 10

    def _lane_ended(self, peer: int, said_bye: bool) -> None:
        """``peer``'s lane ended: a goodbye, an abort already on its way, or a lost peer (at once)."""
        self._stale.append(self._lanes.socket_of(peer))
        if said_bye or peer in self._said_bye:
            with self._cv:
                self._said_bye.add(peer)
                self._lost_since.pop(peer, None)
                self._cv.notify_all()
        elif not self._closed and peer not in self._aborted_by:
            self._fail(self._died(peer))

    def _lane_aborted(self, peer: int, text: str, first: int, origin: int) -> None:
        """An abort arrived in-band on ``peer``'s lane (``peer``'s own, or
        ``origin``'s relayed by ``peer`` as it closed)."""
        self._aborted_by.add(peer)
        self._aborts.append((peer if origin < 0 else origin, text, first))

    def _name(self, peer: int) -> str:
        """``rank 2 (host h, pid 123)`` (as much as is known)."""
        if 0 <= peer < len(self._peers):
            return self._peers[peer].name()
        return f"rank {peer}"

    def _died(self, peer: int) -> PeerLost:
        return PeerLost(f"rank {self.rank}: {self._name(peer)} died or closed its connection", peer)

    def _unreachable(self, peer: int) -> PeerLost:
        where = self._peers[peer].name(pid=False) if peer < len(self._peers) else f"rank {peer}"
        return PeerLost(f"rank {self.rank}: no traffic from {where} for {self._heartbeat:g} s: the link is cut "
                        "or the host is down (or the process is stopped)", peer)

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
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_CONNECT_RETRIED)
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
                raise CollectiveTimeout(
                    f"rank {self.rank}: could not connect to "
                    + ", ".join(f"{self._name(m)} at {endpoints[m]}" for m in missing)
                    + f" within {self.timeout:.3g}s")
            self._poll(min(left, POLL_SLICE))

    # -- what this rank is doing ----------------------------------------------

    def begin_call(self, seq: int, sig: Sig, refusal: str | None = None) -> None:
        """Remember the collective call this rank is in (for the peers' status
        queries), after looking for messages of earlier calls no receive took.
        (A refusal travels in ``sig``; its reason is the communicator's to tell.)

        Raises:
            MismatchedCollective: a peer sent a message of an earlier call
                that this rank never received (they made different calls).
        """
        self._call_tag = 2 * seq + 1
        self._call_seq = seq
        self._call_sig = sig
        self._call_since = time.monotonic()
        if self._unexpected:
            self._check_leftovers(seq)

    def _check_leftovers(self, seq: int) -> None:
        """Raise when an early message of a call before ``seq`` is still waiting
        for its receive (messages of this or later calls, a peer ahead, and
        point-to-point ones are left alone)."""
        with self._cv:
            for (peer, tag), queue in self._unexpected.items():
                if tag & 1 and queue and _older(tag >> 1, seq):
                    theirs = queue[0].theirs
                    what = describe(theirs) if theirs != NO_SIG else f"call #{tag >> 1}"
                    raise MismatchedCollective(
                        f"rank {self.rank}: {self._name(peer)} sent a message of {what} that no receive of "
                        "this rank took: the two ranks made different calls then")

    def _enter(self, tag: int, sig: Sig) -> None:
        """A collective message of a call :meth:`begin_call` did not announce: that call has begun."""
        self._call_tag = tag
        self._call_seq = tag >> 1
        self._call_sig = sig
        self._call_since = time.monotonic()

    # -- sending -------------------------------------------------------------

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        if tag & 1 and tag != self._call_tag:
            self._enter(tag, sig)
        self._check_peer(peer)
        data = _bytes_view(buf)
        if self._broken is not None or self._closed:
            self._raise_if_broken(None, tag)
        if peer == self.rank:
            self._deliver_to_self(data, tag, sig)
            return COMPLETED
        if self._lanes is not None:
            try:
                pending = self._lanes.send(peer, tag, memoryview(data), buf, sig)
            except PeerLost:
                self._lost_send(peer, tag)
            return COMPLETED if pending is None else _LaneRequest(self, pending, peer, tag)
        total = data.nbytes
        seg = self.segment_bytes
        trackers = []
        with self._send_lock:
            sock = self._dealers[peer]
            if total < COPY_BELOW:
                sock.send(HEADER.pack(KIND_DATA, tag, total, 0, *sig) + data.tobytes(), copy=True)
                return COMPLETED
            for offset in range(0, total, seg):
                n = min(seg, total - offset)
                sock.send(HEADER.pack(KIND_DATA, tag, total, offset, *sig), zmq.SNDMORE)
                trackers.append(sock.send(data[offset:offset + n], copy=False, track=True))
        return _SendRequest(self, trackers, buf, peer, tag)

    def _deliver_to_self(self, data: np.ndarray, tag: int, sig: Sig) -> None:
        with self._cv:
            req = self._arrive(self.rank, tag, data.nbytes, sig)
            target = req.target(0, data.nbytes)
            if target is not None:
                target[...] = data
                req.feed(0, None, data.nbytes, True)
            elif req.buf is None:  # early: keep a copy
                req.feed(0, data.copy(), data.nbytes, False)
            else:  # the receive failed its check: drop the bytes
                req.feed(0, None, data.nbytes, True)
            self._cv.notify_all()

    # -- receiving -----------------------------------------------------------

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        if tag & 1 and tag != self._call_tag:
            self._enter(tag, sig)
        return self._post_recv(_bytes_view(buf, writable=True), peer, tag, None, sig)

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Receive and reduce each segment straight from its frame: no copy into ``tmp``."""
        if peer == self.rank or not out.size or self.segment_bytes % out.itemsize:
            return super().irecv_reduce(out, mine, peer, tag, op, tmp, sig)
        if tag & 1 and tag != self._call_tag:
            self._enter(tag, sig)
        return self._post_recv(_bytes_view(out, writable=True), peer, tag, (out, mine, op), sig)

    def _post_recv(self, data: np.ndarray, peer: int, tag: int, reduce: tuple | None, sig: Sig) -> Request:
        self._check_peer(peer)
        if self._broken is not None and self._blocks(tag):
            raise _copy_error(self._broken)
        key = (peer, tag)
        with self._cv:
            queue = self._unexpected.get(key)
            if queue:
                req = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                req.attach(data, reduce, sig)
                return req
            req = _RecvRequest(self, peer, tag, data, reduce, sig)
            if tag & 1 and self._unexpected:
                stray = self._stray(peer, tag)
                if stray is not None:  # the peer has moved on to another call
                    req.error = out_of_step(self.rank, peer, tag, stray.tag, stray.theirs)
                    return req
            posted = self._posted.get(key)
            if posted is None:
                self._posted[key] = posted = collections.deque()
            posted.append(req)
            return req

    def _stray(self, peer: int, tag: int) -> _RecvRequest | None:
        """An early collective message from ``peer`` of another call than ``tag``'s."""
        for (p, t), queue in self._unexpected.items():
            if p == peer and t & 1 and t != tag and queue:
                return queue[0]
        return None

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request; the first that fails ends the wait with its error."""
        timeout = self.timeout if timeout is None else timeout
        pending = [r for r in requests if r is not COMPLETED]
        if len(pending) <= 1:
            if pending:
                pending[0].wait(timeout)
            return
        start = time.monotonic()
        if not all(isinstance(r, _OWN_REQUESTS) for r in pending):  # e.g. a reduction of a rank's own message
            for r in pending:
                r.wait(max(start + timeout - time.monotonic(), 1e-6))
            return

        def done() -> bool:
            pending[:] = [r for r in pending if not r.test()]  # every one tested: a failure raises at once
            return not pending

        if not self._drive_until(done, start + timeout, pending[0].peer):
            r = pending[0]
            raise self._timed_out(r.peer, r.tag, r.action, start, timeout)

    def _arrive(self, peer: int, tag: int, total: int, theirs: Sig) -> _RecvRequest:
        """A message from (peer, tag) starts: the posted receive it fills (checked) or a new
        unexpected message; a posted collective receive from ``peer`` of another call
        fails out of step. Called with the lock held."""
        key = (peer, tag)
        posted = self._posted.get(key)
        if posted:
            req = posted.popleft()
            if not posted:
                del self._posted[key]
        else:
            req = _RecvRequest(self, peer, tag, None)
            queue = self._unexpected.get(key)
            if queue is None:
                self._unexpected[key] = queue = collections.deque()
            queue.append(req)
            if tag & 1 and self._posted:
                self._fail_out_of_step(peer, tag, theirs)
        req.start(total, theirs)
        return req

    def _fail_out_of_step(self, peer: int, tag: int, theirs: Sig) -> None:
        """``peer`` sent a message of the call of ``tag``: posted collective receives
        from it for other calls will never be filled."""
        stale = [k for k in self._posted if k[0] == peer and k[1] & 1 and k[1] != tag]
        for key in stale:
            for req in self._posted.pop(key):
                req.error = out_of_step(self.rank, peer, key[1], tag, theirs)
        if stale:
            self._cv.notify_all()

    # -- progress ------------------------------------------------------------

    def _wait_for(self, done: Callable[[], bool], peer: int, tag: int, action: str,
                  timeout: float | None) -> None:
        """Drive progress until ``done()``; past ``timeout`` raise the timeout's verdict."""
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        if not self._drive_until(done, start + timeout, peer):
            raise self._timed_out(peer, tag, action, start, timeout)

    def _drive_until(self, done: Callable[[], bool], deadline: float, peer: int = -1) -> bool:
        """Make progress until ``done()`` is true (True) or ``deadline`` passes
        (False); one thread at a time polls the sockets. ``peer``: the rank
        waited for (what a status query hears)."""
        self._waiting = peer
        try:
            while True:
                with self._cv:
                    if done():
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
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
        finally:
            self._waiting = -1

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
        if self._aborts and not self._unexplained_losses():
            self._take_aborts()

    def _poll_sockets(self, timeout: float) -> None:
        """Block until something arrives (or a lane with queued sends can take
        more), at most ``timeout`` seconds; then handle it."""
        poller = self._router_poller
        if self._stale:
            self._forget_stale()
        sending = self._lanes.sending() if self._lanes is not None else []
        for sock in sending:
            poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        try:
            if poller.poll(max(1, int(timeout * 1000))):
                self._drain_all()
        finally:
            for sock in sending:
                poller.register(sock, zmq.POLLIN)

    def _forget_stale(self) -> None:
        """Take ended lanes' sockets out of the poller."""
        while self._stale:
            sock = self._stale.pop()
            try:
                self._router_poller.unregister(sock)
            except KeyError:
                pass

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
                self._skip(sock, more)
                continue
            self._handle(sock, peer, header, more)
        return count

    @staticmethod
    def _skip(sock: zmq.Socket, more: bool) -> None:
        """Drop the rest of a multipart message."""
        while more:
            sock.recv(copy=False)
            more = sock.rcvmore

    def _handle(self, sock: zmq.Socket, peer: int, header: zmq.Frame, more: bool) -> None:
        kind, tag, total, offset, w0, w1, w2 = HEADER.unpack_from(header.buffer)
        if kind != KIND_DATA:
            self._skip(sock, more)
            self._control(peer, kind, tag, total, header)
            return
        with self._cv:
            req = self._current.get(peer) if offset else None
            if req is None:
                req = self._arrive(peer, tag, total, (w0, w1, w2))
            if req.tag != tag:
                self._fail(PeerLost(f"rank {self.rank}: garbled stream from {self._name(peer)}", peer))
                self._skip(sock, more)
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

    def _control(self, peer: int, kind: int, tag: int, total: int, header: zmq.Frame) -> None:
        """A message of the transport's own: abort, goodbye, status query or reply."""
        if kind == KIND_ABORT:  # tag: the first call not completed; total: 1 + the rank a relay names
            self._aborted_by.add(peer)
            text = bytes(header.buffer[HEADER.size:]).decode(errors="replace")
            self._aborts.append((peer if total == 0 else total - 1, text, tag))
        elif kind == KIND_BYE:
            with self._cv:
                self._said_bye.add(peer)
                self._lost_since.pop(peer, None)
                self._cv.notify_all()
        elif kind == KIND_QUERY:
            self._answer(peer, tag)
        elif kind == KIND_STATUS:
            self._note_status(peer, header.buffer[HEADER.size:])
        else:
            log.warning("rank %d: dropped a message of unknown kind %d from rank %d", self.rank, kind, peer)

    def _unexplained_losses(self) -> bool:
        """Whether a peer's connection dropped without a goodbye or an abort
        (within the grace period: this rank's own verdict on it comes first)."""
        return any(p not in self._said_bye and p not in self._aborted_by for p in self._lost_since)

    def _take_aborts(self) -> None:
        """Adopt the first abort received, unless this rank has failed already
        (its own observation, e.g. the dead peer, comes first)."""
        while self._aborts:
            peer, text, first = self._aborts.popleft()
            if self._broken is None:
                self._adopted = (peer, text, first)
                self._fail(from_abort(text, peer, self.rank), first)

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
                self._fail(PeerLost(f"rank {self.rank}: {self._name(peer)} refused this rank's credentials "
                                    "(do all ranks have the same job secret?)", peer))
            elif event == zmq.EVENT_DISCONNECTED and peer not in self._said_bye and not self._closed:
                self._lost_since.setdefault(peer, time.monotonic())
                self._retries[peer] = 0
            elif event == zmq.EVENT_CONNECT_RETRIED and peer in self._lost_since:
                self._retries[peer] = self._retries.get(peer, 0) + 1

    def _declare_lost(self) -> None:
        """Peers whose ZeroMQ connection dropped a grace period ago without a
        goodbye: a dead process (its lane ended, or its host refuses to
        reconnect) or an unreachable one (the lane is still open: no reset
        came, the heartbeats stopped)."""
        now = time.monotonic()
        for peer, since in list(self._lost_since.items()):
            if peer in self._said_bye or peer in self._aborted_by:  # closed after a goodbye or an abort
                del self._lost_since[peer]
            elif now - since >= GRACE_SECONDS:
                if self._lanes is not None:
                    refused = not self._lanes.is_open(peer)
                else:
                    refused = self._retries.get(peer, 0) >= 2  # the first retry is only scheduled
                self._fail(self._died(peer) if refused else self._unreachable(peer))
                del self._lost_since[peer]

    def _fail(self, error: CollectiveError, first: int = -1) -> None:
        """Break the transport with ``error`` (the first one stays); an
        abort's ``first`` spares the operations of earlier collective calls."""
        with self._cv:
            if self._broken is None:
                self._broken = error
                self._broken_first = first
                log.info("%s", error)
            self._cv.notify_all()

    def _blocks(self, tag: int | None) -> bool:
        """Whether the error that broke the transport fails an operation with
        ``tag`` (None: any operation): all do, but for those of collective
        calls before the first call an aborting rank did not complete."""
        first = self._broken_first
        return first < 0 or tag is None or not tag & 1 or not _older(tag >> 1, first)

    def _raise_if_broken(self, peer: int | None = None, tag: int | None = None) -> None:
        """Raise the error that broke the transport (when it applies to an
        operation with ``tag`` on ``peer``: see :meth:`_blocks`; a call it
        spares still fails once ``peer`` is gone), or that ``peer`` has
        closed, or that this transport has."""
        if self._broken is not None and (self._blocks(tag) or (peer is not None and self._gone(peer))):
            raise _copy_error(self._broken)
        if peer is not None and peer in self._said_bye and (self._lanes is None or not self._lanes.is_open(peer)):
            raise PeerLost(f"rank {self.rank}: {self._name(peer)} closed its transport while rank {self.rank} "
                           "still waited on it", peer)
        if self._closed:
            raise PeerLost(f"rank {self.rank}: transport is closed", self.rank)

    def _lost_send(self, peer: int, tag: int) -> None:
        """A send to ``peer`` failed: its lane takes no more. What the peer
        sent before it went (an abort, a goodbye) and how the lane's read
        side ends (at once: the connection is gone) name the error."""
        self._drive_until(lambda: self._broken is not None or self._settled(peer),
                          time.monotonic() + GRACE_SECONDS, peer)
        self._check_lost_send(peer, tag)
        raise PeerLost(f"rank {self.rank}: a send to {self._name(peer)} failed", peer)

    def _settled(self, peer: int) -> bool:
        """Whether ``peer``'s lane has ended and what came on it was taken."""
        return not self._lanes.is_open(peer) and not self._aborts

    def _check_lost_send(self, peer: int, tag: int) -> None:
        """Raise the error of a send whose lane failed, once it is known
        (returns while the lane's read side has not told yet)."""
        self._raise_if_broken(peer, tag)
        if self._settled(peer):
            raise PeerLost(f"rank {self.rank}: the connection to {self._name(peer)} ended before a message "
                           "to it was sent", peer)

    def _gone(self, peer: int) -> bool:
        """Whether ``peer``'s connection has ended (or dropped, without lanes)."""
        if self._lanes is not None:
            return not self._lanes.is_open(peer)
        return peer in self._lost_since or peer in self._aborted_by

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise BadArgument(f"peer {peer} is not a rank of this {self.size}-rank transport")

    # -- timeouts: where is everyone? -------------------------------------------

    def _timed_out(self, peer: int, tag: int, action: str, start: float, timeout: float) -> CollectiveError:
        """The error of a wait that ran out: for a collective, the verdict of
        :meth:`_diagnose` (every peer raises it too)."""
        if self._broken is not None:
            return _copy_error(self._broken)
        if not tag & 1 or self.size == 1:
            return CollectiveTimeout(f"rank {self.rank}: {action} {self._name(peer)} (tag {tag}) did not "
                                     f"complete within {timeout:.3g} s (the timeout)")
        since = self._call_since if tag == self._call_tag else start
        return self._diagnose(peer, tag, action, since, start + timeout)

    def _diagnose(self, peer: int, tag: int, action: str, since: float, deadline: float) -> CollectiveError:
        """Ask every peer where it is, decide who has not arrived, abort with
        that verdict and return it (or the verdict or error that reached this
        rank meanwhile)."""
        self._diagnosing = True
        try:
            replies = self._query_peers(peer)
            if self._broken is None:
                self._defer_to_lower(replies, peer)
            if self._broken is not None:
                return _copy_error(self._broken)
            error = self._verdict(peer, tag, action, since, deadline, replies)
        finally:
            self._diagnosing = False
        self.abort(abort_reason(error), tag >> 1)
        return error

    def _query_peers(self, peer: int) -> dict[int, _Status]:
        """Every peer's status that comes within QUERY_SECONDS."""
        with self._cv:
            self._next_query += 1
            qid = self._next_query
            replies = self._replies[qid] = {}
        self._broadcast(HEADER.pack(KIND_QUERY, qid, 0, 0, 0, 0, 0))
        want = self.size - 1
        self._drive_until(lambda: len(replies) >= want or self._broken is not None,
                          time.monotonic() + QUERY_SECONDS, peer)
        with self._cv:
            return dict(self._replies.pop(qid))

    def _defer_to_lower(self, replies: dict[int, _Status], peer: int) -> None:
        """When a lower rank is diagnosing too, wait (a while) for its verdict."""
        diagnosing = {p for p, st in replies.items() if st.diagnosing} | self._queried_by
        if any(p < self.rank for p in diagnosing):
            self._drive_until(lambda: self._broken is not None, time.monotonic() + DEFER_SECONDS, peer)

    def _answer(self, peer: int, qid: int) -> None:
        """Answer ``peer``'s status query: this rank's call, whom it waits for."""
        self._queried_by.add(peer)
        body = STATUS.pack(qid, self._call_seq, *self._call_sig, self._waiting,
                           _DIAGNOSING if self._diagnosing else 0,
                           time.monotonic() - self._call_since if self._call_seq >= 0 else 0.0)
        frame = HEADER.pack(KIND_STATUS, qid, 0, 0, 0, 0, 0) + body
        acquired = self._send_lock.acquire(timeout=1.0)
        try:
            self._dealers[peer].send(frame, zmq.NOBLOCK)
        except (zmq.ZMQError, KeyError):
            pass
        finally:
            if acquired:
                self._send_lock.release()

    def _note_status(self, peer: int, body: Any) -> None:
        if len(body) < STATUS.size:
            return
        qid, seq, w0, w1, w2, waiting, flags, seconds = STATUS.unpack_from(body)
        with self._cv:
            replies = self._replies.get(qid)
            if replies is not None:
                replies[peer] = _Status(seq, (w0, w1, w2), waiting, bool(flags & _DIAGNOSING), seconds)
                self._cv.notify_all()

    def _verdict(self, peer: int, tag: int, action: str, since: float, deadline: float,
                 replies: dict[int, _Status]) -> CollectiveError:
        """Who has not arrived at the call of ``tag``, and where each rank is:
        a CollectiveTimeout, or, when every rank is in this call but their
        signatures differ (ranks that only wait, such as roots that disagree),
        the mismatch."""
        seq = tag >> 1
        sig = self._call_sig if tag == self._call_tag else NO_SIG
        call = describe(sig) if sig != NO_SIG else f"call #{seq}"
        elapsed, limit = time.monotonic() - since, deadline - since
        silent = [p for p in range(self.size) if p != self.rank and p not in replies]
        behind = [p for p, st in sorted(replies.items()) if _older(st.seq, seq)]
        late = silent or behind
        names = " and ".join(self._name(p) for p in late)
        verb = "has" if len(late) == 1 else "have"
        kind: type[CollectiveError] = CollectiveTimeout
        if silent:
            cause = (f"{names} {verb} not arrived: no answer within {QUERY_SECONDS:g} s "
                     "(stopped, hung, or busy outside the library)")
        elif behind:
            cause = f"{names} {verb} not arrived: still in an earlier call"
        else:
            mismatch = self._disagreement(seq, sig, replies)
            if mismatch is not None:
                kind, cause = type(mismatch), str(mismatch)
            else:
                cause = ("every rank has arrived, yet none sent what the others wait for "
                         "(do all ranks make the same calls with the same arguments?)")
        where = "; ".join(self._where(p, replies, peer, seq, sig) for p in range(self.size))
        error = kind(f"{call}: rank {self.rank} timed out after {elapsed:.1f} s (timeout {limit:.1f} s) "
                     f"{action} rank {peer}; verdict: {cause}; where each rank is: {where}")
        error.origin = self.rank
        return error

    def _disagreement(self, seq: int, sig: Sig, replies: dict[int, _Status]) -> CollectiveError | None:
        """The mismatch of every rank's signature when all are in call ``seq``
        and signed (None when they agree or cannot be compared)."""
        sigs = [sig if p == self.rank else replies[p].sig for p in range(self.size)]
        if NO_SIG in sigs or any(replies[p].seq != seq for p in replies):
            return None
        return check_all(sigs, self.rank)

    def _where(self, p: int, replies: dict[int, _Status], peer: int, seq: int, sig: Sig) -> str:
        if p == self.rank:
            st = _Status(seq, sig, peer, True, time.monotonic() - self._call_since)
        elif p in replies:
            st = replies[p]
        else:
            return f"rank {p} did not answer"
        waits = f"waiting for rank {st.waiting}" if st.waiting >= 0 else "not waiting"
        since = f" for {st.seconds:.1f} s" if st.seq >= 0 else ""
        return f"rank {p} in {_call_name(st.seq, st.sig)}{since}, {waits}"

    # -- shutdown ------------------------------------------------------------

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Make every peer raise ``from_abort(reason, this rank)`` (over ZeroMQ
        and in-band on every lane), but for operations of collective calls
        before ``seq`` (the first call this rank did not complete; None:
        unknown), which may finish; this rank's later operations raise it
        too (or the error that broke the transport first). A transport that a
        peer aborted tells no one (that peer told everyone). Never blocks for
        long, never raises."""
        if self._aborted or self._closed:
            return
        self._aborted = True
        broken = self._broken
        if broken is not None and broken.origin is not None and broken.origin != self.rank:
            return  # a peer's abort: it told everyone
        first = -1 if seq is None else seq & SEQ_MASK
        self._fail(from_abort(reason, self.rank), first)
        self._tell_abort(reason, first)

    def _tell_abort(self, reason: str, first: int, origin: int = -1) -> None:
        """Send an abort to every peer, over ZeroMQ and in-band on every lane
        (``origin``: the aborting rank whose abort this rank relays)."""
        text = reason.encode("utf-8", "replace")[:ABORT_TEXT_BYTES]
        self._broadcast(HEADER.pack(KIND_ABORT, first, origin + 1, 0, 0, 0, 0) + text)
        if self._lanes is not None:
            self._lanes.abort(text.decode("utf-8", "replace"), first, origin)

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
        """Say goodbye to the peers (or push out an abort), close every socket
        and stop the threads (idempotent)."""
        with self._close_lock:
            if self._closed:
                return
            clean = self._broken is None
            if clean:
                self._broadcast(HEADER.pack(KIND_BYE, 0, 0, 0, 0, 0, 0))
            elif self._adopted is not None:  # so that no peer takes this close for a death
                origin, text, first = self._adopted
                self._tell_abort(text, first, origin)
            self._closed = True
            linger = 1.0 if clean else ABORT_LINGER
            if self._lanes is not None:
                self._lanes.close(time.monotonic() + linger, bye=clean)
            for sock in [*self._dealers.values(), *self._monitors, self._router]:
                if sock is not None:
                    try:
                        sock.close(int(linger * 1000))
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
