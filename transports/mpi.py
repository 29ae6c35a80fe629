"""MPI transport through mpi4py (the ``mpich`` wheel works; no system MPI needed).

Rank and size come from MPI itself, so ``init(transport="mpi")`` works under
``mpiexec -n 4 python script.py``. Point-to-point uses ``Isend``/``Irecv`` on
buffers (no pickling).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from collectives.errors import CollectiveTimeout, MismatchedCollective, PeerLost, TransportUnavailable
from collectives.transport import Request, Transport

__all__ = ["MpiTransport"]

_POLL_SPIN = 50


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - dependency
        raise TransportUnavailable(f"mpi4py cannot be imported: {exc}") from exc
    return MPI


class _MpiRequest(Request):
    __slots__ = ("_req", "_status", "_expect", "_peer", "_transport")

    def __init__(self, req, transport: "MpiTransport", expect: int | None, peer: int) -> None:
        self._req = req
        self._transport = transport
        self._expect = expect
        self._peer = peer
        self._status = None

    def _check(self, status) -> None:
        if self._expect is not None:
            got = status.Get_count(self._transport._MPI.BYTE)
            if got != self._expect:
                raise MismatchedCollective(
                    f"rank {self._transport.rank}: expected {self._expect} bytes from rank "
                    f"{self._peer}, got {got} (ranks disagree about the collective or its size)")

    def test(self) -> bool:
        MPI = self._transport._MPI
        status = MPI.Status()
        done = self._req.Test(status)
        if done and self._req is not None:
            self._check(status)
        return done

    def wait(self, timeout: float | None = None) -> None:
        t = self._transport
        timeout = t.timeout if timeout is None else timeout
        status = t._MPI.Status()
        deadline = time.monotonic() + timeout
        spins = 0
        while not self._req.Test(status):
            spins += 1
            if spins > _POLL_SPIN:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"rank {t.rank}: MPI request with rank {self._peer} timed out after {timeout:.3g}s")
                time.sleep(0 if spins < 1000 else 1e-4)
        self._check(status)


class MpiTransport(Transport):
    """Point-to-point over MPI_COMM_WORLD (or a given communicator)."""

    name = "mpi"
    capabilities = frozenset({"native"})

    def __init__(self, comm, timeout: float = 60.0) -> None:
        self._MPI = _mpi()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self._closed = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            _mpi()
        except TransportUnavailable as exc:
            return False, str(exc)
        return True, ""

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "MpiTransport":
        MPI = _mpi()
        comm = options.get("mpi_comm") or MPI.COMM_WORLD
        t = cls(comm, timeout)
        if size not in (None, -1) and t.size != size:
            raise TransportUnavailable(
                f"MPI world has {t.size} ranks but {size} were asked for; launch with mpiexec -n {size}")
        return t

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> Request:
        req = self.comm.Isend([buf, buf.nbytes, self._MPI.BYTE], dest=peer, tag=tag % self.tag_bound)
        return _MpiRequest(req, self, None, peer)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> Request:
        req = self.comm.Irecv([buf, buf.nbytes, self._MPI.BYTE], source=peer, tag=tag % self.tag_bound)
        return _MpiRequest(req, self, buf.nbytes, peer)

    @property
    def tag_bound(self) -> int:
        ub = getattr(self, "_tag_ub", None)
        if ub is None:
            ub = self._tag_ub = int(self.comm.Get_attr(self._MPI.TAG_UB)) + 1
        return ub

    def abort(self, reason: str) -> None:
        try:
            self.comm.Abort(1)
        except Exception:  # pragma: no cover
            pass

    def close(self) -> None:
        self._closed = True
