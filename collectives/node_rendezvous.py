"""The launchers' rendezvous: node 0's ``collectives run`` meets the others'.

Node 0's launcher listens on ``--master-port`` (every interface); the
launcher of every other node connects to ``--master-addr:--master-port``
(retrying until node 0 is up) and says its node rank, host name and number
of ranks (nodes may have different numbers). Once every node has joined,
node 0 assigns global ranks in node order (node 0's first, then node 1's,
...) and sends each node the job id, the ranks of every node, the port of
the transports' own rendezvous (another port, free on node 0) and node 0's
address as the other nodes reach it. The connections stay open while the
job runs: :mod:`collectives.multinode` carries failures and the job's end
over them.

Messages are JSON objects, one a line (:class:`~collectives.node_link.Link`):

======  =======  ==========================================================
from    type     fields
======  =======  ==========================================================
node 0  hello    version, nonce, auth (whether node 0 has a given secret)
node r  join     node_rank, nnodes, host, nprocs, nonce, auth, mac
node 0  waiting  missing: the node ranks that have not joined yet
node 0  assign   job, counts, hosts, master_addr, master_port, secret, mac
node 0  error    message: this node is refused, or the rendezvous failed
======  =======  ==========================================================

The job secret. Given by the user (``COLLECTIVES_SECRET``, the same on every
node), it is never sent: each side proves it knows it. The joining node
sends HMAC-SHA256(secret, "join" + node 0's nonce + its join message), node
0 answers with HMAC-SHA256(secret, "assign" + the node's nonce + the
assignment): a stranger can neither join nor pose as node 0, and a recorded
exchange cannot be replayed (every connection has fresh nonces). Without
one, node 0 generates a secret and sends it in the assignment, in the
clear: whoever reads the rendezvous traffic can join the job's transports,
and whoever reaches the port first can join as a node.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .launcher import _say, _signal_name, free_port
from .node_link import POLL_SECONDS, Link, close_links

__all__ = ["NodeSpec", "Assignment", "RendezvousError", "serve", "join", "PROTOCOL"]

PROTOCOL = 1
#: the most ranks one node may ask for
MAX_NODE_RANKS = 1 << 16
#: seconds a new connection has to say which node it is
HANDSHAKE_SECONDS = 10.0
CONNECT_RETRY_SECONDS = 0.2

#: what ``stopped()`` returns: the signal the launcher got, or None
Stopped = Callable[[], "int | None"]


class RendezvousError(RuntimeError):
    """The nodes could not meet. ``status`` is the launcher's exit status:
    1, or 128 + N when the launcher got signal N while waiting."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class NodeSpec:
    """What one node's launcher was told (its options)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nprocs: int
    join_timeout: float
    secret: str | None = None  # given by the user (never sent); None: node 0 makes one
    host: str = field(default_factory=socket.gethostname)

    @property
    def where(self) -> str:
        """Node 0's launcher, ``host:port``."""
        return f"{self.master_addr}:{self.master_port}"


@dataclass(frozen=True)
class Assignment:
    """What node 0 decided: the job, and the ranks of every node."""

    job: str
    secret: str
    node_rank: int
    counts: tuple[int, ...]  # ranks of each node, in node order
    hosts: tuple[str, ...]  # each node's host name
    master_addr: str  # node 0's address as the other nodes reach it (the ranks' MASTER_ADDR)
    master_port: int  # the transports' rendezvous port on node 0 (the ranks' MASTER_PORT)

    @property
    def nnodes(self) -> int:
        return len(self.counts)

    @property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def nprocs(self) -> int:
        return self.counts[self.node_rank]

    @property
    def ranks(self) -> range:
        """This node's global ranks."""
        first = sum(self.counts[:self.node_rank])
        return range(first, first + self.nprocs)

    def node_name(self, node: int) -> str:
        """``node 1 (host h1)``."""
        return f"node {node} (host {self.hosts[node]})"

    def wire(self, node_rank: int, with_secret: bool) -> dict[str, Any]:
        """The ``assign`` message for node ``node_rank`` (without its mac)."""
        return {"type": "assign", "job": self.job, "node_rank": node_rank, "counts": list(self.counts),
                "hosts": list(self.hosts), "master_addr": self.master_addr, "master_port": self.master_port,
                "secret": self.secret if with_secret else None}


def _mac(secret: str, label: bytes, nonce: str, body: dict[str, Any]) -> str:
    """HMAC-SHA256 of ``body`` (canonical JSON, without ``mac``) after ``label`` and ``nonce``."""
    text = json.dumps({k: v for k, v in body.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    data = b"collectives-launcher/" + label + b"\0" + nonce.encode() + b"\0" + text.encode()
    return hmac.new(secret.encode(), data, hashlib.sha256).hexdigest()


def _check(stopped: Stopped, doing: str) -> None:
    sig = stopped()
    if sig:
        raise RendezvousError(f"got {_signal_name(sig)} while {doing}", 128 + sig)


def _nodes(ranks: list[int]) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(map(str, ranks))


# -- node 0 ---------------------------------------------------------------------------

def serve(spec: NodeSpec, stopped: Stopped) -> tuple[Assignment, list[Link]]:
    """Node 0: wait for every other node (at most ``spec.join_timeout``),
    assign the ranks and tell each node.

    Returns:
        The assignment and the link to each other node (node r at index r - 1).

    Raises:
        RendezvousError: a node did not join in time (naming every missing
            node), the port is taken, or the launcher got a stop signal.
    """
    listener = _listen(spec.master_port)
    gathering = _Gathering(spec)
    try:
        joined = gathering.run(listener, stopped)
    except RendezvousError as exc:
        gathering.fail(str(exc))
        raise
    finally:
        listener.close()
    links = [joined[r][0] for r in range(1, spec.nnodes)]
    infos = [joined[r][1] for r in range(1, spec.nnodes)]
    assignment = Assignment(secrets.token_hex(6), spec.secret or secrets.token_hex(16), 0,
                            (spec.nprocs, *(i["nprocs"] for i in infos)), (spec.host, *(i["host"] for i in infos)),
                            links[0].local_address(), free_port(""))
    for r, (link, info) in enumerate(zip(links, infos), start=1):
        message = assignment.wire(r, with_secret=spec.secret is None)
        if spec.secret is not None:
            message["mac"] = _mac(spec.secret, b"assign", info["nonce"], message)
        link.send(message)
    return assignment, links


def _listen(port: int) -> socket.socket:
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        return socket.create_server(("", port), backlog=64)
    except OSError as exc:
        raise RendezvousError(f"node 0 cannot listen on port {port}: {exc.strerror or exc} "
                              "(another job on --master-port?)") from None


class _Gathering:
    """Node 0's state while the nodes join."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.pending: dict[Link, tuple[str, float]] = {}  # link -> (our nonce, handshake deadline)
        self.joined: dict[int, tuple[Link, dict[str, Any]]] = {}
        self.notes: list[str] = []  # refused or lost connections, for the timeout's message

    def run(self, listener: socket.socket, stopped: Stopped) -> dict[int, tuple[Link, dict[str, Any]]]:
        deadline = time.monotonic() + self.spec.join_timeout
        while len(self.joined) < self.spec.nnodes - 1:
            _check(stopped, "waiting for the other nodes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(self._timeout_message())
            links = [*self.pending, *(link for link, _ in self.joined.values())]
            ready = select.select([listener, *links], [], [], min(left, 4 * POLL_SECONDS))[0]
            for item in ready:
                if item is listener:
                    self._accept(listener)
                else:
                    self._read(item)
            self._expire()
        return self.joined

    def missing(self) -> list[int]:
        return [r for r in range(1, self.spec.nnodes) if r not in self.joined]

    def _timeout_message(self) -> str:
        missing = self.missing()
        did = [0, *sorted(self.joined)]
        notes = "; ".join(self.notes[-5:])
        return (f"{_nodes(missing)} of {self.spec.nnodes} did not join within {self.spec.join_timeout:g}s "
                f"(node 0's launcher listened on port {self.spec.master_port}; {_nodes(did)} joined)"
                + (f"; {notes}" if notes else ""))

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        link = Link(sock, str(addr[0]).removeprefix("::ffff:"))
        nonce = secrets.token_hex(16)
        if link.send({"type": "hello", "version": PROTOCOL, "nonce": nonce, "auth": self.spec.secret is not None}):
            self.pending[link] = (nonce, time.monotonic() + HANDSHAKE_SECONDS)

    def _read(self, link: Link) -> None:
        messages = link.receive()
        if link in self.pending:
            nonce, _ = self.pending[link]
            joins = [m for m in messages if m.get("type") == "join"]
            if joins:
                del self.pending[link]
                self._admit(link, joins[0], nonce)
            elif link.closed:
                del self.pending[link]
                link.close()
            return
        if link.closed:  # a node that had joined left before the job started
            for r, (other, info) in list(self.joined.items()):
                if other is link:
                    del self.joined[r]
                    self.notes.append(f"node {r} (host {info['host']}, {link.peer}) joined, then left")
            link.close()
            self._announce()

    def _admit(self, link: Link, message: dict[str, Any], nonce: str) -> None:
        why = self._refusal(message, nonce)
        if why:
            link.send({"type": "error", "message": f"node 0 refused this node: {why}"})
            link.close()
            self.notes.append(f"refused a connection from {link.peer}: {why}")
            _say(f"refused a node's launcher from {link.peer}: {why}")
            return
        self.joined[message["node_rank"]] = (link, {"host": message["host"], "nprocs": message["nprocs"],
                                                    "nonce": message["nonce"]})
        self._announce()

    def _refusal(self, m: dict[str, Any], nonce: str) -> str | None:
        """Why the join ``m`` is refused, or None."""
        ints = [m.get(k) for k in ("node_rank", "nnodes", "nprocs")]
        if any(type(v) is not int for v in ints) or not all(isinstance(m.get(k), str) for k in ("host", "nonce")):
            return "a malformed join message"
        given = self.spec.secret is not None
        if bool(m.get("auth")) != given:
            return ("COLLECTIVES_SECRET is set on node 0 and not on this node" if given else
                    "COLLECTIVES_SECRET is set on this node and not on node 0") + \
                ": set the same secret on every node, or on none"
        if given and not hmac.compare_digest(str(m.get("mac")), _mac(self.spec.secret, b"join", nonce, m)):
            return "wrong job secret (COLLECTIVES_SECRET differs from node 0's)"
        r, n, k = ints
        if n != self.spec.nnodes:
            return f"this node was started with --nnodes {n}, node 0 with --nnodes {self.spec.nnodes}"
        if not 1 <= r < n:
            return f"node rank {r} is not one of 1 to {n - 1} (node 0 is this launcher)"
        if r in self.joined:
            link, info = self.joined[r]
            return f"node {r} has joined already (host {info['host']}, {link.peer})"
        if not 1 <= k <= MAX_NODE_RANKS:
            return f"{k} ranks: a node runs 1 to {MAX_NODE_RANKS}"
        return None

    def _announce(self) -> None:
        message = {"type": "waiting", "missing": self.missing()}
        for link, _ in self.joined.values():
            link.send(message)

    def _expire(self) -> None:
        now = time.monotonic()
        for link, (_, deadline) in list(self.pending.items()):
            if now > deadline:
                del self.pending[link]
                link.close()
                self.notes.append(f"a connection from {link.peer} did not say which node it is "
                                  f"within {HANDSHAKE_SECONDS:g}s")

    def fail(self, message: str) -> None:
        """Tell every node that joined that the rendezvous failed, and let go."""
        for link, _ in self.joined.values():
            link.send({"type": "error", "message": f"node 0: {message}"})
        close_links([link for link, _ in self.joined.values()], 1.0)
        for link in self.pending:
            link.close()


# -- the other nodes ------------------------------------------------------------------

def join(spec: NodeSpec, stopped: Stopped) -> tuple[Assignment, Link]:
    """Node ``spec.node_rank`` (not 0): join node 0's launcher, retrying until
    it is up, and wait for the assignment (at most ``spec.join_timeout`` in all).

    Raises:
        RendezvousError: node 0 did not answer, refused this node, or gave up
            waiting for other nodes (naming them); or a stop signal came.
    """
    deadline = time.monotonic() + spec.join_timeout
    link = _connect(spec, deadline, stopped)
    try:
        return _join_over(link, spec, deadline, stopped), link
    except BaseException:
        link.close()
        raise


def _connect(spec: NodeSpec, deadline: float, stopped: Stopped) -> Link:
    last = "no answer"
    while True:
        _check(stopped, f"connecting to node 0's launcher at {spec.where}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"node 0's launcher at {spec.where} did not answer within "
                                  f"{spec.join_timeout:g}s ({last})")
        try:
            sock = socket.create_connection((spec.master_addr, spec.master_port), timeout=min(left, 5.0))
        except OSError as exc:
            last = exc.strerror or str(exc)
        else:
            if sock.getsockname() != sock.getpeername():  # not TCP's self-connection to a free local port
                return Link(sock, spec.where)
            sock.close()
        time.sleep(min(CONNECT_RETRY_SECONDS, max(0.0, deadline - time.monotonic())))


def _join_over(link: Link, spec: NodeSpec, deadline: float, stopped: Stopped) -> Assignment:
    hello = _first_message(link, spec, deadline, stopped)
    if hello.get("type") == "error":
        raise RendezvousError(str(hello.get("message")))
    if hello.get("type") != "hello" or hello.get("version") != PROTOCOL:
        raise RendezvousError(f"what answers at {spec.where} is not a collectives launcher of this version "
                              f"(protocol {PROTOCOL}): run the same version on every node")
    given = spec.secret is not None
    if bool(hello.get("auth")) != given:
        raise RendezvousError(("COLLECTIVES_SECRET is set on this node and not on node 0" if given else
                               "COLLECTIVES_SECRET is set on node 0 and not on this node")
                              + ": set the same secret on every node, or on none")
    nonce = secrets.token_hex(16)
    message = {"type": "join", "node_rank": spec.node_rank, "nnodes": spec.nnodes, "host": spec.host,
               "nprocs": spec.nprocs, "nonce": nonce, "auth": given}
    if given:
        message["mac"] = _mac(spec.secret, b"join", str(hello.get("nonce")), message)
    link.send(message)
    missing = None
    while True:
        _check(stopped, f"waiting for node 0's launcher at {spec.where}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"the job did not start within {spec.join_timeout:g}s: {_nodes(missing)} of {spec.nnodes} "
                f"had not joined node 0's launcher at {spec.where}" if missing else
                f"node 0's launcher at {spec.where} did not assign the ranks within {spec.join_timeout:g}s")
        for m in link.wait(min(left, 4 * POLL_SECONDS)):
            if m.get("type") == "waiting" and isinstance(m.get("missing"), list):
                missing = m["missing"]
            elif m.get("type") == "error":
                raise RendezvousError(str(m.get("message")))
            elif m.get("type") == "assign":
                return _accept(m, spec, nonce)
        if link.closed:
            raise RendezvousError(f"node 0's launcher at {spec.where} closed the connection before the job "
                                  "started" + (" (after sending something that is not a message)"
                                               if link.garbled else ""))


def _first_message(link: Link, spec: NodeSpec, deadline: float, stopped: Stopped) -> dict[str, Any]:
    while True:
        _check(stopped, f"waiting for node 0's launcher at {spec.where}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"node 0's launcher at {spec.where} accepted the connection but said "
                                  f"nothing within {spec.join_timeout:g}s")
        messages = link.wait(min(left, 4 * POLL_SECONDS))
        if messages:
            return messages[0]
        if link.closed:
            raise RendezvousError(f"what answers at {spec.where} closed the connection at once: not a "
                                  "collectives launcher?")


def _accept(m: dict[str, Any], spec: NodeSpec, nonce: str) -> Assignment:
    """The assignment in ``m``, checked (and authenticated with a given secret)."""
    if spec.secret is not None and not hmac.compare_digest(str(m.get("mac")),
                                                           _mac(spec.secret, b"assign", nonce, m)):
        raise RendezvousError(f"the launcher at {spec.where} does not know this job's secret "
                              "(another job's node 0 on that port?)")
    counts, hosts = m.get("counts"), m.get("hosts")
    secret = spec.secret if spec.secret is not None else m.get("secret")
    ok = (isinstance(counts, list) and len(counts) == spec.nnodes and all(type(c) is int and c > 0 for c in counts)
          and isinstance(hosts, list) and len(hosts) == spec.nnodes and all(isinstance(h, str) for h in hosts)
          and counts[spec.node_rank] == spec.nprocs and m.get("node_rank") == spec.node_rank
          and isinstance(m.get("job"), str) and isinstance(m.get("master_addr"), str)
          and type(m.get("master_port")) is int and isinstance(secret, str) and secret)
    if not ok:
        raise RendezvousError(f"node 0's launcher at {spec.where} sent an assignment this launcher cannot use")
    return Assignment(m["job"], secret, spec.node_rank, tuple(counts), tuple(hosts), m["master_addr"],
                      m["master_port"])
