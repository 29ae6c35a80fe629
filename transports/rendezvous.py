"""Rendezvous for TCP transports: the key-value store ranks meet through.

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
errors name a peer by rank, host and pid rather than by address. Where a
rank listens: :mod:`.addresses`; how every socket proves it belongs to the
job: :mod:`.credentials` (both re-exported here). Nothing received is ever
unpickled: the store speaks in raw byte frames.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import zmq

from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout, TransportUnavailable

from .addresses import choose_address
from .credentials import JobCredentials, ZapHandler

__all__ = ["KeyValueStore", "JobCredentials", "ZapHandler", "StoreServer", "StoreClient",
           "LocalStore", "TorchStoreAdapter", "open_store", "choose_address", "exchange_endpoints",
           "exchange_peers", "PeerInfo", "wait_for_key"]

log = logging.getLogger("collectives.zmq")


class KeyValueStore(Protocol):
    """What rendezvous needs of a store."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


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
# Who listens where


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
