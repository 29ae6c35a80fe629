"""Waiting on an MPI operation: polls against the deadline, then the slow path.

A wait polls its MPI request; after :data:`SPIN` polls, each further poll
also runs the transport's slow path (:meth:`~.transport.MpiTransport._watch`:
aborts, goodbyes and status queries on the control communicator, a peer out
of step or gone), sleeping up to :data:`NAP` between polls. A sign of
trouble fails the wait once it has held :data:`CONFIRM_SECONDS`. A wait that
runs out raises the timeout's verdict (:mod:`.diagnosis`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from collectives.errors import CollectiveError
from collectives.transport import Request

from .tags import call_of

if TYPE_CHECKING:
    from .transport import MpiTransport

__all__ = ["MpiRequest", "CONFIRM_SECONDS", "SPIN", "NAP", "KEPT", "finalize_before_teardown"]

#: MPI requests still under way that no one waits for any more (a wait that
#: failed or was given up), with their buffers: MPI may still write into a
#: receive's buffer until MPI_Finalize, after the transport and its user's
#: arrays are gone, so they live as long as the process, and
#: :func:`finalize_before_teardown` ends MPI before Python frees them.
KEPT: list = []
_finalize_registered = False


def finalize_before_teardown(MPI) -> None:
    """Have MPI finalized by Python's ``atexit``, before the interpreter frees
    its objects (mpi4py's own finalize runs after that, when the buffers of
    receives still under way, :data:`KEPT`, are already freed memory, which
    MPI_Finalize's progress then writes into: a corrupted heap). Receives
    still under way are cancelled first. Once per process."""
    global _finalize_registered
    if _finalize_registered:
        return
    _finalize_registered = True
    import atexit

    def finalize() -> None:
        try:
            if MPI.Is_finalized() or not MPI.Is_initialized():
                return
            for req in [r for r in KEPT if isinstance(r, MPI.Request) and r]:
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass
            requests = [r for r in KEPT if isinstance(r, MPI.Request) and r]
            deadline = time.monotonic() + 1.0
            while requests and time.monotonic() < deadline:
                requests = [r for r in requests if r and not _test(MPI, r)]
            MPI.Finalize()
        except Exception:  # never in the way of the exit
            pass

    atexit.register(finalize)


def _test(MPI, req) -> bool:
    try:
        return req.Test()
    except MPI.Exception:
        return True

#: How long a sign of a lost or out-of-step peer must hold before a wait fails on it.
CONFIRM_SECONDS = 0.01
#: Polls of a request before a wait looks at the control communicator and its peer.
SPIN = 50
#: Longest sleep between polls of a wait past its spin.
NAP = 1e-4


class MpiRequest(Request):
    """An operation polled by :meth:`wait` against its deadline; after a spin,
    each poll also looks at the transport's control communicator and at the
    peer (:meth:`~.transport.MpiTransport._watch`). ``peer`` is -1 for MPI's own
    collectives (every rank)."""

    __slots__ = ("_t", "_peer", "_tag", "_done", "_error", "_suspect")

    def __init__(self, transport: "MpiTransport", peer: int, tag: int) -> None:
        self._t, self._peer, self._tag = transport, peer, tag
        self._done = False
        self._error: CollectiveError | None = None
        self._suspect: tuple[tuple, float] | None = None  # (sign of trouble, since when)

    receives = False
    #: What a wait on it does, for a timeout's message ("receiving from" rank N).
    action = "waiting on"

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
            start = time.monotonic()
            deadline = start + limit
            spins = 0
            t._waiting = self._peer if self._peer >= 0 else -2  # (what a status query hears)
            while True:
                spins += 1
                if spins > SPIN:
                    if t._watch(self):
                        return
                    if time.monotonic() > deadline:
                        raise t._timed_out(self, start, limit)
                    time.sleep(0 if spins < 1000 else NAP)
                if self._poll():
                    return
        except t._MPI.Exception as exc:
            raise self._fail(t._mpi_error(exc, self._what())) from None
        finally:
            t._waiting = -1

    def _what(self) -> str:
        return f"MPI request with rank {self._peer} in {call_of(self._tag)}"

    def __del__(self) -> None:
        # An MPI operation still under way (a wait that failed or was given
        # up) writes into or reads from its buffers later: the mpi4py request
        # holds them, so the transport keeps it.
        req = getattr(self, "_req", None)
        if req is not None and (any(req) if type(req) is list else req):
            self._t._kept.append(req)

