"""The direct TCP lanes of the ZeroMQ transport: the handshake refuses
strangers and wrong secrets both ways, the lanes carry what ZeroMQ would,
and a lane that ends mid-send or mid-read (the peer died, reset or sent a
malformed frame) is reported once and never raises anything but PeerLost."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from collectives import PeerLost
from collectives.signature import NO_SIG
from collectives.transports.zmq import handshake, lanes
from harness import run_ranks


def _pair():
    listener = socket.create_server(("127.0.0.1", 0))
    return listener, listener.getsockname()[1]


def _accept_in_thread(listener, key: bytes, result: dict) -> threading.Thread:
    def run():
        conn, _ = listener.accept()
        result["peer"] = handshake.accept_from(conn, 0, 4, key, b"job", time.monotonic() + 5)
        conn.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_handshake_proves_the_secret_both_ways():
    listener, port = _pair()
    result: dict = {}
    t = _accept_in_thread(listener, b"k" * 32, result)
    sock = handshake.connect_to(0, 2, f"127.0.0.1:{port}", b"k" * 32, b"job", time.monotonic() + 5)
    t.join(5)
    sock.close()
    listener.close()
    assert result["peer"] == 2


def test_a_wrong_secret_is_refused_on_both_sides(caplog):
    listener, port = _pair()
    result: dict = {}
    t = _accept_in_thread(listener, b"k" * 32, result)
    with caplog.at_level(logging.WARNING, logger="collectives.zmq"):
        with pytest.raises(PeerLost, match="refused this rank's TCP lane"):
            handshake.connect_to(0, 2, f"127.0.0.1:{port}", b"x" * 32, b"job", time.monotonic() + 5)
        t.join(5)
    listener.close()
    assert result["peer"] is None
    assert "failed the job's handshake" in caplog.text


@pytest.mark.parametrize("garbage", [b"", b"GET / HTTP/1.0\r\n\r\n", bytes(200)])
def test_garbage_and_silence_are_refused(garbage):
    listener, port = _pair()
    result: dict = {}
    deadline = time.monotonic() + 1.0
    conn_result = {}

    def stranger():
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.recv(64)
            if garbage:
                s.sendall(garbage)
            time.sleep(1.5)
        conn_result["done"] = True
    th = threading.Thread(target=stranger, daemon=True)
    th.start()
    conn, _ = listener.accept()
    result["peer"] = handshake.accept_from(conn, 0, 4, b"k" * 32, b"job", deadline)
    conn.close()
    listener.close()
    th.join(5)
    assert result["peer"] is None


def lanes_in_use(comm):
    t = comm.transport
    big = np.arange(3_000_000, dtype=np.int64) + comm.rank
    got = np.zeros_like(big)
    other = 1 - comm.rank
    t.waitall([t.isend(big, other, 5), t.irecv(got, other, 5)], 30)  # both send first: queued sends
    small = np.array([comm.rank], np.int64)
    back = np.zeros(1, np.int64)
    t.waitall([t.isend(small, other, 6), t.irecv(back, other, 6)], 30)
    return t._lanes is not None, bool(np.array_equal(got, np.arange(3_000_000) + other)), int(back[0])


def test_the_zmq_transport_moves_data_over_lanes():
    results = run_ranks(lanes_in_use, 2, transport="zmq", timeout=60)
    assert results == [(True, True, 1), (True, True, 0)]


# -- a lane that ends mid-flush or mid-read --------------------------------------


class _Into:
    """What a message fills: a buffer of its size (as a posted receive is)."""

    def __init__(self, total: int) -> None:
        self.buf = np.zeros(total, np.uint8)
        self.got = 0

    def target(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset:offset + nbytes]

    def feed(self, offset: int, data, nbytes: int, landed: bool) -> None:
        self.got += nbytes


class _Rank0:
    """Rank 0's lanes to rank 1 over ``sock``, with what the lanes reported."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.messages: list[tuple[int, int, tuple, _Into]] = []
        self.ended: list[tuple[int, bool]] = []
        self.aborts: list[tuple[int, str, int, int]] = []
        self.lanes = lanes.Lanes(0, [None, sock], self._start, lambda p, bye: self.ended.append((p, bye)),
                                 threading.RLock(), self._aborted)

    def _aborted(self, peer: int, text: str, first: int, origin: int) -> None:
        self.aborts.append((peer, text, first, origin))

    def _start(self, peer: int, tag: int, total: int, sig: tuple) -> _Into:
        into = _Into(total)
        self.messages.append((tag, total, sig, into))
        return into

    def progress_until(self, done, seconds: float = 5.0) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            self.lanes.progress()
            time.sleep(0.001)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    return a, b


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (as the kernel does for a killed process with unread data)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_flush_to_a_peer_that_went_away_drops_the_queue_without_index_error(how):
    a, b = _tcp_pair()
    r0 = _Rank0(a)
    big = np.ones(16 << 20, np.uint8)  # more than the kernel buffers: the rest is queued
    first = r0.lanes.send(1, 3, memoryview(big), big)
    second = r0.lanes.send(1, 3, memoryview(big[:1000]), big)
    assert first is not None and second is not None and not first.done
    b.recv(1 << 16)  # unread data makes the close a reset too
    (_reset if how == "reset" else socket.socket.close)(b)
    deadline = time.monotonic() + 10
    while r0.lanes.is_open(1) and time.monotonic() < deadline:
        r0.lanes.flush()  # raised IndexError when a failing write ended the lane mid-loop
        r0.lanes.progress()
    assert not r0.lanes.is_open(1)
    assert first.done and first.lost and second.done and second.lost
    assert r0.ended == [(1, False)]
    with pytest.raises(PeerLost, match="rank 1"):
        r0.lanes.send(1, 5, memoryview(big[:8]), big)
    assert r0.ended == [(1, False)], "an ended lane is reported once"


def test_a_lane_ending_mid_message_is_reported_not_raised():
    a, b = _tcp_pair()
    r0 = _Rank0(a)
    b.sendall(lanes.HEADER.pack(7, 1000, 1, 2, 3) + bytes(10))  # announces 1000 bytes, sends 10
    r0.progress_until(lambda: r0.messages and r0.messages[0][3].got == 10)
    _reset(b)
    r0.progress_until(lambda: r0.ended)
    assert r0.ended == [(1, False)]
    tag, total, sig, into = r0.messages[0]
    assert (tag, total, sig, into.got) == (7, 1000, (1, 2, 3), 10)


def test_goodbye_then_end_of_file_is_a_clean_close():
    a, b = _tcp_pair()
    r0 = _Rank0(a)
    b.sendall(lanes.HEADER.pack(4, 3, *NO_SIG) + b"abc" + lanes.HEADER.pack(lanes.BYE_TAG, 0, *NO_SIG))
    b.close()
    r0.progress_until(lambda: r0.ended)
    assert r0.ended == [(1, True)]
    assert [(t, n, bytes(i.buf)) for t, n, _, i in r0.messages] == [(4, 3, b"abc")]


def test_an_abort_frame_delivers_its_text():
    a, b = _tcp_pair()
    r0 = _Rank0(a)
    text = "PeerLost\x1frank 1 gives up".encode()
    b.sendall(lanes.HEADER.pack(lanes.ABORT_TAG, len(text), 13 + 1, 0, 0) + text)  # at call #13
    b.close()
    r0.progress_until(lambda: r0.ended)
    assert r0.aborts == [(1, text.decode(), 13, -1)]
    assert r0.ended == [(1, False)] and r0.messages == []


@pytest.mark.parametrize("frame", [lanes.HEADER.pack(-7, 0, *NO_SIG),
                                   lanes.HEADER.pack(lanes.ABORT_TAG, 1 << 40, *NO_SIG)])
def test_a_malformed_lane_frame_ends_the_lane(frame):
    a, b = _tcp_pair()
    r0 = _Rank0(a)
    b.sendall(frame)
    r0.progress_until(lambda: r0.ended)
    b.close()
    assert r0.ended == [(1, False)] and r0.messages == [] and r0.aborts == []


def test_signatures_travel_in_the_lane_header():
    a, b = _tcp_pair()
    r0, r1 = _Rank0(a), _Rank0(b)
    sig = (1 << 63 | 5, 1 << 40, 12345)
    r0.lanes.send(1, 9, memoryview(b"xy"), None, sig)
    r1.progress_until(lambda: r1.messages)
    assert [(t, n, s, bytes(i.buf)) for t, n, s, i in r1.messages] == [(9, 2, sig, b"xy")]
    r0.lanes.close(time.monotonic() + 1)
    r1.progress_until(lambda: r1.ended)
    assert r1.ended == [(1, True)]
    r1.lanes.close(time.monotonic())


def test_an_abort_relayed_at_close_names_its_origin_and_comes_before_the_end():
    a, b = _tcp_pair()
    r0, r1 = _Rank0(a), _Rank0(b)
    r0.lanes.abort("MismatchedCollective\x1fit differs", first=7, origin=2)  # rank 2's abort, passed on
    r0.lanes.close(time.monotonic() + 1, bye=False)
    r1.progress_until(lambda: r1.ended)
    assert r1.aborts == [(1, "MismatchedCollective\x1fit differs", 7, 2)]
    assert r1.ended == [(1, False)]
    r1.lanes.close(time.monotonic())
