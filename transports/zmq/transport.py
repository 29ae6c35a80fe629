"""The ZeroMQ/TCP transport: opening (rendezvous, sockets, lanes), the call
this rank is in, sending and receiving, and closing. Progress, failures and
timeout diagnosis are its parts in :mod:`.progress`, :mod:`.failures` and
:mod:`.diagnosis`."""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from collectives.errors import CollectiveError, CollectiveTimeout, MismatchedCollective, PeerLost
from collectives.signature import NO_SIG, Sig, describe, out_of_step
from collectives.transport import COMPLETED, Request, Transport
from collectives import config
from collectives.transports.rendezvous import (JobCredentials, PeerInfo, ZapHandler, choose_address,
                                               exchange_peers, open_store, wait_for_key)

from .agreement import Agreement
from .diagnosis import Diagnosis
from .failures import Failures
from .lanes import Lanes
from .options import bracket, job_secret, lanes_wanted, reuse_message_buffers
from .progress import Progress
from .requests import OWN_REQUESTS, LaneRequest, RecvRequest, SendRequest
from .wire import (BYE_GRACE, COPY_BELOW, HEADER, KIND_BYE, KIND_DATA, POLL_SLICE, SEGMENT_BYTES, ABORT_LINGER,
                   PeerStatus, bytes_view, copy_error, log, older)

_open_counts: collections.Counter = collections.Counter()
_open_lock = threading.Lock()


class ZmqTransport(Progress, Failures, Diagnosis, Agreement, Transport):
    """Point-to-point over ZeroMQ/TCP with authenticated connections (see the module docstring)."""

    name = "zmq"
    capabilities = frozenset({"agree"})
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
        self._current: dict[int, RecvRequest] = {}
        self._connected: set[int] = set()
        self._said_bye: set[int] = set()
        self._lost_since: dict[int, float] = {}
        self._retries: dict[int, int] = {}  # reconnections refused since a peer's connection dropped
        self._aborts: collections.deque[tuple[int, str, int]] = collections.deque()  # received, not yet taken
        self._aborted_by: set[int] = set()
        # peers whose abort came on the channel that carries their data (their lane, or
        # ZeroMQ without lanes): everything they sent before aborting has arrived
        self._abort_in_band: set[int] = set()
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
        self._replies: dict[int, dict[int, PeerStatus]] = {}
        self._next_query = 0
        # Surviving failures (see .agreement): peers whose connection ended (True: after a goodbye),
        # the latest agreement state and the decisions each peer sent, the survivors' rendezvous keys.
        self._ended: dict[int, bool] = {}
        self._watch: Callable[[], None] = lambda: None  # while opening: raises if a survivor died (a shrink)
        self._agree_states: dict[int, Any] = {}
        self._decisions: dict[int, dict] = {}
        self._kv: dict[str, bytes] = {}

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
        credentials = JobCredentials(job_secret(options, job), str(options.get("auth") or "plain"), scope=job)
        t = cls(rank, size, zmq.Context(), timeout, int(options.get("zmq_segment_bytes") or SEGMENT_BYTES))
        try:
            t._open(job, options, credentials)
        except BaseException:
            t.close()
            raise
        return t

    def _open(self, job: str, options: dict[str, Any], credentials: JobCredentials) -> None:
        self._zap = ZapHandler(self._ctx, credentials, f"zap-rank{self.rank}")
        self._watch = options.get("survivor_watch") or self._watch
        self._heartbeat = heartbeat = float(options.get("zmq_heartbeat_timeout") or 10.0)
        if config.option(options, "zmq_reuse_buffers", "ZMQ_REUSE_BUFFERS"):
            reuse_message_buffers(self.segment_bytes)
        self._router = self._socket(zmq.ROUTER, heartbeat)
        credentials.server(self._router)
        self._zap.watch(self._router, f"rank {self.rank}")
        addr = choose_address(options)
        self._router.bind(f"tcp://{bracket(addr)}:0")
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
            if lanes_wanted(options, credentials):
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
            self.timeout, self._arrive, self._lane_ended, self._cv, self._lane_aborted, self._name, self._watch)
        self._lanes.on_control = self._lane_control
        for sock in self._lanes.sockets():
            self._router_poller.register(sock, zmq.POLLIN)
        # A lane is read as it arrives: what comes before its receive is copied
        # aside, so pipelined algorithms should post their receives early.
        self.receives_ahead = 1 << 10

    def _lane_ended(self, peer: int, said_bye: bool) -> None:
        """``peer``'s lane ended: a goodbye, an abort already on its way, or a lost peer (at once)."""
        self._stale.append(self._lanes.socket_of(peer))
        self._ended[peer] = said_bye or peer in self._said_bye
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
        self._abort_in_band.add(peer)
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
            self._watch()
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
                if tag & 1 and queue and older(tag >> 1, seq):
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
        data = bytes_view(buf)
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
            return COMPLETED if pending is None else LaneRequest(self, pending, peer, tag)
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
        return SendRequest(self, trackers, buf, peer, tag)

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
        return self._post_recv(bytes_view(buf, writable=True), peer, tag, None, sig)

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Receive and reduce each segment straight from its frame: no copy into ``tmp``."""
        if peer == self.rank or not out.size or self.segment_bytes % out.itemsize:
            return super().irecv_reduce(out, mine, peer, tag, op, tmp, sig)
        if tag & 1 and tag != self._call_tag:
            self._enter(tag, sig)
        return self._post_recv(bytes_view(out, writable=True), peer, tag, (out, mine, op), sig)

    def _post_recv(self, data: np.ndarray, peer: int, tag: int, reduce: tuple | None, sig: Sig) -> Request:
        self._check_peer(peer)
        key = (peer, tag)
        with self._cv:
            queue = self._unexpected.get(key)
            if queue:  # arrived before the transport broke (if it did): it is still delivered
                req = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                req.attach(data, reduce, sig)
                return req
            if self._broken is not None and self._blocks(tag) and not self._spares_receive(peer, tag):
                raise copy_error(self._broken)
            req = RecvRequest(self, peer, tag, data, reduce, sig)
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

    def _stray(self, peer: int, tag: int) -> RecvRequest | None:
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
        if not all(isinstance(r, OWN_REQUESTS) for r in pending):  # e.g. a reduction of a rank's own message
            for r in pending:
                r.wait(max(start + timeout - time.monotonic(), 1e-6))
            return

        def done() -> bool:
            pending[:] = [r for r in pending if not r.test()]  # every one tested: a failure raises at once
            return not pending

        if not self._drive_until(done, start + timeout, pending[0].peer):
            r = pending[0]
            raise self._timed_out(r.peer, r.tag, r.action, start, timeout)

    def _arrive(self, peer: int, tag: int, total: int, theirs: Sig) -> RecvRequest:
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
            req = RecvRequest(self, peer, tag, None)
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


    def _hear_goodbyes(self, deadline: float) -> None:
        """Take in the goodbyes of peers closing at about the same time (until
        every peer said goodbye or ``deadline``): ours to a peer that said
        goodbye need not be delivered, and it could not be (its sockets are
        closing), so its socket does not linger (which made the second of two
        ranks closing together wait a whole linger, 1 s)."""
        peers = [p for p in self._dealers if p != self.rank]
        try:
            self._drive_until(lambda: all(p in self._said_bye for p in peers), deadline)
        except CollectiveError:  # a peer lost or aborted meanwhile: its socket lingers as before
            pass

    def close(self) -> None:
        """Say goodbye to the peers (after passing on an abort this rank
        adopted), close every socket and stop the threads (idempotent). A
        goodbye tells the peers that this rank closed rather than died, which
        matters to survivors still agreeing or reopening (see .agreement)."""
        with self._close_lock:
            if self._closed:
                return
            clean = self._broken is None
            if not clean and self._adopted is not None:  # the peers hear the verdict before the goodbye
                origin, text, first = self._adopted
                self._tell_abort(text, first, origin)
            self._broadcast(HEADER.pack(KIND_BYE, 0, 0, 0, 0, 0, 0))
            if clean:
                self._hear_goodbyes(time.monotonic() + BYE_GRACE)
            self._closed = True
            linger = 1.0 if clean else ABORT_LINGER
            if self._lanes is not None:
                self._lanes.close(time.monotonic() + linger, bye=True)
            gone = self._said_bye if clean else set()
            socks = [(s, 0 if p in gone else linger) for p, s in self._dealers.items()]
            for sock, wait in socks + [(s, linger) for s in [*self._monitors, self._router]]:
                if sock is not None:
                    try:
                        sock.close(int(wait * 1000))
                    except zmq.ZMQError:
                        pass
            if self._zap is not None and not self._zap.close():
                log.warning("rank %d: the authentication thread did not stop; leaving its context", self.rank)
                return
            self._ctx.term()  # waits at most the sockets' linger


