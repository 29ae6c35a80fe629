"""MPI transport through mpi4py (the ``mpich`` wheel works; no system MPI needed).

Rank and size come from MPI itself, so ``init(transport="mpi")`` works under
``mpiexec -n 4 python script.py``. Point-to-point uses ``Isend``/``Irecv`` on
buffers (no pickling).

Communicators: the transport duplicates the communicator it is given twice,
one for data (every message and MPI's own collectives) and one for control
(aborts and goodbyes), both with ``MPI_ERRORS_RETURN``: an MPI error comes
back to the caller and becomes one of the library's errors (a truncated
message :class:`~collectives.errors.MismatchedCollective`, an argument MPI
refuses :class:`~collectives.errors.BadArgument`, anything else
:class:`~collectives.errors.PeerLost`); the user's communicator is left as
it was.

Messages: every message starts with a 32-byte header, the call's signature
(three 64-bit words, see :mod:`collectives.signature`) and the payload's
byte count. Payloads of up to :data:`SMALL_BYTES` travel with their header
as one MPI message (staged on both sides); larger ones as a header message
and then a payload message with the same tag, which MPI's non-overtaking
rule keeps in order. The receiver checks the header
(:func:`~collectives.signature.check_message`, then the size) before it
posts the payload's receive, so a mismatched message never touches the
receive's buffer. A receive posted while a large one from the same peer
with the same tag still waits for its header is held back until that one's
payload receive is posted, so that every header and payload meets its own
receive. A message larger or smaller than its receive is a
MismatchedCollective naming both sizes; the rest of it is received and
dropped, so later messages from that peer still match. An operation that
no one waits for any more (after a failure) may still be under way in MPI:
the transport keeps its request, and with it its buffers.

Out of step: a collective receive whose message (or header) has not
arrived, still not done after a short spin, looks (``MPI_Iprobe``, any
tag) at the first message from its peer that nothing has received yet. A
collective message (odd tag) of another call means the peer moved past
this call without sending what the wait waits for
(:func:`~collectives.signature.out_of_step`); the verdict is given once the
same holds :data:`CONFIRM_SECONDS` later, so that a message still being
copied in is not taken for a missing one.

MPI's own collectives (the algorithm ``native``): when the call carries a
signature, the ranks first agree on it with one small nonblocking
allreduce (MIN over the words and their complements, so the minimum and the
maximum of every word come out of one call); when they disagree, every rank
gathers every rank's signature (and a refusing root's reason) and raises
the same error (:func:`~collectives.signature.check_all`).

Failures: :meth:`MpiTransport.abort` never calls ``MPI_Abort``: it sends its
reason (and the first call it did not complete) to every peer over the
control communicator; waits look there after their spin (at least every
0.2 ms) and raise ``errors.from_abort(reason, peer, rank)``, and every later
operation raises the same at once, but for those of earlier calls, which
may finish; a rank that received an abort does not pass it on.
:meth:`MpiTransport.close` tells every peer that this rank is gone (with
the last call it took part in); a peer waiting on it raises PeerLost at
once when the closed rank never entered the call, and after
:data:`CONFIRM_SECONDS` when it did (what it sent has had time to land).

What mpiexec (MPICH's hydra, MPICH 5.0.2 of the ``mpich`` wheel) does when
a rank ends early, measured on one host:

* The rank leaves Python normally: ``sys.exit`` with status 0 or not, or an
  uncaught exception (status 1). Python's ``atexit`` closes its
  communicators first (an uncaught exception aborts them before that), so
  its peers raise PeerLost within milliseconds; then mpi4py's
  ``MPI_Finalize`` waits until every other rank has called
  ``MPI_Finalize`` too. Hydra sees nothing until then and kills no one;
  mpiexec's exit status is the bitwise OR of the ranks' statuses.
* The rank ends without ``MPI_Finalize``: ``os._exit`` with any status, 0
  included, a crash, or a signal (``SIGKILL``). Hydra kills every other
  rank with ``SIGKILL`` at once (their last sign of life came 2 to 5 ms
  after the death here): they see nothing, raise nothing and report
  nothing; no code of the library runs. For a signal it prints ``BAD
  TERMINATION OF ONE OF YOUR APPLICATION PROCESSES ... EXIT CODE: 9`` and
  mpiexec exits with 9; after ``os._exit(0)`` it kills the others
  silently and exits with 0. With ``mpiexec -disable-auto-cleanup`` a
  rank killed by a signal still took the others with it; after
  ``os._exit(0)`` they ran on (a wait on the dead rank then ends in
  CollectiveTimeout: MPI gives no sign of the death) and then hung in
  ``MPI_Finalize``.
"""

from __future__ import annotations

import logging

import collections
import struct
import time
from typing import Any, Callable

import numpy as np

from collectives.errors import (BadArgument, CollectiveError, CollectiveTimeout, MismatchedCollective, PeerLost,
                                TransportUnavailable, from_abort)
from collectives.signature import NO_SIG, REFUSED, SEQ_MASK, Sig, check_all, check_message, out_of_step, seq_of_tag
from collectives.transport import Request, Transport

__all__ = ["MpiTransport", "SMALL_BYTES", "HEADER_BYTES", "CONFIRM_SECONDS"]

#: Payloads up to this many bytes travel in one MPI message with their header.
SMALL_BYTES = 64 << 10
#: Every message's header: signature words w0, w1, w2 and the payload's byte count.
_HEADER = struct.Struct("<4Q")
HEADER_BYTES = _HEADER.size
#: How long a sign of a lost or out-of-step peer must hold before a wait fails on it.
CONFIRM_SECONDS = 0.01
#: Polls of a request before a wait looks at the control communicator and its peer.
_SPIN = 50
#: Longest sleep between polls of a wait past its spin.
_NAP = 1e-4
#: Control-communicator tags.
_ABORT, _GOODBYE = 1, 2
#: Longest abort reason sent (bytes of UTF-8); longer ones are cut.
_REASON_BYTES = 8192
#: The first half of the sequence-number space lies after a given call.
_HALF_SEQ = (SEQ_MASK + 1) >> 1


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - dependency
        raise TransportUnavailable(f"mpi4py cannot be imported: {exc}") from exc
    return MPI


def _byte_view(buf: np.ndarray) -> memoryview:
    """The bytes of the C-contiguous array ``buf``, writable where it is."""
    try:
        return memoryview(buf).cast("B")
    except (TypeError, ValueError, NotImplementedError):  # dtypes without a buffer format (bfloat16)
        return memoryview(buf.reshape(-1).view(np.uint8))


def _sig_words(sig: Sig) -> np.ndarray:
    """``sig`` as three int64 (the bits of its unsigned words)."""
    return np.array(sig, dtype=np.uint64).view(np.int64)


def _call_of(tag: int) -> str:
    """``call #N`` for a collective tag, the point-to-point tag otherwise."""
    return f"call #{seq_of_tag(tag) & SEQ_MASK}" if tag & 1 else f"a point-to-point message (tag {tag >> 1})"


def _before(theirs: int, mine: int) -> bool:
    """Whether collective tag ``theirs`` (-1: none) belongs to a call before ``mine``'s."""
    if theirs < 0:
        return True
    return 0 < (seq_of_tag(mine) - seq_of_tag(theirs)) & SEQ_MASK < _HALF_SEQ


class _MpiRequest(Request):
    """An operation polled by :meth:`wait` against its deadline; after a spin,
    each poll also looks at the transport's control communicator and at the
    peer (:meth:`MpiTransport._watch`). ``peer`` is -1 for MPI's own
    collectives (every rank)."""

    __slots__ = ("_t", "_peer", "_tag", "_done", "_error", "_suspect")

    def __init__(self, transport: "MpiTransport", peer: int, tag: int) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done = False
        self._error: CollectiveError | None = None
        self._suspect: tuple[tuple, float] | None = None  # (sign of trouble, since when)

    receives = False

    def _poll(self) -> bool:
        """One MPI test; True when the operation is finished (raises its error)."""
        raise NotImplementedError

    def _fail(self, error: CollectiveError) -> CollectiveError:
        """Finish this request with ``error`` (raised again by later waits)."""
        self._done, self._error = True, error
        return error

    def test(self) -> bool:
        if self._done:
            if self._error is not None:
                raise self._error
            return True
        t = self._t
        try:
            return self._poll() or t._watch(self)
        except t._MPI.Exception as exc:
            raise self._fail(t._mpi_error(exc, self._what())) from None

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            if self._error is not None:
                raise self._error
            return
        t = self._t
        try:
            if self._poll():
                return
            limit = t.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            spins = 0
            while True:
                spins += 1
                if spins > _SPIN:
                    if t._watch(self):
                        return
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(f"rank {t.rank}: {self._what()} timed out after {limit:.3g}s")
                    time.sleep(0 if spins < 1000 else _NAP)
                if self._poll():
                    return
        except t._MPI.Exception as exc:
            raise self._fail(t._mpi_error(exc, self._what())) from None

    def _what(self) -> str:
        return f"MPI request with rank {self._peer} in {_call_of(self._tag)}"

    def __del__(self) -> None:
        # An MPI operation still under way (a wait that failed or was given
        # up) writes into or reads from its buffers later: the mpi4py request
        # holds them, so the transport keeps it.
        req = getattr(self, "_req", None)
        if req is not None and (any(req) if type(req) is list else req):
            self._t._kept.append(req)


class _Send(_MpiRequest):
    """A send of one message, header and payload staged together (``keep``)."""

    __slots__ = ("_req", "_keep")

    def __init__(self, transport: "MpiTransport", peer: int, tag: int, req: Any, keep: Any) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done, self._error, self._suspect = False, None, None
        self._req, self._keep = req, keep

    def _poll(self) -> bool:
        if self._req.Test():
            self._done, self._keep = True, None
            return True
        return False

    def _what(self) -> str:
        return f"MPI send to rank {self._peer} in {_call_of(self._tag)}"


class _LargeSend(_Send):
    """A send of a header message (``keep``) and a payload message: ``req``
    holds both requests."""

    __slots__ = ()

    def _poll(self) -> bool:
        if self._t._MPI.Request.Testall(self._req):
            self._done, self._keep = True, None
            return True
        return False


class _Recv(_MpiRequest):
    """A receive of ``buf.nbytes`` bytes whose header must carry ``sig``.

    It is posted to MPI at once unless a large receive from the same peer
    with the same tag still waits for its header: it is then held, and
    posted (in order) once that one's payload receive is posted, so that
    MPI matches every header and payload with the receive it belongs to
    (:meth:`MpiTransport._release`)."""

    __slots__ = ("_req", "_buf", "_sig", "_staging")
    receives = True

    def __init__(self, transport: "MpiTransport", peer: int, tag: int, buf: np.ndarray, sig: Sig) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done, self._error, self._suspect = False, None, None
        self._buf, self._sig = buf, sig
        self._req = self._staging = None

    def _post(self) -> None:
        """Post the receive of the message (or of its header) to MPI."""
        raise NotImplementedError

    def _arrived(self, req) -> bool:
        """Test ``req``; True when its message is in (a truncated one too: its
        header, at the start, is in)."""
        try:
            return req.Test()
        except self._t._MPI.Exception as exc:
            if exc.Get_error_class() != self._t._MPI.ERR_TRUNCATE:
                raise
            return True

    def _check_header(self, head: bytearray) -> int:
        """The payload's byte count from the header at the start of ``head``;
        raises (and finishes the request) when it disagrees with this receive.
        A refused header's payload message, if one follows, is dropped."""
        t = self._t
        w0, w1, w2, nbytes = _HEADER.unpack_from(head)
        error = check_message(self._sig, (w0, w1, w2), t.rank, self._peer) if (w0, w1, w2) != self._sig else None
        if error is None and nbytes != self._buf.nbytes:
            error = MismatchedCollective(
                f"rank {t.rank}: expected {self._buf.nbytes} bytes from rank {self._peer}, got {nbytes} "
                "(ranks disagree about the collective or its size)")
        if error is not None:
            if nbytes > SMALL_BYTES:  # sent as a header message and a payload message
                t._drop_next(self._peer, self._tag)
            raise self._fail(error)
        return nbytes

    def _pending_header(self) -> bool:
        """Whether the message (or its header) has not arrived yet."""
        raise NotImplementedError

    def _what(self) -> str:
        return f"MPI receive from rank {self._peer} in {_call_of(self._tag)}"


class _SmallRecv(_Recv):
    """A message of header and payload together, received into staging."""

    __slots__ = ()

    def _post(self) -> None:
        t = self._t
        self._staging = bytearray(HEADER_BYTES + self._buf.nbytes)
        self._req = t.comm.Irecv([self._staging, t._BYTE], self._peer, self._tag % t.tag_bound)

    def _poll(self) -> bool:
        req = self._req
        if req is None:
            return False
        try:  # _arrived, inline: the common case
            if not req.Test():
                return False
        except self._t._MPI.Exception as exc:  # a larger message than this receive: its header is in
            if exc.Get_error_class() != self._t._MPI.ERR_TRUNCATE:
                raise
        staging = self._staging
        w0, w1, w2, nbytes = _HEADER.unpack_from(staging)
        if nbytes != self._buf.nbytes or (w0, w1, w2) != self._sig:
            self._check_header(staging)
        if nbytes:
            try:
                memoryview(self._buf).cast("B")[:] = memoryview(staging)[HEADER_BYTES:]
            except (TypeError, ValueError, NotImplementedError):  # a dtype without a buffer format
                _byte_view(self._buf)[:] = memoryview(staging)[HEADER_BYTES:]
        self._done, self._staging = True, None
        return True

    def _pending_header(self) -> bool:
        return not self._done


class _LargeRecv(_Recv):
    """A header message, checked before the payload's receive is posted into
    the user's buffer. Until the header is in, the transport advances it from
    every wait (:meth:`MpiTransport._advance`), so that two ranks each waiting
    on a send to the other still post each other's payload receives."""

    __slots__ = ()

    def _post(self) -> None:
        t = self._t
        self._staging = bytearray(HEADER_BYTES)
        self._req = t.comm.Irecv([self._staging, t._BYTE], self._peer, self._tag % t.tag_bound)
        t._awaiting.append(self)
        t._hold(self._peer, self._tag)

    def _poll(self) -> bool:
        if self._staging is not None or self._req is None:
            if not self._take_header():
                return False
        if self._req.Test():
            self._done = True
            return True
        return False

    def _take_header(self) -> bool:
        """Post the payload's receive once the header is in and agrees (and then
        the receives held behind this one); False while it is not in."""
        if self._req is None or not self._arrived(self._req):
            return False
        t = self._t
        t._awaiting.remove(self)
        try:
            nbytes = self._check_header(self._staging)
            self._staging = None
            self._req = t.comm.Irecv([self._buf.reshape(-1).view(np.uint8), nbytes, t._BYTE], self._peer,
                                     self._tag % t.tag_bound)
        finally:
            t._release(self._peer, self._tag)
        return True

    def _fail(self, error: CollectiveError) -> CollectiveError:
        if self in self._t._awaiting:
            self._t._awaiting.remove(self)
        return super()._fail(error)

    def _pending_header(self) -> bool:
        return self._staging is not None or self._req is None


class _CollectiveWait(_MpiRequest):
    """A request of one of MPI's own collectives (every rank takes part)."""

    __slots__ = ("_req",)

    def __init__(self, transport: "MpiTransport", tag: int, req) -> None:
        super().__init__(transport, -1, tag)
        self._req = req

    def _poll(self) -> bool:
        if self._req.Test():
            self._done = True
            return True
        return False

    def _what(self) -> str:
        return f"MPI's own collective in {_call_of(self._tag)}"


_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX",
            "band": "BAND", "bor": "BOR", "bxor": "BXOR", "land": "LAND", "lor": "LOR"}


class _Native:
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
        _CollectiveWait(self.t, ctx.tag, req).wait(ctx.remaining())

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
            raise self.t._mpi_error(exc, f"MPI's own collective in {_call_of(ctx.tag)}") from None
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
        reason = (t._refusal_of(ctx.sig) or "").encode("utf-8", "replace")[:_REASON_BYTES]
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
            f"rank {t.rank}: {_call_of(ctx.tag)}: the ranks' signatures differ")

    def _collective(self, ctx, start: Callable[[], Any]) -> None:
        try:
            req = start()
        except self.MPI.Exception as exc:
            raise self.t._mpi_error(exc, f"the signature agreement of {_call_of(ctx.tag)}") from None
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


class MpiTransport(Transport):
    """Point-to-point over duplicates of MPI_COMM_WORLD (or of a given
    communicator): one for data, one for control (see the module docstring)."""

    name = "mpi"
    capabilities = frozenset({"native"})

    def __init__(self, comm, timeout: float = 60.0) -> None:
        MPI = self._MPI = _mpi()
        self._BYTE = MPI.BYTE
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        try:
            self.comm = self._duplicate(comm)
            self._control = self._duplicate(comm)
            #: Tags are taken modulo this (MPI_TAG_UB + 1, a power of two: parity is kept).
            self.tag_bound = int(self.comm.Get_attr(MPI.TAG_UB)) + 1
        except MPI.Exception as exc:
            raise TransportUnavailable(f"rank {self.rank}: MPI could not duplicate the communicator: "
                                       f"{exc.Get_error_string().splitlines()[-1]}") from None
        self._closed = False
        #: (reason, the rank that aborted, the first call it did not complete or -1)
        self._aborted: tuple[str, int, int] | None = None
        self._gone: dict[int, int] = {}  # closed peer -> the last collective tag it took part in
        self._awaiting: list[_LargeRecv] = []  # large receives whose header is not in yet
        self._held: dict[tuple[int, int], collections.deque] = {}  # receives held behind such a one
        self._kept: list = []  # MPI requests still under way that no one waits for, and their buffers
        self._last_tag = -1  # of the last collective call this rank took part in
        self._call: tuple[Sig, str | None] = (NO_SIG, None)  # the current call's signature and refusal
        self._probe = MPI.Status()
        self._native = _Native(self)

    def _duplicate(self, comm):
        dup = comm.Dup()
        dup.Set_errhandler(self._MPI.ERRORS_RETURN)
        return dup

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

    # ------------------------------------------------------------ messages

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        if (self._aborted is not None or self._closed) and self._refuses(tag):
            raise self._unusable()
        if tag & 1:
            self._last_tag = tag
        n = buf.nbytes
        try:
            if n <= SMALL_BYTES:
                msg = _HEADER.pack(sig[0], sig[1], sig[2], n) + buf.tobytes()
                return _Send(self, peer, tag, self.comm.Isend([msg, self._BYTE], peer, tag % self.tag_bound), msg)
            head = _HEADER.pack(sig[0], sig[1], sig[2], n)
            reqs = [self.comm.Isend([head, self._BYTE], peer, tag % self.tag_bound),
                    self.comm.Isend([buf.reshape(-1).view(np.uint8), n, self._BYTE], peer, tag % self.tag_bound)]
            return _LargeSend(self, peer, tag, reqs, head)
        except self._MPI.Exception as exc:
            raise self._mpi_error(exc, f"MPI send to rank {peer} in {_call_of(tag)}", peer) from None

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        if (self._aborted is not None or self._closed) and self._refuses(tag):
            raise self._unusable()
        if tag & 1:
            self._last_tag = tag
        n = buf.nbytes
        req = (_SmallRecv if n <= SMALL_BYTES else _LargeRecv)(self, peer, tag, buf, sig)
        try:
            if self._held and (peer, tag % self.tag_bound) in self._held:
                self._held[(peer, tag % self.tag_bound)].append(req)
            elif n <= SMALL_BYTES:  # _SmallRecv._post, inline: the common case
                req._staging = staging = bytearray(HEADER_BYTES + n)
                req._req = self.comm.Irecv([staging, self._BYTE], peer, tag % self.tag_bound)
            else:
                req._post()
            return req
        except self._MPI.Exception as exc:
            raise self._mpi_error(exc, f"MPI receive from rank {peer} in {_call_of(tag)}", peer) from None

    def begin_call(self, seq: int, sig: Sig, refusal: str | None = None) -> None:
        """Remember the call (its refusal is what MPI's own collectives tell the peers)."""
        self._call = (sig, refusal)
        self._last_tag = 2 * seq + 1

    @property
    def call_signature(self) -> Sig:
        """The signature of the collective call this rank is in, or was in last,
        as :meth:`begin_call` gave it (NO_SIG before any call)."""
        return self._call[0]

    def _enter(self, tag: int) -> None:
        """This rank takes part in the collective call of ``tag``."""
        self._last_tag = tag

    def _refusal_of(self, sig: Sig) -> str | None:
        """Why this rank refused the call of ``sig`` (see :meth:`begin_call`)."""
        return self._call[1] if self._call[0] == sig else None

    def _hold(self, peer: int, tag: int) -> None:
        """Hold later receives from ``peer`` with ``tag`` (see :class:`_Recv`)."""
        self._held[(peer, tag % self.tag_bound)] = collections.deque()

    def _release(self, peer: int, tag: int) -> None:
        """Post the receives held behind a large one from ``peer`` with ``tag``,
        in order, up to the next large one (which holds the rest again)."""
        held = self._held.pop((peer, tag % self.tag_bound), None)
        while held:
            req = held.popleft()
            req._post()
            if isinstance(req, _LargeRecv):
                self._held[(peer, tag % self.tag_bound)].extend(held)
                return

    def _drop_next(self, peer: int, tag: int) -> None:
        """Receive and drop the next message from ``peer`` with ``tag`` (the
        payload after a refused header), so that it matches nothing else."""
        sink = np.empty(1, np.uint8)
        self._kept += [sink, self.comm.Irecv([sink, 0, self._BYTE], peer, tag % self.tag_bound)]

    # ---------------------------------------------------------- slow path

    def _watch(self, req: _MpiRequest) -> bool:
        """The slow path of a wait on ``req``: aborts and goodbyes on the
        control communicator, the headers of other large receives, and a
        peer that is gone or out of step. True when ``req`` finished meanwhile;
        raises the error it must fail with."""
        self._read_control()
        if self._aborted is not None and self._refuses(req._tag):
            raise self._unusable()
        if self._awaiting:
            self._advance(req)
        trouble = self._out_of_step(req) or self._gone_peer(req)
        if trouble is None:
            req._suspect = None
            return False
        key, at_once, error = trouble
        if req._poll():
            return True
        now = time.monotonic()
        if req._suspect is None or req._suspect[0] != key:
            req._suspect = (key, now)
        if at_once or now - req._suspect[1] >= CONFIRM_SECONDS:
            raise req._fail(error())
        return False

    def _read_control(self) -> None:
        """Take every abort and goodbye the peers sent."""
        MPI, status = self._MPI, self._probe
        while True:
            msg = self._control.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                return
            peer, tag = status.Get_source(), status.Get_tag()
            data = bytearray(status.Get_count(self._BYTE))
            if not self._receive_matched(msg, data):
                data = bytearray(b"(the reason did not arrive)")
            if tag == _ABORT and self._aborted is None:
                first = struct.unpack_from("<q", data)[0] if len(data) >= 8 else -1
                self._aborted = (data[8:].decode("utf-8", "replace"), peer, first)
            elif tag == _GOODBYE:
                self._gone[peer] = struct.unpack_from("<q", data)[0] if len(data) >= 8 else -1

    def _receive_matched(self, msg, buf: bytearray, seconds: float = 1.0) -> bool:
        """Receive the probed message ``msg`` into ``buf`` (a truncated one
        too); False when it is not in within ``seconds``."""
        req = msg.Irecv([buf, self._BYTE])
        deadline = time.monotonic() + seconds
        try:
            while not req.Test():
                if time.monotonic() > deadline:
                    self._kept += [buf, req]
                    return False
                time.sleep(0)
        except self._MPI.Exception as exc:
            return exc.Get_error_class() == self._MPI.ERR_TRUNCATE
        return True

    def _advance(self, current: _MpiRequest) -> None:
        """Post the payload receives of large receives whose header is in; an
        error of one of ``current``'s call is raised here too."""
        progress = True
        while progress:
            progress = False
            for other in list(self._awaiting):
                if other is current:
                    continue
                try:
                    progress |= other._take_header()
                except CollectiveError:
                    if other._tag == current._tag:
                        raise

    def _out_of_step(self, req: _MpiRequest):
        """(key, at once, error) when the first message from ``req``'s peer not
        yet received belongs to another collective call; None otherwise."""
        if not (req.receives and req._tag & 1 and req._pending_header()):
            return None
        if not self.comm.Iprobe(req._peer, self._MPI.ANY_TAG, self._probe):
            return None
        tag = self._probe.Get_tag()
        if tag == req._tag % self.tag_bound or not tag & 1:
            return None
        return ("step", tag), False, lambda: out_of_step(
            self.rank, req._peer, req._tag, tag, self._take_signature(req._peer, tag))

    def _take_signature(self, peer: int, tag: int) -> Sig:
        """The signature in the next message from ``peer`` with ``tag``, which
        is received and dropped (NO_SIG when it cannot be read)."""
        status = self._MPI.Status()
        msg = self.comm.Improbe(peer, tag, status)
        if msg is None:
            return NO_SIG
        head = bytearray(HEADER_BYTES)
        if not self._receive_matched(msg, head, 0.1):
            return NO_SIG
        w0, w1, w2, nbytes = _HEADER.unpack_from(head)
        if nbytes > SMALL_BYTES:
            self._drop_next(peer, tag)
        return (w0, w1, w2)

    def _gone_peer(self, req: _MpiRequest):
        """(key, at once, error) when a peer ``req`` waits on closed its
        communicator: at once when it never entered the call, after
        :data:`CONFIRM_SECONDS` otherwise (what it sent before it closed has
        landed by then); None when none did, and for MPI's own collectives
        when every closed rank had entered the call (it may have finished
        its part: the call's timeout decides)."""
        if not self._gone or (req.receives and not req._pending_header()):
            return None  # a payload whose header is in was sent: it will come
        if req._peer >= 0:
            last = self._gone.get(req._peer)
            if last is None:
                return None
            lost, at_once = [req._peer], bool(req._tag & 1) and _before(last, req._tag)
        else:
            lost, at_once = sorted(p for p, last in self._gone.items() if _before(last, req._tag)), True
            if not lost:
                return None
        who = " and ".join(f"rank {p}" for p in lost)
        return ("gone", tuple(lost)), at_once, lambda: PeerLost(
            f"rank {self.rank}: {who} closed its communicator while rank {self.rank} waited on it "
            f"in {_call_of(req._tag)}", lost[0])

    # -------------------------------------------------------------- errors

    def _refuses(self, tag: int) -> bool:
        """Whether an operation with ``tag`` fails on a closed or aborted
        transport: always, but for one of a collective call before the first
        call the aborting rank did not complete (it may still finish)."""
        if self._closed or self._aborted is None:
            return True
        first = self._aborted[2]
        return first < 0 or not tag & 1 or not _before(tag, 2 * first + 1)

    def _unusable(self) -> CollectiveError:
        """The error of every operation on an aborted or closed transport."""
        if self._aborted is not None:
            reason, origin, _ = self._aborted
            return from_abort(reason, origin, self.rank)
        return PeerLost(f"rank {self.rank}: transport is closed", self.rank)

    def _mpi_error(self, exc, what: str, peer: int | None = None) -> CollectiveError:
        """The library's error for the MPI error ``exc`` raised in ``what``."""
        MPI = self._MPI
        code = exc.Get_error_class()
        lines = [line.strip() for line in exc.Get_error_string().splitlines() if line.strip()]
        detail = lines[-1] if lines else f"MPI error class {code}"
        if code == MPI.ERR_TRUNCATE:
            return MismatchedCollective(f"rank {self.rank}: {what}: a message larger than the receive arrived "
                                        f"({detail})")
        if code in (MPI.ERR_ARG, MPI.ERR_BUFFER, MPI.ERR_COUNT, MPI.ERR_TYPE, MPI.ERR_TAG, MPI.ERR_RANK,
                    MPI.ERR_ROOT, MPI.ERR_OP):
            return BadArgument(f"rank {self.rank}: {what}: MPI refused an argument ({detail})")
        return PeerLost(f"rank {self.rank}: {what} failed in MPI ({detail})", peer)

    # ------------------------------------------------------------ shutdown

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Tell every peer ``reason`` over the control communicator: their waits
        and later operations raise ``errors.from_abort(reason, this rank, peer)``,
        and this rank's later operations the same, but for those of collective
        calls before ``seq`` (the first call this rank did not complete; None:
        unknown), which may finish. A transport that a peer aborted tells no
        one (that peer told everyone). Never blocks, never raises; never calls
        MPI_Abort."""
        if self._closed or self._aborted is not None:
            return
        first = -1 if seq is None else seq & SEQ_MASK
        self._aborted = (reason, self.rank, first)
        self._tell_everyone(_ABORT, struct.pack("<q", first) + reason.encode("utf-8", "replace")[:_REASON_BYTES])

    def close(self) -> None:
        """Tell every peer that this rank is gone (unless it aborted) and refuse
        every later operation (idempotent). The duplicated communicators stay
        until MPI_Finalize: a peer may still send to them."""
        if self._closed:
            return
        if self._aborted is None:
            self._tell_everyone(_GOODBYE, struct.pack("<q", self._last_tag))
        self._closed = True

    def _tell_everyone(self, tag: int, data: bytes) -> None:
        """Send ``data`` with ``tag`` to every peer on the control communicator, without waiting."""
        try:
            if self._MPI.Is_finalized():
                return
            self._kept.append(data)
            for peer in range(self.size):
                if peer != self.rank:
                    self._kept.append(self._control.Isend([data, self._BYTE], peer, tag))
        except Exception:  # best effort: never raises
            pass
