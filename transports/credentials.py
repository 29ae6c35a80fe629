"""Job credentials: every socket and lane of a job proves it knows the job's secret.

Every ZeroMQ socket of a job proves knowledge of the job secret during the
handshake (ZAP). ``"plain"`` sends a token derived from the secret (HMAC,
never the secret itself); ``"curve"`` derives CURVE key pairs from the secret
and also encrypts the traffic. A connection that fails is refused by libzmq
before any message reaches the application, and logged. The direct TCP
lanes authenticate with a key derived the same way (``lane_key``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading

import zmq
from zmq.utils import z85

from collectives.errors import BadArgument, TransportUnavailable

__all__ = ["JobCredentials", "ZapHandler", "ZAP_ENDPOINT"]

log = logging.getLogger("collectives.zmq")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_PLAIN_USER = b"collectives"
_HANDSHAKE_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


class JobCredentials:
    """Per-job authentication material derived from the job secret.

    Args:
        secret: the job secret (shared by every rank).
        mechanism: ``"plain"`` (authenticated, not encrypted) or ``"curve"``
            (authenticated and encrypted).
        scope: what the credentials admit to (the job id of one transport):
            credentials of another scope are refused, so that no process of
            an earlier communicator (before a shrink) reaches a later one.
    """

    def __init__(self, secret: str, mechanism: str = "plain", scope: str = "") -> None:
        if mechanism not in ("plain", "curve"):
            raise BadArgument(f"zmq auth must be 'plain' or 'curve', got {mechanism!r}")
        if mechanism == "curve" and not zmq.has("curve"):
            raise TransportUnavailable("libzmq was built without CURVE; use auth='plain'")
        self.mechanism = mechanism
        key = secret.encode()
        if scope:
            key = hmac.new(key, b"collectives-scope/" + scope.encode(), hashlib.sha256).digest()
        self._token = self._derive(key, b"plain-token").hex().encode()
        self._lane_key = self._derive(key, b"tcp-lanes")
        if mechanism == "curve":
            self._server_secret = z85.encode(self._derive(key, b"curve-server"))
            self._client_secret = z85.encode(self._derive(key, b"curve-client"))
            self._server_public = zmq.curve_public(self._server_secret)
            self._client_public = zmq.curve_public(self._client_secret)
            self._client_public_raw = z85.decode(self._client_public)

    @staticmethod
    def _derive(key: bytes, label: bytes) -> bytes:
        return hmac.new(key, b"collectives-zmq/" + label, hashlib.sha256).digest()

    def lane_key(self) -> bytes:
        """The key the direct TCP lanes prove the job with (see :mod:`.lanes`)."""
        return self._lane_key

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) require the job's credentials from clients."""
        sock.zap_domain = b"collectives"
        if self.mechanism == "curve":
            sock.curve_server = True
            sock.curve_secretkey = self._server_secret
        else:
            sock.plain_server = True

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before connect) present the job's credentials."""
        if self.mechanism == "curve":
            sock.curve_serverkey = self._server_public
            sock.curve_publickey = self._client_public
            sock.curve_secretkey = self._client_secret
        else:
            sock.plain_username = _PLAIN_USER
            sock.plain_password = self._token

    def accepts(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        """True when a ZAP request carries this job's credentials."""
        if mechanism == b"PLAIN" and self.mechanism == "plain" and len(credentials) == 2:
            return (hmac.compare_digest(credentials[0], _PLAIN_USER)
                    and hmac.compare_digest(credentials[1], self._token))
        if mechanism == b"CURVE" and self.mechanism == "curve" and len(credentials) == 1:
            return hmac.compare_digest(credentials[0], self._client_public_raw)
        return False


class ZapHandler:
    """Answers libzmq's authentication requests for one context, in a thread.

    It also logs handshake failures reported by monitor sockets handed to
    :meth:`watch` (strangers that do not even speak ZMTP).
    """

    def __init__(self, ctx: zmq.Context, credentials: JobCredentials, name: str = "zap") -> None:
        self.credentials = credentials
        self.refused = 0
        self._ctx = ctx
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._stop_addr = f"inproc://collectives-zap-stop-{id(self):x}"
        self._stop_rx = ctx.socket(zmq.PAIR)
        self._stop_rx.bind(self._stop_addr)
        self._watched: list[tuple[zmq.Socket, str]] = []
        self._pending_watch: list[tuple[zmq.Socket, str]] = []
        self._watch_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"collectives-{name}", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket, what: str) -> None:
        """Log handshake failures on ``sock`` (a listening socket) as ``what``."""
        addr = f"inproc://collectives-watch-{id(sock):x}"
        sock.monitor(addr, zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        mon = self._ctx.socket(zmq.PAIR)
        mon.linger = 0
        mon.connect(addr)
        with self._watch_lock:
            self._pending_watch.append((mon, what))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        try:
            while True:
                with self._watch_lock:
                    for mon, what in self._pending_watch:
                        poller.register(mon, zmq.POLLIN)
                        self._watched.append((mon, what))
                    self._pending_watch.clear()
                events = dict(poller.poll(200))
                if self._stop_rx in events:
                    break
                if self._zap in events:
                    self._answer(self._zap.recv_multipart())
                for mon, what in self._watched:
                    if mon in events:
                        self._log_event(mon, what)
        except zmq.ContextTerminated:
            pass
        finally:
            with self._watch_lock:  # a socket handed to watch() just before the stop, too
                self._watched.extend(self._pending_watch)
                self._pending_watch.clear()
            for mon, _ in self._watched:
                mon.close(0)
            self._zap.close(0)
            self._stop_rx.close(0)

    def _answer(self, request: list[bytes]) -> None:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 6:
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        ok = self.credentials.accepts(mechanism, request[6:])
        if not ok:
            self.refused += 1
            log.warning("refused a %s connection from %s: wrong or missing job credentials",
                        mechanism.decode(errors="replace") or "?", address.decode(errors="replace"))
        status = (b"200", b"OK") if ok else (b"400", b"wrong job credentials")
        self._zap.send_multipart([version, request_id, *status, b"job" if ok else b"", b""])

    def _log_event(self, mon: zmq.Socket, what: str) -> None:
        frames = mon.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != 6:
            return
        event, _ = struct.unpack("=hi", frames[0])
        if event in _HANDSHAKE_FAILURES:
            self.refused += 1
            log.warning("%s refused a connection on %s (%s)", what, frames[1].decode(errors="replace"),
                        zmq.Event(event).name)

    def close(self) -> bool:
        """Stop the thread (idempotent). Returns False if it did not stop within 5 s."""
        if not self._thread.is_alive():
            return True
        stop = self._ctx.socket(zmq.PAIR)
        stop.linger = 0
        stop.connect(self._stop_addr)
        stop.send(b"")
        self._thread.join(timeout=5)
        stop.close(0)
        return not self._thread.is_alive()
