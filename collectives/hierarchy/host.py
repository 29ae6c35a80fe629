"""The ranks of one host: the intra-host phases of hierarchical calls.

:class:`SharedHost` runs them as calls of a shared-memory communicator among
the host's ranks (:class:`HostCommunicator`, whose window and compiled calls
serve them); :class:`SoloHost` is a host with one rank, where they are
copies. Every phase runs within the hierarchical call's deadline, and its
errors are said in world terms: a shared-memory error names local ranks,
so it is prefixed with the host and the world ranks they are; an abort that
came through the host's shared memory names the world rank that aborted.

The host communicator aborts nothing by itself when one of its calls
fails: the hierarchical communicator aborts the world and every host with
the call's own error (see :meth:`SharedHost.abort`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

import numpy as np

from .. import compiled
from ..communicator import Communicator
from ..errors import BadArgument, CollectiveError, PeerLost
from .topology import Topology

__all__ = ["HostCommunicator", "SharedHost", "SoloHost"]

_TIMED_OUT = re.compile(r" \(timed out after [^)]*\)$")


class HostCommunicator(Communicator):
    """The shared-memory communicator of one host's ranks, inside a
    hierarchical communicator: its failures leave the aborting to it."""

    def _tell_abort(self, reason: str, seq: int) -> None:
        """Nothing: the hierarchical communicator aborts every part with the call's own error."""


class _Phases:
    """What both kinds of host share: the deadline of the current call."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.deadline = time.monotonic()

    def left(self) -> float:
        """Seconds left to the current call (a sliver when none is)."""
        return max(self.deadline - time.monotonic(), 1e-6)


class SoloHost(_Phases):
    """A host with one rank: every intra-host phase is a copy (or nothing)."""

    rank, size = 0, 1

    def begin(self, deadline: float) -> None:
        self.deadline = deadline

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        compiled.copy(recv, send)
        return recv

    def allgatherv(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int]) -> None:
        if send is not None:
            compiled.copy(recv[:counts[0]], send)

    def reduce_scatterv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: Any) -> None:
        compiled.copy(recv, send[:counts[0]])

    def bcast(self, buf: np.ndarray, root: int) -> None:
        pass

    def gatherv(self, send: np.ndarray, recv: np.ndarray | None, counts: Sequence[int], root: int) -> None:
        compiled.copy(recv[:counts[0]], send)

    def scatterv(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], root: int) -> None:
        compiled.copy(recv, send[:counts[0]])

    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> None:
        compiled.copy(recv, send)

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


class SharedHost(_Phases):
    """The host's ranks over shared memory (a :class:`HostCommunicator`)."""

    def __init__(self, topo: Topology, comm: HostCommunicator) -> None:
        super().__init__(topo)
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._first = 1  # the host communicator's first call of the current hierarchical call

    def begin(self, deadline: float) -> None:
        """A hierarchical call starts: its phases end by ``deadline``."""
        self.deadline = deadline
        self._first = self.comm._seq + 1

    def _run(self, what: str, method, *args: Any, **kw: Any) -> Any:
        try:
            return method(*args, timeout=self.left(), **kw)
        except CollectiveError as exc:
            raise self.translate(exc, what) from None

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        return self._run("allgather", self.comm.allgather, send, recv)

    def allgatherv(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int]) -> None:
        self._run("allgatherv", self.comm.allgatherv, send, recv, counts)

    def reduce_scatterv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: Any) -> None:
        self._run("reduce_scatterv", self.comm.reduce_scatterv, send, recv, counts, op)

    def bcast(self, buf: np.ndarray, root: int) -> None:
        self._run("bcast", self.comm.bcast, buf, root)

    def gatherv(self, send: np.ndarray, recv: np.ndarray | None, counts: Sequence[int], root: int) -> None:
        self._run("gatherv", self.comm.gatherv, send, recv, counts, root)

    def scatterv(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], root: int) -> None:
        self._run("scatterv", self.comm.scatterv, send, recv, counts, root)

    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run("alltoall", self.comm.alltoall, send, recv)

    # ------------------------------------------------------------- failures

    def world(self, local: int | None) -> int | None:
        """The world rank of local rank ``local``."""
        return None if local is None else self.topo.local_ranks[local]

    def translate(self, exc: CollectiveError, what: str) -> CollectiveError:
        """``exc`` from the host communicator, said in world terms (see the module docstring)."""
        if isinstance(exc, BadArgument) and exc.origin is None:  # our own arguments: a bug, end the call everywhere
            return PeerLost(f"the host's {what} refused its arguments: {exc}", self.topo.rank)
        text = str(exc.args[0]) if exc.args else str(exc)
        if exc.origin is not None:  # an abort that came through the host's shared memory
            origin = self.world(exc.origin)
            said = text.partition(f"rank {exc.origin} aborted: ")[2] or text
            new = type(exc)(f"rank {origin} aborted: {said}") if not isinstance(exc, PeerLost) \
                else PeerLost(f"rank {origin} aborted: {said}", origin)
            new.origin = origin
            return new
        t = self.topo
        where = (f"on host {t.names[t.node]} (node {t.node}; its local ranks "
                 + ", ".join(f"{i} = rank {r}" for i, r in enumerate(t.local_ranks)) + ")")
        own = f"rank {self.rank}, "
        inner = text[len(own):] if text.startswith(own) else text
        inner = _TIMED_OUT.sub("", inner)  # the hierarchical call says how long it waited
        said = f"{where}, in the host's own {inner} (local ranks and call numbers)"
        return PeerLost(said, self.world(exc.peer)) if isinstance(exc, PeerLost) else type(exc)(said)

    def abort(self, reason: str) -> None:
        """Abort the host's shared memory with ``reason`` (the hierarchical call's
        error): every local rank still in this call raises it."""
        try:
            self.comm.transport.abort(reason, self._first)
        except Exception:
            pass

    def close(self) -> None:
        self.comm.close()
