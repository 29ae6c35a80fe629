"""A connection between two ``collectives run`` launchers of one job.

Messages are JSON objects, one a line, at most 64 KiB: nothing received is
unpickled or evaluated, and a peer that sends anything else is dropped.
TCP keepalive notices a peer whose host vanished (no FIN, no reset) within
about 30 s.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

__all__ = ["Link", "close_links", "MAX_MESSAGE", "POLL_SECONDS"]

MAX_MESSAGE = 1 << 16
#: seconds one message may take to send (the peer reads all the time)
SEND_SECONDS = 10.0
POLL_SECONDS = 0.05
#: TCP keepalive: idle seconds, probe interval, probes; and unacknowledged data's limit (ms)
KEEPALIVE = (10, 5, 3)
USER_TIMEOUT_MS = 30_000


class Link:
    """A connection between two launchers: JSON messages, one a line."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(SEND_SECONDS)
        _keepalive(sock)
        self.sock, self.peer = sock, peer
        self.closed = False
        self.garbled = False  # it sent something that is not a message
        self._buf = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> bool:
        """Send ``message``; False when the connection is gone."""
        if self.closed:
            return False
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
            return True
        except OSError:
            self.closed = True
            return False

    def receive(self) -> list[dict[str, Any]]:
        """The messages that arrived, read without waiting; at the end of the
        stream (or a reset, or garbage) ``closed`` is set."""
        if not self.closed and select.select([self.sock], [], [], 0)[0]:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except (BlockingIOError, socket.timeout):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self.closed = True
            elif data:
                self._buf += data
        return self._messages()

    def wait(self, seconds: float) -> list[dict[str, Any]]:
        """The messages that arrive within ``seconds`` (returns at the first)."""
        if not self.closed and not self._buf:
            select.select([self.sock], [], [], max(0.0, seconds))
        return self.receive()

    def _messages(self) -> list[dict[str, Any]]:
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                self._garble()
                return out
            out.append(message)
        if len(self._buf) > MAX_MESSAGE:
            self._garble()
        return out

    def _garble(self) -> None:
        self.garbled = self.closed = True
        self._buf = b""

    def local_address(self) -> str:
        """This end's IP address (as the peer reached it)."""
        addr = self.sock.getsockname()[0]
        return addr.removeprefix("::ffff:") if addr.startswith("::ffff:") and "." in addr else addr

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def close_links(links: list[Link], seconds: float = 2.0) -> None:
    """Close ``links`` cleanly: say we are done writing, let each peer close
    first (reading what it still sends, at most ``seconds`` in all), so that
    nothing already sent is lost to a reset."""
    for link in links:
        if not link.closed:
            try:
                link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                link.closed = True
    end = time.monotonic() + seconds
    while any(not link.closed for link in links) and time.monotonic() < end:
        for link in links:
            link.receive()
        open_ = [link for link in links if not link.closed]
        if open_:
            select.select(open_, [], [], POLL_SECONDS)
    for link in links:
        link.close()


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer whose host vanished (no FIN, no RST) within about 30 s."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    except OSError:  # not offered here: a vanished host is noticed later
        pass
