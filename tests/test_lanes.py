"""The direct TCP lanes of the ZeroMQ transport: the handshake refuses
strangers and wrong secrets both ways, and the lanes carry what ZeroMQ would."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from collectives import PeerLost
from collectives.transports import lanes
from harness import run_ranks


def _pair():
    listener = socket.create_server(("127.0.0.1", 0))
    return listener, listener.getsockname()[1]


def _accept_in_thread(listener, key: bytes, result: dict) -> threading.Thread:
    def run():
        conn, _ = listener.accept()
        result["peer"] = lanes._accept_from(conn, 0, 4, key, b"job", time.monotonic() + 5)
        conn.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_handshake_proves_the_secret_both_ways():
    listener, port = _pair()
    result: dict = {}
    t = _accept_in_thread(listener, b"k" * 32, result)
    sock = lanes._connect_to(0, 2, f"127.0.0.1:{port}", b"k" * 32, b"job", time.monotonic() + 5)
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
            lanes._connect_to(0, 2, f"127.0.0.1:{port}", b"x" * 32, b"job", time.monotonic() + 5)
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
    result["peer"] = lanes._accept_from(conn, 0, 4, b"k" * 32, b"job", deadline)
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
