"""The MPI transport: communicators, sends and receives, and the slow path of waits.

Communicators: the transport duplicates the communicator it is given twice,
one for data (every message and MPI's own collectives) and one for control
(aborts and goodbyes, :mod:`.control`), both with ``MPI_ERRORS_RETURN``
(:mod:`.errors`); the user's communicator is left as it was. Messages have
the format of :mod:`.messages`. An operation that no one waits for any
more (after a failure) may still be under way in MPI: the transport keeps
its request, and with it its buffers.

Out of step: a collective receive whose message (or header) has not
arrived, still not done after a short spin, looks (``MPI_Iprobe``, any
tag) at the first message from its peer that nothing has received yet. A
collective message (odd tag) of another call means the peer moved past
this call without sending what the wait waits for
(:func:`~collectives.signature.out_of_step`); the verdict is given once the
same holds :data:`~.waits.CONFIRM_SECONDS` later, so that a message still
being copied in is not taken for a missing one.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from collectives.errors import CollectiveError, TransportUnavailable
from collectives.signature import NO_SIG, Sig, out_of_step
from collectives.transport import Request, Transport

from .control import ControlChannel
from .diagnosis import Diagnosis
from .errors import mpi_error
from .messages import HEADER, HEADER_BYTES, SMALL_BYTES, LargeRecv, LargeSend, Send, SmallRecv
from .native import Native
from .tags import call_of
from .waits import CONFIRM_SECONDS, KEPT, MpiRequest, finalize_before_teardown

__all__ = ["MpiTransport"]


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - dependency
        raise TransportUnavailable(f"mpi4py cannot be imported: {exc}") from exc
    return MPI


class MpiTransport(ControlChannel, Diagnosis, Transport):
    """Point-to-point over duplicates of MPI_COMM_WORLD (or of a given
    communicator): one for data, one for control (see the package docstring)."""

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
        self._awaiting: list[LargeRecv] = []  # large receives whose header is not in yet
        self._held: dict[tuple[int, int], collections.deque] = {}  # receives held behind such a one
        # MPI requests still under way that no one waits for, and their buffers: kept for the
        # life of the process (MPI may write into a receive's buffer until MPI_Finalize, long
        # after this transport is gone), not of this transport
        self._kept: list = KEPT
        finalize_before_teardown(MPI)
        self._last_tag = -1  # of the last collective call this rank took part in
        self._call: tuple[Sig, str | None] = (NO_SIG, None)  # the current call's signature and refusal
        self._probe = MPI.Status()
        self._native = Native(self)
        try:
            self._exchange_names()  # every rank's host and pid, for the errors' messages
        except MPI.Exception as exc:
            raise TransportUnavailable(f"rank {self.rank}: MPI could not exchange the ranks' names: "
                                       f"{exc.Get_error_string().splitlines()[-1]}") from None

    def _duplicate(self, comm):
        dup = comm.Dup()
        dup.Set_errhandler(self._MPI.ERRORS_RETURN)
        return dup

    def native(self, collective: str):
        """MPI's own implementation of ``collective`` (see :class:`Native`)."""
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
                msg = HEADER.pack(sig[0], sig[1], sig[2], n) + buf.tobytes()
                return Send(self, peer, tag, self.comm.Isend([msg, self._BYTE], peer, tag % self.tag_bound), msg)
            head = HEADER.pack(sig[0], sig[1], sig[2], n)
            reqs = [self.comm.Isend([head, self._BYTE], peer, tag % self.tag_bound),
                    self.comm.Isend([buf.reshape(-1).view(np.uint8), n, self._BYTE], peer, tag % self.tag_bound)]
            return LargeSend(self, peer, tag, reqs, head)
        except self._MPI.Exception as exc:
            raise self._mpi_error(exc, f"MPI send to rank {peer} in {call_of(tag)}", peer) from None

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        if (self._aborted is not None or self._closed) and self._refuses(tag):
            raise self._unusable()
        if tag & 1:
            self._last_tag = tag
        n = buf.nbytes
        req = (SmallRecv if n <= SMALL_BYTES else LargeRecv)(self, peer, tag, buf, sig)
        try:
            if self._held and (peer, tag % self.tag_bound) in self._held:
                self._held[(peer, tag % self.tag_bound)].append(req)
            elif n <= SMALL_BYTES:  # SmallRecv._post, inline: the common case
                req._staging = staging = bytearray(HEADER_BYTES + n)
                req._req = self.comm.Irecv([staging, self._BYTE], peer, tag % self.tag_bound)
            else:
                req._post()
            return req
        except self._MPI.Exception as exc:
            raise self._mpi_error(exc, f"MPI receive from rank {peer} in {call_of(tag)}", peer) from None

    def begin_call(self, seq: int, sig: Sig, refusal: str | None = None) -> None:
        """Remember the call (its refusal is what MPI's own collectives tell the peers)."""
        self._call = (sig, refusal)
        self._last_tag = 2 * seq + 1
        self._call_since = time.monotonic()

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
        """Hold later receives from ``peer`` with ``tag`` (see :class:`Recv`)."""
        self._held[(peer, tag % self.tag_bound)] = collections.deque()

    def _release(self, peer: int, tag: int) -> None:
        """Post the receives held behind a large one from ``peer`` with ``tag``,
        in order, up to the next large one (which holds the rest again)."""
        held = self._held.pop((peer, tag % self.tag_bound), None)
        while held:
            req = held.popleft()
            req._post()
            if isinstance(req, LargeRecv):
                self._held[(peer, tag % self.tag_bound)].extend(held)
                return

    def _drop_next(self, peer: int, tag: int) -> None:
        """Receive and drop the next message from ``peer`` with ``tag`` (the
        payload after a refused header), so that it matches nothing else."""
        sink = np.empty(1, np.uint8)
        self._kept += [sink, self.comm.Irecv([sink, 0, self._BYTE], peer, tag % self.tag_bound)]

    # ---------------------------------------------------------- slow path

    def _watch(self, req: MpiRequest) -> bool:
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

    def _advance(self, current: MpiRequest) -> None:
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

    def _out_of_step(self, req: MpiRequest):
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
        w0, w1, w2, nbytes = HEADER.unpack_from(head)
        if nbytes > SMALL_BYTES:
            self._drop_next(peer, tag)
        return (w0, w1, w2)


    def _mpi_error(self, exc, what: str, peer: int | None = None) -> CollectiveError:
        """The library's error for the MPI error ``exc`` raised in ``what`` (see :mod:`.errors`)."""
        return mpi_error(self._MPI, self.rank, exc, what, peer)
