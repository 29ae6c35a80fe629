"""Failures of the TCP transport: lost peers (lanes that end, ZeroMQ
connections that drop), aborts sent and received, and the errors every
later operation raises."""

from __future__ import annotations

import struct
import time

import zmq

from collectives.errors import BadArgument, CollectiveError, PeerLost, from_abort
from collectives.signature import SEQ_MASK

from .wire import ABORT_TEXT_BYTES, GRACE_SECONDS, HEADER, KIND_ABORT, copy_error, log, older


class Failures:
    """Losing peers and aborting (a part of :class:`~.transport.ZmqTransport`)."""

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
                if self._lanes is None:
                    self._ended.setdefault(peer, peer in self._said_bye)
                del self._lost_since[peer]
            elif now - since >= GRACE_SECONDS:
                if self._lanes is not None:
                    refused = not self._lanes.is_open(peer)
                else:
                    refused = self._retries.get(peer, 0) >= 2  # the first retry is only scheduled
                self._fail(self._died(peer) if refused else self._unreachable(peer))
                self._ended.setdefault(peer, False)
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
        return first < 0 or tag is None or not tag & 1 or not older(tag >> 1, first)

    def _spares_receive(self, peer: int, tag: int) -> bool:
        """Whether a point-to-point receive from ``peer`` still waits although
        the transport broke: ``peer`` is the rank whose abort broke it and
        that abort has not come on the channel carrying ``peer``'s data yet,
        so what ``peer`` sent before it aborted (e.g. its part of setting up
        a communicator that a slower rank is still in) is still delivered.
        The abort follows on that channel, or the channel ends."""
        broken = self._broken
        if tag & 1 or broken is None or broken.origin != peer or peer in self._abort_in_band:
            return False
        if self._lanes is not None:
            return self._lanes.is_open(peer)
        return peer not in self._lost_since

    def _raise_if_broken(self, peer: int | None = None, tag: int | None = None, receiving: bool = False) -> None:
        """Raise the error that broke the transport (when it applies to an
        operation with ``tag`` on ``peer``: see :meth:`_blocks`; a call it
        spares still fails once ``peer`` is gone; a receive, see
        :meth:`_spares_receive`), or that ``peer`` has closed, or that this
        transport has."""
        if self._broken is not None and (self._blocks(tag) or (peer is not None and self._gone(peer))):
            if not (receiving and self._spares_receive(peer, tag)):
                raise copy_error(self._broken)
        if (peer is not None and peer in self._said_bye and peer not in self._aborted_by
                and (self._lanes is None or not self._lanes.is_open(peer))):
            # (a peer that aborted closes after its abort: the abort, taken once every
            # lost peer is explained, or this rank's own verdict on a lost peer, is the error)
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
        if self._broken is None and peer in self._aborted_by:
            # its abort is held while another peer's loss is unexplained: that loss is
            # declared (or explained) within its grace period, then one of them breaks this rank
            self._drive_until(lambda: self._broken is not None, time.monotonic() + 2 * GRACE_SECONDS, peer)
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
        self._send_frame(frame, list(self._dealers))

    def _send_frame(self, frame: bytes, peers: list[int]) -> None:
        """Send a message of the transport's own to ``peers`` over ZeroMQ, as
        far as it goes now (never blocks on a peer, never raises)."""
        acquired = self._send_lock.acquire(timeout=1.0)
        try:
            for peer in peers:
                try:
                    self._dealers[peer].send(frame, zmq.NOBLOCK)
                except (zmq.ZMQError, KeyError):
                    pass
        finally:
            if acquired:
                self._send_lock.release()
