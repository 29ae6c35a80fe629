"""MPI transport through mpi4py (the ``mpich`` wheel works; no system MPI needed).

Rank and size come from MPI itself, so ``init(transport="mpi")`` works under
``mpiexec -n 4 python script.py``. Point-to-point uses ``Isend``/``Irecv`` on
buffers (no pickling).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from collectives.errors import BadArgument, CollectiveTimeout, MismatchedCollective, PeerLost, TransportUnavailable
from collectives.signature import NO_SIG, Sig
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


_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX",
            "band": "BAND", "bor": "BOR", "bxor": "BXOR", "land": "LAND", "lor": "LOR"}


class _Native:
    """MPI's own collectives with the algorithms' signatures.

    Nonblocking MPI collectives polled against the call's deadline, so that
    they time out like everything else. Data movement uses MPI_BYTE (any
    dtype); reductions use the MPI datatype of the numpy dtype.
    """

    def __init__(self, transport: "MpiTransport") -> None:
        self.t = transport
        self.MPI = transport._MPI

    def _wait(self, ctx, req) -> None:
        _MpiRequest(req, self.t, None, -1).wait(ctx.remaining())

    def _bytes(self, arr: np.ndarray):
        return [arr.view(np.uint8) if arr.size else np.empty(0, np.uint8), arr.nbytes, self.MPI.BYTE]

    def _typed(self, arr: np.ndarray, op):
        dt = self.MPI._typedict.get(arr.dtype.char) if arr.dtype.isnative else None  # predefined types only
        logical = op.name in ("land", "lor") and arr.dtype.kind not in "biu"
        half = arr.dtype.itemsize == 2 and arr.dtype.kind in "fV"  # float16, bfloat16: no MPI reduction
        if dt is None or dt == self.MPI.DATATYPE_NULL or logical or half or arr.dtype.kind == "b":
            raise BadArgument(f"MPI's native reduction has no {op.name} for dtype {arr.dtype}; "
                              "use one of the library's algorithms")
        return dt, getattr(self.MPI, _MPI_OPS[op.name])

    def bcast(self, ctx, buf, root):
        self._wait(ctx, self.t.comm.Ibcast(self._bytes(buf), root))

    def _start(self, start, arr: np.ndarray, op):
        """Start a reduction; MPI checks (op, datatype) locally and alike on every
        rank, so a refusal becomes BadArgument before anything is sent."""
        try:
            return start()
        except self.MPI.Exception as exc:
            if exc.Get_error_class() in (self.MPI.ERR_OP, self.MPI.ERR_TYPE):
                raise BadArgument(f"MPI's native reduction has no {op.name} for dtype {arr.dtype}; "
                                  f"use one of the library's algorithms ({exc.Get_error_string().splitlines()[-1]})") from None
            raise

    def allreduce(self, ctx, buf, op):
        dt, mop = self._typed(buf, op)
        req = self._start(lambda: self.t.comm.Iallreduce(self.MPI.IN_PLACE, [buf, buf.size, dt], mop), buf, op)
        self._wait(ctx, req)

    def reduce(self, ctx, buf, root, op):
        dt, mop = self._typed(buf, op)
        if ctx.rank == root:
            req = self._start(lambda: self.t.comm.Ireduce(self.MPI.IN_PLACE, [buf, buf.size, dt], mop, root),
                              buf, op)
        else:
            req = self._start(lambda: self.t.comm.Ireduce([buf, buf.size, dt], None, mop, root), buf, op)
        self._wait(ctx, req)

    def _v(self, counts, itemsize):
        sizes = [c * itemsize for c in counts]
        displs = [sum(sizes[:i]) for i in range(len(sizes))]
        return sizes, displs

    def scatter(self, ctx, sendbuf, recvbuf, root, counts):
        sizes, displs = self._v(counts, recvbuf.itemsize)
        send = [sendbuf.view(np.uint8), sizes, displs, self.MPI.BYTE] if ctx.rank == root else None
        self._wait(ctx, self.t.comm.Iscatterv(send, self._bytes(recvbuf), root))

    def gather(self, ctx, sendbuf, recvbuf, root, counts):
        sizes, displs = self._v(counts, sendbuf.itemsize)
        recv = [recvbuf.view(np.uint8), sizes, displs, self.MPI.BYTE] if ctx.rank == root else None
        self._wait(ctx, self.t.comm.Igatherv(self._bytes(sendbuf), recv, root))

    def allgather(self, ctx, buf, counts):
        sizes, displs = self._v(counts, buf.itemsize)
        self._wait(ctx, self.t.comm.Iallgatherv(self.MPI.IN_PLACE,
                                                [buf.view(np.uint8), sizes, displs, self.MPI.BYTE]))

    def reduce_scatter(self, ctx, sendbuf, recvbuf, counts, op):
        dt, mop = self._typed(sendbuf, op)
        req = self._start(lambda: self.t.comm.Ireduce_scatter(
            [sendbuf, sendbuf.size, dt], [recvbuf, recvbuf.size, dt], list(counts), mop), sendbuf, op)
        self._wait(ctx, req)

    def alltoall(self, ctx, sendbuf, recvbuf):
        block = sendbuf.nbytes // ctx.size  # MPI counts are per destination
        send, recv = self._bytes(sendbuf), self._bytes(recvbuf)
        send[1] = recv[1] = block
        self._wait(ctx, self.t.comm.Ialltoall(send, recv))

    def barrier(self, ctx):
        self._wait(ctx, self.t.comm.Ibarrier())


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
        self._native = _Native(self)

    def native(self, collective: str):
        """MPI's own implementation of ``collective`` (see :class:`_Native`)."""
        return getattr(self._native, collective)

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

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        req = self.comm.Isend([buf, buf.nbytes, self._MPI.BYTE], dest=peer, tag=tag % self.tag_bound)
        return _MpiRequest(req, self, None, peer)

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
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
