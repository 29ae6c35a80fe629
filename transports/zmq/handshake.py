"""Opening the TCP lanes: listen, connect or accept, and prove both ends know the job's secret.

Handshake (the acceptor speaks first, so nothing can be replayed): the
acceptor sends a fresh nonce; the connector answers with its rank, a nonce
of its own and an HMAC over the job, both nonces and its rank; the acceptor
answers with an HMAC over the same in the other direction. A connection
that fails it (a stranger, a wrong secret, garbage, silence) is logged and
dropped, and the acceptor goes on waiting for its peers; once every peer is
connected, the listening socket is closed.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import select
import socket
import struct
import time
from typing import Callable

from collectives.errors import CollectiveTimeout, PeerLost

__all__ = ["open_lanes", "connect_to", "accept_from", "tune", "HANDSHAKE_SECONDS"]

log = logging.getLogger("collectives.zmq")

HELLO = struct.Struct("<8sI16s32s")  # magic, rank, connector's nonce, mac
MAGIC = b"CLLANE01"
NONCE = 16
#: Seconds a connection may take over its handshake.
HANDSHAKE_SECONDS = 5.0


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"|" + b"|".join(parts), "sha256").digest()


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setblocking(False)


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from the blocking-by-deadline ``sock``; None on end of file or time out."""
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            got = sock.recv(n - len(data))
        except (socket.timeout, OSError):
            return None
        if not got:
            return None
        data += got
    return bytes(data)


def connect_to(peer: int, rank: int, where: str, key: bytes, job: bytes, deadline: float,
                name: str = "", watch: Callable[[], None] = lambda: None) -> socket.socket:
    host, _, port = where.rpartition(":")
    name = name or f"rank {peer}"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"rank {rank}: could not open a TCP lane to {name} at {where}")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, HANDSHAKE_SECONDS))
            break
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EAGAIN, None):
                raise
            watch()
            time.sleep(0.01)
    try:
        theirs = _recv_exactly(sock, NONCE, deadline)
        mine = os.urandom(NONCE)
        if theirs is not None:
            sock.sendall(HELLO.pack(MAGIC, rank, mine, _mac(key, b"lane-connect", job, b"%d" % rank, theirs, mine)))
            answer = _recv_exactly(sock, 32, deadline)
            if answer is not None and hmac.compare_digest(
                    answer, _mac(key, b"lane-accept", job, b"%d" % peer, mine, theirs)):
                return sock
        raise PeerLost(f"rank {rank}: {name} refused this rank's TCP lane (do all ranks have the same "
                       "job secret?)", peer)
    except BaseException:
        sock.close()
        raise


def accept_from(conn: socket.socket, rank: int, size: int, key: bytes, job: bytes,
                 deadline: float) -> int | None:
    """The authenticated rank of a new connection, or None (logged) when it fails the handshake."""
    try:
        mine = os.urandom(NONCE)
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.sendall(mine)
        hello = _recv_exactly(conn, HELLO.size, deadline)
        if hello is not None:
            magic, peer, theirs, mac = HELLO.unpack(hello)
            if magic == MAGIC and 0 <= peer < size and hmac.compare_digest(
                    mac, _mac(key, b"lane-connect", job, b"%d" % peer, mine, theirs)):
                conn.sendall(_mac(key, b"lane-accept", job, b"%d" % rank, theirs, mine))
                return peer
    except OSError:
        pass
    log.warning("rank %d: refused a TCP lane connection that failed the job's handshake", rank)
    return None


def open_lanes(rank: int, size: int, address: str, key: bytes, job: str, publish: Callable[[str], None],
               lookup: Callable[[int, float], str], timeout: float,
               name: Callable[[int], str] = lambda peer: f"rank {peer}",
               watch: Callable[[], None] = lambda: None) -> list[socket.socket | None]:
    """Listen on ``address``, ``publish`` "host:port", connect to every lower
    rank (``lookup(rank, seconds)`` gives its "host:port") and accept every
    higher one, each authenticated with ``key``. ``name(peer)`` says who a
    peer is in errors; ``watch()``, called while waiting, may raise to give
    up (a survivor died during a shrink).

    Raises:
        CollectiveTimeout: a peer did not connect in time.
        PeerLost: a peer refused this rank's credentials.
    """
    deadline = time.monotonic() + timeout
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    socks: list[socket.socket | None] = [None] * size
    try:
        listener.bind((address, 0))
        listener.listen(max(size, 16))
        host, port = listener.getsockname()[:2]
        publish(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        job_id = job.encode()
        for peer in range(rank):
            socks[peer] = connect_to(peer, rank, lookup(peer, max(deadline - time.monotonic(), 0.0)),
                                      key, job_id, deadline, name(peer), watch)
        while any(socks[p] is None for p in range(rank + 1, size)):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(name(p) for p in range(rank + 1, size) if socks[p] is None)
                raise CollectiveTimeout(f"rank {rank}: {missing} did not open their TCP lanes "
                                        f"within {timeout:.3g}s")
            watch()
            ready, _, _ = select.select([listener], [], [], min(left, 0.05))
            if ready:
                conn, who = listener.accept()
                peer = accept_from(conn, rank, size, key, job_id,
                                    min(deadline, time.monotonic() + HANDSHAKE_SECONDS))
                if peer is None or peer <= rank or socks[peer] is not None:
                    if peer is not None:
                        log.warning("rank %d: refused a second TCP lane claiming rank %d from %s",
                                    rank, peer, who)
                    conn.close()
                    continue
                socks[peer] = conn
    except BaseException:
        for s in socks:
            if s is not None:
                s.close()
        raise
    finally:
        listener.close()
    for s in socks:
        if s is not None:
            tune(s)
    return socks
