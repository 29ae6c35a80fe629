"""MPI's own collectives (the algorithm ``native``), with the signature agreement.

Nonblocking MPI collectives polled against the call's deadline
(:class:`CollectiveWait`), so that they time out like everything else.

When the call carries a signature, the ranks first agree on it with one
small nonblocking allreduce (MIN over the words and their complements, so
the minimum and the maximum of every word come out of one call); when they
disagree, every rank gathers every rank's signature (and a refusing root's
reason) and raises the same error
(:func:`~collectives.signature.check_all`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from collectives.errors import BadArgument, CollectiveError, MismatchedCollective
from collectives.signature import NO_SIG, REFUSED, Sig, check_all

from .control import REASON_BYTES
from .tags import call_of
from .waits import MpiRequest

if TYPE_CHECKING:
    from .transport import MpiTransport

__all__ = ["Native", "CollectiveWait"]


def _sig_words(sig: Sig) -> np.ndarray:
    """``sig`` as three int64 (the bits of its unsigned words)."""
    return np.array(sig, dtype=np.uint64).view(np.int64)


class CollectiveWait(MpiRequest):
    """A request of one of MPI's own collectives (every rank takes part)."""

    __slots__ = ("_req",)
    action = "waiting for every rank in MPI's own collective"

    def __init__(self, transport: "MpiTransport", tag: int, req) -> None:
        super().__init__(transport, -1, tag)
        self._req = req

    def _poll(self) -> bool:
        if self._req.Test():
            self._done = True
            return True
        return False

    def _what(self) -> str:
        return f"MPI's own collective in {call_of(self._tag)}"


_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX",
            "band": "BAND", "bor": "BOR", "bxor": "BXOR", "land": "LAND", "lor": "LOR"}


class Native:
    """MPI's own collectives with the algorithms' signatures.

    Nonblocking MPI collectives polled against the call's deadline, so that
    they time out like everything else. Data movement uses MPI_BYTE (any
    dtype); reductions use the MPI datatype of the numpy dtype. A call with
    a signature starts with the ranks' agreement on it (see the module
    docstring).
    """

    def __init__(self, transport: "MpiTransport") -> None:
        self.t = transport
        self.MPI = transport._MPI

    def _wait(self, ctx, req) -> None:
        CollectiveWait(self.t, ctx.tag, req).wait(ctx.remaining())

    def _run(self, ctx, start: Callable[..., Any], check: Callable[[], tuple] | None = None,
             refusal: Callable[[Any], BadArgument] | None = None) -> None:
        """Agree on the call's signature, run ``check()`` (after the agreement,
        so that every rank comes to the same verdict), then start MPI's
        collective, ``start(*check())``, and wait for it. ``refusal(exc)``:
        the BadArgument of an (op, datatype) that MPI refuses."""
        self.t._enter(ctx.tag)
        self._agree(ctx)
        args = check() if check is not None else ()
        try:
            req = start(*args)
        except self.MPI.Exception as exc:
            if refusal is not None and exc.Get_error_class() in (self.MPI.ERR_OP, self.MPI.ERR_TYPE):
                raise refusal(exc) from None
            raise self.t._mpi_error(exc, f"MPI's own collective in {call_of(ctx.tag)}") from None
        self._wait(ctx, req)

    # -- the signature agreement -------------------------------------------

    def _agree(self, ctx) -> None:
        """Raise the call's error on every rank when the ranks' signatures differ
        (or a root refused); nothing when the call has no signature."""
        sig = ctx.sig
        if sig == NO_SIG:
            return
        words = _sig_words(sig)
        mine, extremes = np.concatenate((words, ~words)), np.empty(6, np.int64)
        self._collective(ctx, lambda: self.t.comm.Iallreduce(
            [mine, self.MPI.INT64_T], [extremes, self.MPI.INT64_T], self.MPI.MIN))
        if (extremes[:3] == ~extremes[3:]).all() and not sig[0] & REFUSED:
            return
        raise self._verdict(ctx)

    def _verdict(self, ctx) -> CollectiveError:
        """Every rank's signature (and a refusing root's reason), the same on
        every rank, turned into the call's error."""
        t, MPI = self.t, self.MPI
        reason = (t._refusal_of(ctx.sig) or "").encode("utf-8", "replace")[:REASON_BYTES]
        mine = np.concatenate((_sig_words(ctx.sig), [len(reason)]))
        table = np.empty((t.size, 4), np.int64)
        self._collective(ctx, lambda: t.comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]))
        sigs = [tuple(int(w) for w in row[:3].view(np.uint64)) for row in table]
        reasons = {}
        refusers = [r for r, s in enumerate(sigs) if s[0] & REFUSED]
        if refusers:
            root = refusers[0]
            text = bytearray(reason) if t.rank == root else bytearray(int(table[root, 3]))
            if text:
                self._collective(ctx, lambda: t.comm.Ibcast([text, MPI.BYTE], root))
            reasons[root] = text.decode("utf-8", "replace") or None
        return check_all(sigs, t.rank, reasons) or MismatchedCollective(
            f"rank {t.rank}: {call_of(ctx.tag)}: the ranks' signatures differ")

    def _collective(self, ctx, start: Callable[[], Any]) -> None:
        try:
            req = start()
        except self.MPI.Exception as exc:
            raise self.t._mpi_error(exc, f"the signature agreement of {call_of(ctx.tag)}") from None
        self._wait(ctx, req)

    # -- the collectives ---------------------------------------------------

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

    @staticmethod
    def _refused(arr: np.ndarray, op) -> Callable[[Any], BadArgument]:
        """MPI checks (op, datatype) locally and alike on every rank, so a
        refusal becomes BadArgument before anything is sent."""
        return lambda exc: BadArgument(
            f"MPI's native reduction has no {op.name} for dtype {arr.dtype}; use one of the library's "
            f"algorithms ({exc.Get_error_string().splitlines()[-1]})")

    def _reduction(self, ctx, arr: np.ndarray, op, start: Callable[[Any, Any], Any]) -> None:
        """Run ``start(datatype, op)``, MPI's reduction of ``arr`` with ``op``."""
        self._run(ctx, start, lambda: self._typed(arr, op), self._refused(arr, op))

    def bcast(self, ctx, buf, root):
        self._run(ctx, lambda: self.t.comm.Ibcast(self._bytes(buf), root))

    def allreduce(self, ctx, buf, op):
        IN_PLACE = self.MPI.IN_PLACE
        self._reduction(ctx, buf, op, lambda dt, mop: self.t.comm.Iallreduce(IN_PLACE, [buf, buf.size, dt], mop))

    def reduce(self, ctx, buf, root, op):
        comm, IN_PLACE = self.t.comm, self.MPI.IN_PLACE
        if ctx.rank == root:
            self._reduction(ctx, buf, op, lambda dt, mop: comm.Ireduce(IN_PLACE, [buf, buf.size, dt], mop, root))
        else:
            self._reduction(ctx, buf, op, lambda dt, mop: comm.Ireduce([buf, buf.size, dt], None, mop, root))

    def _v(self, counts, itemsize):
        sizes = [c * itemsize for c in counts]
        displs = [sum(sizes[:i]) for i in range(len(sizes))]
        return sizes, displs

    def scatter(self, ctx, sendbuf, recvbuf, root, counts):
        sizes, displs = self._v(counts, recvbuf.itemsize)
        send = [sendbuf.view(np.uint8), sizes, displs, self.MPI.BYTE] if ctx.rank == root else None
        self._run(ctx, lambda: self.t.comm.Iscatterv(send, self._bytes(recvbuf), root))

    def gather(self, ctx, sendbuf, recvbuf, root, counts):
        sizes, displs = self._v(counts, sendbuf.itemsize)
        recv = [recvbuf.view(np.uint8), sizes, displs, self.MPI.BYTE] if ctx.rank == root else None
        self._run(ctx, lambda: self.t.comm.Igatherv(self._bytes(sendbuf), recv, root))

    def allgather(self, ctx, buf, counts):
        sizes, displs = self._v(counts, buf.itemsize)
        self._run(ctx, lambda: self.t.comm.Iallgatherv(
            self.MPI.IN_PLACE, [buf.view(np.uint8), sizes, displs, self.MPI.BYTE]))

    def reduce_scatter(self, ctx, sendbuf, recvbuf, counts, op):
        self._reduction(ctx, sendbuf, op, lambda dt, mop: self.t.comm.Ireduce_scatter(
            [sendbuf, sendbuf.size, dt], [recvbuf, recvbuf.size, dt], list(counts), mop))

    def alltoall(self, ctx, sendbuf, recvbuf):
        block = sendbuf.nbytes // ctx.size  # MPI counts are per destination
        send, recv = self._bytes(sendbuf), self._bytes(recvbuf)
        send[1] = recv[1] = block
        self._run(ctx, lambda: self.t.comm.Ialltoall(send, recv))

    def barrier(self, ctx):
        self._run(ctx, lambda: self.t.comm.Ibarrier())

