"""The ``sim`` transport: p virtual ranks in one process on a virtual clock.

The real algorithm code runs, one thread per rank, but only one rank runs at
a time: the one with the earliest virtual clock (a conservative
discrete-event simulation). Every message is scheduled when it is posted, in
virtual-time order, so the result is deterministic.

Cost model (seconds; ``alpha``, ``beta`` per byte, ``gamma`` per byte reduced):

* a message of n bytes occupies the network resources on its path for
  ``alpha + n * beta`` from ``start = max(post time, every resource free)``;
  it arrives, and the send completes, at ``start + alpha + n * beta``
  (eager: the transfer does not wait for the receive to be posted);
* a receive completes at ``max(arrival, post time of the receive)``;
* a rank that waits jumps its clock to the completion time of what it waits
  for; a reduction of n bytes (through an op from :func:`charged_op`)
  advances the reducing rank's clock by ``n * gamma``. Local copies cost
  nothing (the cost models' memory term is zero for the simulator).

Networks (``topology``):

* ``"full"``: fully connected; each rank one full-duplex link (an outgoing
  and an incoming port, each busy for one message at a time);
* ``"switch"``: a single shared (half-duplex) switch port per node: a
  node's sends and receives take turns on it;
* ``"mesh"``: a 2-D mesh (rows x cols as square as possible), dimension-order
  (X then Y) routing; a message holds every directed link on its path plus
  the two end ports, and pays ``hop_latency`` per hop.

Python API: :func:`simulate` runs one collective with one algorithm and
returns the virtual time and every rank's result. The transport also opens
through ``init(rank, size, transport="sim")`` from ``size`` threads of one
process (ranks of the same ``job`` share a world).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from collectives.context import SEGMENT_BYTES, CallContext
from collectives.errors import BadArgument, MismatchedCollective, PeerLost
from collectives.ops import Op, get_op
from collectives.registry import algorithm as lookup_algorithm
from collectives import signature
from collectives.signature import NO_SIG, Sig
from collectives.transport import Request, Transport

__all__ = ["SimTransport", "SimParams", "SimWorld", "simulate", "SimResult", "charged_op", "TOPOLOGIES"]

TOPOLOGIES = ("full", "switch", "mesh")
#: Per-thread stack size of the virtual ranks (a thousand ranks fit easily).
_STACK_BYTES = 512 * 1024


@dataclass(frozen=True)
class SimParams:
    """Network and reduction costs of a simulated machine.

    Attributes:
        alpha: seconds per message.
        beta: seconds per byte sent.
        gamma: seconds per byte reduced.
        hop_latency: extra seconds per hop on the mesh.
    """

    alpha: float = 2e-6
    beta: float = 1e-10
    gamma: float = 2.5e-10
    hop_latency: float = 0.0


# ------------------------------------------------------------------ networks


class _Network:
    """Resources (ports, links) and their busy-until times."""

    def __init__(self, size: int, params: SimParams, topology: str) -> None:
        if topology not in TOPOLOGIES:
            raise BadArgument(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
        self.params = params
        self.topology = topology
        self.free: dict[Any, float] = {}
        self.cols = _mesh_cols(size)

    def _path(self, src: int, dst: int) -> tuple[list[Any], int]:
        """(resources held, hops) of a message from src to dst."""
        if self.topology == "full":
            return [("out", src), ("in", dst)], 1
        if self.topology == "switch":
            return [("port", src), ("port", dst)], 1
        res: list[Any] = [("out", src), ("in", dst)]
        (r0, c0), (r1, c1) = divmod(src, self.cols), divmod(dst, self.cols)
        r, c = r0, c0
        while c != c1:
            nc = c + (1 if c1 > c else -1)
            res.append(("link", r, c, r, nc))
            c = nc
        while r != r1:
            nr = r + (1 if r1 > r else -1)
            res.append(("link", r, c, nr, c))
            r = nr
        return res, max(len(res) - 2, 1)

    def schedule(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """Reserve the path of one message posted at ``now``; return its arrival time."""
        if src == dst:
            return now
        res, hops = self._path(src, dst)
        start = max([now] + [self.free.get(r, 0.0) for r in res])
        p = self.params
        end = start + p.alpha + nbytes * p.beta + (hops - 1) * p.hop_latency
        for r in res:
            self.free[r] = end
        return end


def _mesh_cols(size: int) -> int:
    """Columns of the most nearly square mesh with ``size`` nodes (rows * cols >= size)."""
    return max(1, math.ceil(math.sqrt(size)))


# ------------------------------------------------------------------ requests


class _SimRequest(Request):
    """A send or receive; ``done_at`` is its completion time once known."""

    __slots__ = ("world", "rank", "done_at", "buf")

    def __init__(self, world: "SimWorld", rank: int, buf: np.ndarray | None) -> None:
        self.world, self.rank, self.buf = world, rank, buf
        self.done_at: float | None = None

    def wait(self, timeout: float | None = None) -> None:
        self.world.wait(self.rank, (self,))

    def test(self) -> bool:
        self.world.check_error()
        return self.done_at is not None and self.done_at <= self.world.clock[self.rank]


class _Message:
    __slots__ = ("data", "arrival", "sig")

    def __init__(self, data: np.ndarray, arrival: float, sig: Sig) -> None:
        self.data, self.arrival, self.sig = data, arrival, sig


class _Posted:
    __slots__ = ("req", "posted_at", "sig", "src")

    def __init__(self, req: _SimRequest, posted_at: float, sig: Sig, src: int) -> None:
        self.req, self.posted_at, self.sig, self.src = req, posted_at, sig, src


# --------------------------------------------------------------------- world


class SimWorld:
    """The virtual machine: clocks, the scheduler, the matching queues and the network.

    Exactly one rank thread runs at a time; a rank that waits hands the
    baton to the rank with the earliest wake-up time (ties broken by order
    of arrival in the queue).
    """

    def __init__(self, size: int, params: SimParams | None = None, topology: str = "full") -> None:
        self.size = size
        self.params = params or SimParams()
        self.net = _Network(size, self.params, topology)
        self.clock = [0.0] * size
        # One binary semaphore per rank: released to hand the rank the baton.
        self._wake = [threading.Lock() for _ in range(size)]
        for lock in self._wake:
            lock.acquire()
        self._wake_at: list[float] = [0.0] * size
        self._heap: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self._waiting: list[Sequence[_SimRequest] | None] = [None] * size
        self._done = [False] * size
        self._recvs: dict[tuple[int, int, int], deque[_Posted]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[_Message]] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._joined = 0
        self._started = False
        self.switches = 0

    # -- scheduling

    def start(self) -> None:
        """Queue every rank at time 0 and let the first one run."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for r in range(self.size):
            self._push(r, 0.0)
        self._handoff(None)

    def join(self) -> None:
        """Called once per rank thread before its first operation: the world
        starts when every rank has joined; then this rank waits for its turn."""
        with self._lock:
            self._joined += 1
            last = self._joined == self.size
        if last:
            self.start()

    def enter(self, rank: int) -> None:
        """Block the calling rank thread until the scheduler gives it the baton."""
        self._wake[rank].acquire()
        self.clock[rank] = max(self.clock[rank], self._wake_at[rank])

    def _push(self, rank: int, at: float) -> None:
        self._wake_at[rank] = at
        heapq.heappush(self._heap, (at, next(self._seq), rank))

    def _handoff(self, me: int | None) -> bool:
        """Give the baton to the earliest queued rank. Returns True if that is ``me``."""
        if not self._heap:
            self._deadlock()
            return False
        _, _, nxt = heapq.heappop(self._heap)
        if nxt == me:
            self.clock[me] = max(self.clock[me], self._wake_at[me])
            return True
        self.switches += 1
        self._wake[nxt].release()
        return False

    def _deadlock(self) -> None:
        blocked = [r for r in range(self.size) if not self._done[r]]
        if not blocked:
            return
        if self._error is None:
            self._error = MismatchedCollective(
                f"simulated ranks {blocked[:8]}{'...' if len(blocked) > 8 else ''} wait for "
                "messages nobody sends (mismatched collective or a failed rank)")
        for r in blocked:
            self._wake_at[r] = self.clock[r]
            if self._wake[r].locked():
                try:
                    self._wake[r].release()
                except RuntimeError:
                    pass

    def _yield(self, rank: int, at: float) -> None:
        """Sleep the running rank until virtual time ``at``."""
        if not self._heap or at <= self._heap[0][0]:
            self.clock[rank] = at  # nobody can run earlier: no switch needed
            return
        self._push(rank, at)
        if not self._handoff(rank):
            self.enter(rank)
            self.check_error()

    def check_error(self) -> None:
        if self._error is not None:
            raise self._error

    def charge(self, rank: int, seconds: float) -> None:
        """Advance ``rank``'s clock by ``seconds`` of local work."""
        if seconds > 0:
            self._yield(rank, self.clock[rank] + seconds)

    def finish(self, rank: int, error: BaseException | None = None) -> None:
        """The rank's thread is done (with ``error`` if it failed)."""
        self._done[rank] = True
        if error is not None and self._error is None:
            self._error = PeerLost(f"simulated rank {rank} failed: {type(error).__name__}: {error}", rank)
        if all(self._done):
            return
        if self._error is not None:
            self._deadlock()
            return
        self._handoff(None)

    # -- messages

    def isend(self, src: int, buf: np.ndarray, dst: int, tag: int, sig: Sig = NO_SIG) -> _SimRequest:
        self.check_error()
        now = self.clock[src]
        arrival = self.net.schedule(src, dst, buf.nbytes, now)
        req = _SimRequest(self, src, None)
        req.done_at = arrival
        key = (src, dst, tag)
        posted = self._recvs.get(key)
        if posted:
            self._deliver(posted.popleft(), buf, arrival, sig)
        else:
            self._unexpected.setdefault(key, deque()).append(_Message(buf.copy(), arrival, sig))
        return req

    def irecv(self, dst: int, buf: np.ndarray, src: int, tag: int, sig: Sig = NO_SIG) -> _SimRequest:
        self.check_error()
        req = _SimRequest(self, dst, buf)
        posted = _Posted(req, self.clock[dst], sig, src)
        key = (src, dst, tag)
        queue = self._unexpected.get(key)
        if queue:
            msg = queue.popleft()
            self._deliver(posted, msg.data, msg.arrival, msg.sig)
        else:
            self._recvs.setdefault(key, deque()).append(posted)
        return req

    def _deliver(self, posted: _Posted, data: np.ndarray, arrival: float, sig: Sig) -> None:
        req = posted.req
        if sig != posted.sig:
            err = signature.check_message(posted.sig, sig, req.rank, posted.src)
            if err is not None:
                self._error = err
                return
        if data.nbytes != req.buf.nbytes:
            self._error = MismatchedCollective(
                f"simulated rank {req.rank} posted a receive of {req.buf.nbytes} bytes, "
                f"the message has {data.nbytes}")
            return
        if data.nbytes:
            req.buf.view(np.uint8).reshape(-1)[:] = data.view(np.uint8).reshape(-1)
        req.done_at = max(arrival, posted.posted_at)
        req.buf = None
        waiting = self._waiting[req.rank]
        if waiting is not None and all(r.done_at is not None for r in waiting):
            self._waiting[req.rank] = None
            self._push(req.rank, max(r.done_at for r in waiting))

    def wait(self, rank: int, reqs: Sequence[_SimRequest]) -> None:
        """Block ``rank`` until every request completes (in virtual time)."""
        self.check_error()
        if any(r.done_at is None for r in reqs):
            self._waiting[rank] = reqs
            self._handoff(rank)  # never ``rank`` itself: it is not queued
            self.enter(rank)
            self.check_error()
            return
        at = max((r.done_at for r in reqs), default=self.clock[rank])
        if at > self.clock[rank]:
            self._yield(rank, at)

    @property
    def elapsed(self) -> float:
        """Virtual time at which the last rank finished."""
        return max(self.clock)


# ----------------------------------------------------------------- transport


class SimTransport(Transport):
    """One virtual rank of a :class:`SimWorld`.

    Options of :meth:`open`: ``alpha``, ``beta``, ``gamma``, ``hop_latency``
    (see :class:`SimParams`) and ``topology``.
    """

    name: ClassVar[str] = "sim"
    capabilities: ClassVar[frozenset[str]] = frozenset()
    released_on_delivery = True  # see Transport
    _worlds: ClassVar[dict[str, SimWorld]] = {}
    _worlds_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, world: SimWorld, rank: int, timeout: float = 600.0) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.timeout = timeout
        self._joined = False

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "SimTransport":
        keys = ("alpha", "beta", "gamma", "hop_latency")
        params = SimParams(**{k: float(options[k]) for k in keys if k in options})
        with cls._worlds_lock:
            world = cls._worlds.get(job)
            if world is None or world.size != size:
                world = cls._worlds[job] = SimWorld(size, params, options.get("topology", "full"))
        return cls(world, rank, timeout)

    def _ready(self) -> None:
        if not self._joined:
            self._joined = True
            self.world.join()
            self.world.enter(self.rank)

    @property
    def now(self) -> float:
        """This rank's virtual clock, seconds."""
        return self.world.clock[self.rank]

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        self._ready()
        return self.world.isend(self.rank, buf, peer, tag, sig)

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        self._ready()
        return self.world.irecv(self.rank, buf, peer, tag, sig)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        self._ready()
        if all(type(r) is _SimRequest for r in requests):
            self.world.wait(self.rank, list(requests))
            return
        for r in requests:  # e.g. receives that reduce on completion
            r.wait(timeout)

    def charge(self, seconds: float) -> None:
        """Advance this rank's clock by ``seconds`` of local work."""
        self._ready()
        self.world.charge(self.rank, seconds)

    def wrap_op(self, op: Op) -> Op:
        """``op`` charging ``gamma`` per byte reduced to this rank's clock."""
        return charged_op(op, self.world.params.gamma, self.charge)

    def abort(self, reason: str) -> None:
        if self.world._error is None:
            self.world._error = PeerLost(reason, self.rank)

    def close(self) -> None:
        if self._joined and not self.world._done[self.rank]:
            self._joined = False
            self.world.finish(self.rank)


# ------------------------------------------------------------------ charging


@dataclass(frozen=True)
class _ChargedOp(Op):
    """An :class:`Op` whose reductions advance a virtual clock."""

    gamma: float = 0.0
    charge: Callable[[float], None] = field(default=lambda s: None, compare=False)

    def reduce(self, dst: np.ndarray, src: np.ndarray) -> None:
        super().reduce(dst, src)
        self.charge(dst.nbytes * self.gamma)

    def reduce_into(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        super().reduce_into(out, a, b)
        self.charge(out.nbytes * self.gamma)

    def reduce_many(self, dst: np.ndarray, srcs: Sequence[np.ndarray],
                    scratch: np.ndarray | None = None) -> None:
        super().reduce_many(dst, srcs, scratch)
        self.charge(dst.nbytes * self.gamma * max(len(srcs) - 1, 0))


def charged_op(op: Op | str, gamma: float, charge: Callable[[float], None]) -> Op:
    """A copy of ``op`` that calls ``charge(n * gamma)`` after reducing n bytes
    (``k - 1`` times n for ``reduce_many`` over k sources)."""
    op = get_op(op)
    return _ChargedOp(op.name, op.ufunc, op.kinds, gamma, charge)


# ------------------------------------------------------------------ simulate


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        time: virtual seconds until the last rank finished.
        results: per rank, the output array (None where the collective has none).
        expected: per rank, numpy's answer (None where there is none).
        finish: per rank, its virtual finishing time.
        switches: thread hand-offs the simulation took.
    """

    time: float
    results: list[np.ndarray | None]
    expected: list[np.ndarray | None]
    finish: list[float]
    switches: int

    def __iter__(self):  # (time, results) unpacking
        return iter((self.time, self.results))

    def correct(self) -> bool:
        """True when every rank's output equals numpy's."""
        return all(np.array_equal(r, e) for r, e in zip(self.results, self.expected)
                   if e is not None)


def _collective_setup(collective: str, p: int, count: int, dtype: np.dtype, root: int,
                      op: Op, rng: np.random.Generator):
    """Per-rank argument tuples, output arrays and numpy's expected outputs.

    ``count`` is the element count the library's size convention uses: the
    buffer (bcast, reduce, allreduce) or the whole of the p blocks (scatter,
    gather, allgather, reduce_scatter, alltoall per rank).
    """
    def data(n: int) -> np.ndarray:
        return rng.integers(0, 8, n).astype(dtype)

    block = count // p if collective in ("scatter", "gather", "allgather", "reduce_scatter", "alltoall") else count
    counts = [block] * p
    if collective == "bcast":
        src = data(count)
        bufs = [src.copy() if r == root else np.zeros(count, dtype) for r in range(p)]
        return [(b, root) for b in bufs], bufs, [src] * p
    if collective in ("reduce", "allreduce"):
        bufs = [data(count) for _ in range(p)]
        total = op.ufunc.reduce(np.stack(bufs), axis=0).astype(dtype) if p > 1 else bufs[0].copy()
        outs = [b.copy() for b in bufs]
        if collective == "allreduce":
            return [(o, op) for o in outs], outs, [total] * p
        expected = [total if r == root else bufs[r] for r in range(p)]
        return [(o, root, op) for o in outs], outs, expected
    if collective == "scatter":
        src = data(block * p)
        recvs = [np.zeros(block, dtype) for _ in range(p)]
        args = [(src if r == root else None, recvs[r], root, counts) for r in range(p)]
        return args, recvs, [src[r * block:(r + 1) * block] for r in range(p)]
    if collective == "gather":
        sends = [data(block) for _ in range(p)]
        recvs = [np.zeros(block * p, dtype) if r == root else None for r in range(p)]
        expected = [np.concatenate(sends) if r == root else None for r in range(p)]
        return [(sends[r], recvs[r], root, counts) for r in range(p)], recvs, expected
    if collective == "allgather":
        full = data(block * p)
        bufs = [np.zeros(block * p, dtype) for _ in range(p)]
        for r, b in enumerate(bufs):
            b[r * block:(r + 1) * block] = full[r * block:(r + 1) * block]
        return [(b, counts) for b in bufs], bufs, [full] * p
    if collective == "reduce_scatter":
        sends = [data(block * p) for _ in range(p)]
        total = op.ufunc.reduce(np.stack(sends), axis=0).astype(dtype)
        recvs = [np.zeros(block, dtype) for _ in range(p)]
        expected = [total[r * block:(r + 1) * block] for r in range(p)]
        return [(sends[r], recvs[r], counts, op) for r in range(p)], recvs, expected
    if collective == "alltoall":
        sends = [data(block * p) for _ in range(p)]
        recvs = [np.zeros(block * p, dtype) for _ in range(p)]
        expected = [np.concatenate([sends[j][r * block:(r + 1) * block] for j in range(p)]) for r in range(p)]
        return [(sends[r], recvs[r]) for r in range(p)], recvs, expected
    if collective == "barrier":
        return [()] * p, [None] * p, [None] * p
    raise BadArgument(f"unknown collective {collective!r}")


def simulate(collective: str, algorithm: str, p: int, nbytes: int,
             params: SimParams | None = None, topology: str = "full", *,
             dtype: Any = np.float64, root: int = 0, op: str = "sum",
             segment_bytes: int = SEGMENT_BYTES, seed: int = 0, timeout: float = 600.0) -> SimResult:
    """Run ``algorithm`` of ``collective`` on ``p`` virtual ranks.

    Args:
        collective: ``bcast``, ``scatter``, ..., ``barrier``.
        algorithm: a registered algorithm name (one the sim transport can run).
        p: number of virtual ranks.
        nbytes: message size with the library's convention (the buffer, or
            the p blocks together for scatter, gather, allgather,
            reduce_scatter and alltoall); rounded down to whole elements
            (and to a multiple of p elements for the blocked collectives).
        params: network and reduction costs.
        topology: ``"full"``, ``"switch"`` or ``"mesh"``.
        dtype: element type of the data (small random integers, so that
            every reduction order gives numpy's exact answer).
        root: root of rooted collectives.
        op: reduction op name.
        segment_bytes: pipeline segment size the algorithms use.
        seed: seed of the random data.
        timeout: real-time deadline of the run, seconds.

    Returns:
        A :class:`SimResult` (unpacks as ``(time, results)``).
    """
    import time as _time

    algo = lookup_algorithm(collective, algorithm)
    if algo.needs - SimTransport.capabilities:
        raise BadArgument(f"{collective}/{algorithm} needs {sorted(algo.needs)}, which the sim transport lacks")
    params = params or SimParams()
    dtype = np.dtype(dtype)
    world = SimWorld(p, params, topology)
    base_op = get_op(op)
    transports = [SimTransport(world, r, timeout) for r in range(p)]
    count = nbytes // dtype.itemsize
    blocked = collective in ("scatter", "gather", "allgather", "reduce_scatter", "alltoall")
    if blocked:
        count -= count % p
    args, outs, expected = _collective_setup(collective, p, count, dtype, root, base_op,
                                             np.random.default_rng(seed))
    deadline = _time.monotonic() + timeout
    errors: list[BaseException | None] = [None] * p

    def run_rank(r: int) -> None:
        tr = transports[r]
        world.enter(r)
        tr._joined = True
        err = None
        try:
            ctx = CallContext(tr, 1, deadline, segment_bytes)
            call_args = tuple(tr.wrap_op(a) if isinstance(a, Op) else a for a in args[r])
            algo.func(ctx, *call_args)
        except BaseException as exc:  # reported to the caller below
            err = exc
        errors[r] = err
        world.finish(r, err)

    previous = threading.stack_size(_STACK_BYTES)
    try:
        threads = [threading.Thread(target=run_rank, args=(r,), daemon=True, name=f"sim-rank{r}")
                   for r in range(p)]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(previous)
    world.start()
    for t in threads:
        t.join(max(deadline - _time.monotonic(), 0.001))
    if any(t.is_alive() for t in threads):
        world._error = world._error or PeerLost("simulation ran past its real-time deadline")
        world._deadlock()
        raise TimeoutError(f"simulation of {collective}/{algorithm} on {p} ranks ran past {timeout} s")
    first = next((e for e in errors if e is not None and not isinstance(e, (PeerLost, MismatchedCollective))),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return SimResult(world.elapsed, outs, expected, list(world.clock), world.switches)
