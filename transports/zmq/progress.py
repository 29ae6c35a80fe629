"""Progress of the TCP transport: whichever thread waits drives the inbound
ZeroMQ socket and the lanes (one at a time), matches arriving segments to
receives, and handles the transport's own control messages."""

from __future__ import annotations

import time
from typing import Callable

import zmq

from collectives.errors import PeerLost

from .wire import (GRACE_SECONDS, HEADER, KIND_ABORT, KIND_AGREE, KIND_BYE, KIND_DATA, KIND_KV, KIND_QUERY,
                   KIND_STATUS, POLL_SLICE,
                   MONITOR_EVERY, YIELD_SECONDS, ZMQ_EVENTS, ZMQ_POLLIN, log, yield_cpu)


class Progress:
    """Driving the sockets (a part of :class:`~.transport.ZmqTransport`)."""


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
            yield_until = time.perf_counter() + min(timeout, YIELD_SECONDS)
            while time.perf_counter() < yield_until:  # the answer is often microseconds away
                yield_cpu()
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
        while sock.get(ZMQ_EVENTS) & ZMQ_POLLIN:  # cheaper than catching zmq.Again
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
            if self._lanes is None:  # the abort came on the channel that carries the peer's data
                self._abort_in_band.add(peer)
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
        elif KIND_AGREE <= kind <= KIND_KV:
            offset = HEADER.unpack_from(header.buffer)[3]
            self._on_agreement(peer, kind, tag, total, offset, header.buffer[HEADER.size:])
        else:
            log.warning("rank %d: dropped a message of unknown kind %d from rank %d", self.rank, kind, peer)

