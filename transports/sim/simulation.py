"""``simulate``: one collective with one algorithm on p virtual ranks.

Every rank runs the registered algorithm in its own thread of this process
over a :class:`~.transport.SimTransport` of one :class:`~.world.SimWorld`,
on small random integers (so that every reduction order gives numpy's
exact answer); the result holds the virtual time, every rank's output and
numpy's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives.context import SEGMENT_BYTES, CallContext
from collectives.errors import BadArgument, MismatchedCollective, PeerLost
from collectives.ops import Op, get_op
from collectives.registry import algorithm as lookup_algorithm

from .network import SimParams
from .transport import SimTransport
from .world import SimWorld

__all__ = ["simulate", "SimResult"]

#: Per-thread stack size of the virtual ranks (a thousand ranks fit easily).
_STACK_BYTES = 512 * 1024


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

    def __repr__(self) -> str:  # not every rank's array
        ranks = len(self.results)
        return (f"SimResult(time={self.time:.6g}, ranks={ranks}, correct={self.correct()}, "
                f"last_finish={max(self.finish, default=0.0):.6g}, switches={self.switches})")

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
