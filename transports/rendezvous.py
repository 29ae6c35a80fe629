"""Rendezvous for TCP transports: job credentials, a key-value store, addresses.

Ranks find each other the way torchrun users expect (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):

* a store given in ``options["store"]`` (anything with ``set(key, bytes)``
  and a blocking ``get(key)``, such as a ``torch.distributed.Store``) is used
  as is;
* under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent's store
  already listens on ``MASTER_PORT``: a ``torch.distributed.TCPStore`` client
  connects to it;
* otherwise rank 0 serves a small store on ``MASTER_PORT`` (a ZeroMQ ROUTER,
  authenticated like every other socket of the job) and the others connect.

Each rank then publishes the endpoint it listens on, with its host name and
process id (:func:`exchange_peers`), and reads everyone else's, so that
errors name a peer by rank, host and pid rather than by address. The
listening address comes from ``options["addr"]``, else from the interface
``options["ifname"]`` / ``COLLECTIVES_SOCKET_IFNAME`` (like
``GLOO_SOCKET_IFNAME``), else it is the local address that routes to
``MASTER_ADDR``.

Authentication: every socket of a job proves knowledge of the job secret
during the ZeroMQ handshake (ZAP). ``"plain"`` sends a token derived from the
secret (HMAC, never the secret itself); ``"curve"`` derives CURVE key pairs
from the secret and also encrypts the traffic. A connection that fails is
refused by libzmq before any message reaches the application, and logged.
Nothing received is ever unpickled: the store speaks in raw byte frames.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import zmq
from zmq.utils import z85

from collectives import config
from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout, TransportUnavailable

__all__ = ["KeyValueStore", "JobCredentials", "ZapHandler", "StoreServer", "StoreClient",
           "LocalStore", "TorchStoreAdapter", "open_store", "choose_address", "exchange_endpoints",
           "exchange_peers", "PeerInfo", "wait_for_key"]

log = logging.getLogger("collectives.zmq")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_PLAIN_USER = b"collectives"
_HANDSHAKE_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


class KeyValueStore(Protocol):
    """What rendezvous needs of a store."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


# ---------------------------------------------------------------------------
# Credentials and the ZAP handler


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


# ---------------------------------------------------------------------------
# The store: rank 0's server, clients, adapters


class LocalStore:
    """A thread-safe in-memory store (rank 0's view of its own server)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._data[key] = bytes(value)
            self._cv.notify_all()

    def lookup(self, key: str) -> bytes | None:
        with self._cv:
            return self._data.get(key)

    def get(self, key: str, timeout: float = 60.0) -> bytes:
        deadline = time.monotonic() + timeout
        with self._cv:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"rendezvous: key {key!r} not set within {timeout:.3g}s")
                self._cv.wait(min(left, 0.5))
            return self._data[key]


class StoreServer:
    """Rank 0's rendezvous service on ``tcp://*:port``: SET and GET of byte values.

    Requests are frames ``[b"SET", key, value]`` (reply ``[b"OK"]``) and
    ``[b"GET", key]`` (reply ``[b"VAL", value]`` or ``[b"NONE"]``).
    """

    def __init__(self, ctx: zmq.Context, port: int, credentials: JobCredentials,
                 zap: ZapHandler | None = None, host: str = "*") -> None:
        self.store = LocalStore()
        self._ctx = ctx
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.linger = 1000
        credentials.server(self._sock)
        if zap is not None:
            zap.watch(self._sock, "rendezvous store")
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise TransportUnavailable(
                f"rank 0 cannot serve the rendezvous store on port {port}: {exc} "
                "(another job on MASTER_PORT? under torchrun pass the store or set "
                "TORCHELASTIC_USE_AGENT_STORE=True)") from exc
        self._stop_addr = f"inproc://collectives-store-stop-{id(self):x}"
        self._stop_rx = ctx.socket(zmq.PAIR)
        self._stop_rx.bind(self._stop_addr)
        self._thread = threading.Thread(target=self._run, name="collectives-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(500))
                if self._stop_rx in events:
                    break
                if self._sock in events:
                    self._serve(self._sock.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close()
            self._stop_rx.close(0)

    def _serve(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        if len(body) == 3 and body[0] == b"SET":
            self.store.set(body[1].decode(), body[2])
            reply = [b"OK"]
        elif len(body) == 2 and body[0] == b"GET":
            value = self.store.lookup(body[1].decode())
            reply = [b"NONE"] if value is None else [b"VAL", value]
        else:
            reply = [b"ERR"]
        self._sock.send_multipart([ident, *reply])

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._thread.is_alive():
            return
        stop = self._ctx.socket(zmq.PAIR)
        stop.linger = 0
        stop.connect(self._stop_addr)
        stop.send(b"")
        self._thread.join(timeout=5)
        stop.close(0)


class StoreClient:
    """A client of :class:`StoreServer`; every call has a deadline.

    Args:
        ctx: the ZeroMQ context.
        host, port: where rank 0 serves the store.
        credentials: the job's credentials.
        timeout: seconds for each call (the server may not be up yet).
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, credentials: JobCredentials,
                 timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        credentials.client(self._sock)
        self._sock.connect(f"tcp://{_bracket(host)}:{port}")
        self._where = f"{host}:{port}"

    def _call(self, frames: list[bytes], deadline: float) -> list[bytes]:
        self._sock.send_multipart(frames)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(
                    f"rendezvous store at {self._where} did not answer within {self.timeout:.3g}s "
                    "(rank 0 not started, wrong MASTER_ADDR/MASTER_PORT, or a different job secret)")
            if self._sock.poll(int(min(left, 0.5) * 1000) + 1, zmq.POLLIN):
                return self._sock.recv_multipart()

    def set(self, key: str, value: bytes) -> None:
        self._call([b"SET", key.encode(), bytes(value)], time.monotonic() + self.timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause = 0.002
        while True:
            reply = self._call([b"GET", key.encode()], deadline)
            if reply[0] == b"VAL" and len(reply) == 2:
                return reply[1]
            if time.monotonic() + pause > deadline:
                raise CollectiveTimeout(f"rendezvous: key {key!r} was not published in time")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def close(self) -> None:
        self._sock.close(0)


class TorchStoreAdapter:
    """A ``torch.distributed.Store`` (or anything with set/get) seen as a :class:`KeyValueStore`."""

    def __init__(self, store: Any, timeout: float) -> None:
        self._store = store
        self.timeout = timeout
        if hasattr(store, "set_timeout"):
            import datetime

            try:
                store.set_timeout(datetime.timedelta(seconds=timeout))
            except Exception:  # some stores have a fixed timeout
                pass

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        try:
            value = self._store.get(key)
        except CollectiveError:  # a store of this library's own says what went wrong
            raise
        except Exception as exc:  # torch raises its own DistStoreError on timeout
            raise CollectiveTimeout(f"rendezvous: key {key!r} not found in the store: {exc}") from exc
        return bytes(value)

    def close(self) -> None:
        pass


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _torch_agent_store(host: str, port: int, timeout: float) -> Any:
    try:
        import datetime

        from torch.distributed import TCPStore
    except ImportError as exc:
        raise TransportUnavailable(
            "TORCHELASTIC_USE_AGENT_STORE=True says torchrun's store listens on MASTER_PORT, "
            f"but torch cannot be imported to reach it ({exc}); pass options['store']") from exc
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def open_store(ctx: zmq.Context, rank: int, options: dict[str, Any], credentials: JobCredentials,
               zap: ZapHandler | None, timeout: float) -> tuple[Any, Callable[[], None]]:
    """The job's key-value store and a function that releases it.

    Args:
        ctx: ZeroMQ context (rank 0's server and clients use it).
        rank: this rank.
        options: transport options (``store``, ``master_addr``, ``master_port``).
        credentials: the job's credentials.
        zap: logs refused connections to rank 0's server.
        timeout: seconds for each store call.

    Returns:
        (store, close): ``store.get(key)`` blocks until the key is set.
    """
    if options.get("store") is not None:
        return TorchStoreAdapter(options["store"], timeout), lambda: None
    host = str(options.get("master_addr") or os.environ.get("MASTER_ADDR") or "127.0.0.1")
    port = options.get("master_port") or os.environ.get("MASTER_PORT")
    if port in (None, ""):
        raise BadArgument("zmq rendezvous needs master_port (or MASTER_PORT) when no store is given")
    port = int(port)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return TorchStoreAdapter(_torch_agent_store(host, port, timeout), timeout), lambda: None
    if rank == 0:
        server = StoreServer(ctx, port, credentials, zap)
        return server.store, server.close
    client = StoreClient(ctx, host, port, credentials, timeout)
    return client, client.close


# ---------------------------------------------------------------------------
# Addresses


def _interface_address(ifname: str) -> str:
    """The IPv4 address of interface ``ifname``."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise BadArgument(f"network interface {ifname!r} has no IPv4 address here: {exc}") from exc
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str:
    """The local address the kernel would use to reach ``host``."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError as exc:
        raise BadArgument(f"no route to MASTER_ADDR {host!r}: {exc}") from exc


def choose_address(options: dict[str, Any]) -> str:
    """The address this rank listens on (see the module docstring)."""
    if options.get("addr"):
        return str(options["addr"])
    ifname = config.option(options, "ifname", "SOCKET_IFNAME")
    if ifname:
        return _interface_address(str(ifname))
    return _route_to(str(options.get("master_addr") or os.environ.get("MASTER_ADDR") or "127.0.0.1"))


def exchange_endpoints(store: Any, prefix: str, rank: int, size: int, endpoint: str,
                       timeout: float) -> list[str]:
    """Publish this rank's endpoint and read every rank's.

    Returns:
        Endpoints in rank order.
    """
    store.set(f"{prefix}/endpoint/{rank}", endpoint.encode())
    deadline = time.monotonic() + timeout
    endpoints = []
    for r in range(size):
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"rendezvous: rank {r} did not publish its address within {timeout:.3g}s")
        endpoints.append(wait_for_key(store, f"{prefix}/endpoint/{r}", left).decode())
    return endpoints


@dataclass(frozen=True)
class PeerInfo:
    """Where a rank listens and who it is (for errors that name it)."""

    rank: int
    endpoint: str
    host: str = ""
    pid: int = 0

    @property
    def address(self) -> str:
        """The IP address of ``endpoint`` (``tcp://ip:port``), or ""."""
        where = self.endpoint.removeprefix("tcp://").rpartition(":")[0]
        return where.strip("[]")

    def name(self, pid: bool = True) -> str:
        """``rank 2 (host h, pid 123)``; without ``pid``, ``rank 2 (host h at 10.0.0.3)``."""
        host = self.host or "unknown host"
        if pid and self.pid:
            return f"rank {self.rank} (host {host}, pid {self.pid})"
        at = f" at {self.address}" if self.address and not pid else ""
        return f"rank {self.rank} (host {host}{at})"

    def encode(self) -> bytes:
        """``endpoint``, host and pid, one a line (what the store holds)."""
        return f"{self.endpoint}\n{self.host}\n{self.pid}".encode()

    @classmethod
    def decode(cls, rank: int, value: bytes) -> "PeerInfo":
        """The inverse of :meth:`encode` (a bare endpoint is accepted too)."""
        parts = value.decode(errors="replace").split("\n")
        pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0
        return cls(rank, parts[0], parts[1] if len(parts) > 1 else "", pid)


def exchange_peers(store: Any, prefix: str, rank: int, size: int, endpoint: str,
                   timeout: float) -> list[PeerInfo]:
    """Publish this rank's endpoint, host name and pid and read every rank's.

    Returns:
        Every rank's :class:`PeerInfo`, in rank order.

    Raises:
        CollectiveTimeout: a rank did not publish in time.
    """
    mine = PeerInfo(rank, endpoint, socket.gethostname(), os.getpid())
    store.set(f"{prefix}/peer/{rank}", mine.encode())
    deadline = time.monotonic() + timeout
    peers = []
    for r in range(size):
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"rendezvous: rank {r} did not publish its address within {timeout:.3g}s")
        peers.append(PeerInfo.decode(r, wait_for_key(store, f"{prefix}/peer/{r}", left)))
    return peers


def wait_for_key(store: Any, key: str, timeout: float) -> bytes:
    """Block until ``key`` is set in ``store`` (at most ``timeout`` seconds) and return its value."""
    try:
        return store.get(key, timeout=timeout)
    except TypeError:  # stores whose get takes only the key
        return bytes(store.get(key))
