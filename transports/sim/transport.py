"""The ``sim`` transport: one virtual rank of a :class:`~.world.SimWorld`.

It opens through ``init(rank, size, transport="sim")`` from ``size``
threads of one process (ranks of the same ``job`` share a world). A
reduction of n bytes (through an op from :func:`charged_op`) advances the
reducing rank's clock by ``n * gamma``. Local copies cost nothing (the
cost models' memory term is zero for the simulator).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from collectives.errors import PeerLost
from collectives.ops import Op, get_op
from collectives.signature import NO_SIG, Sig
from collectives.transport import Request, Transport

from .network import SimParams
from .world import SimRequest, SimWorld

__all__ = ["SimTransport", "charged_op"]


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
        if all(type(r) is SimRequest for r in requests):
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
