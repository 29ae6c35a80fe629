"""The transport plugin contract.

A transport moves contiguous byte buffers between ranks. It is kept small:

* ``rank``, ``size``, ``isend(buf, peer, tag)``, ``irecv(buf, peer, tag)``,
  ``Request.wait(timeout)``, ``Request.test()``, ``abort(reason)``, ``close()``.
* Messages between a pair of ranks are delivered in the order they were
  sent, so one tag per collective call is enough (collective calls use odd
  tags ``2 * seq + 1``, point-to-point messages even ones). A receive whose
  posted size differs from the arriving message raises
  :class:`~collectives.errors.MismatchedCollective`. Zero-byte messages are
  legal and are delivered like any other.
* Every message carries the call's signature ``sig`` (three integers, see
  :mod:`collectives.signature`; ``NO_SIG`` for point-to-point): the
  receiver compares it with its receive's through
  :func:`~collectives.signature.check_message` and fails the receive with
  the error it returns. A collective message (odd tag) from a peer for
  another call than the one a pending receive from that peer waits for
  fails that receive too (:func:`~collectives.signature.out_of_step`): the
  peer has moved past the call without sending what it waits for.
* Optional capabilities are declared in ``capabilities``, never guessed:
  ``"window"`` (the transport offers :attr:`Transport.window`, a
  :class:`~collectives.window_contract.SharedWindow`, whose own optional
  slots are declared in its ``features``), ``"native"`` (the transport
  runs its own collectives), ``"device"`` (device memory).

Transports are found through the entry-point group ``collectives.transports``;
each entry point names a :class:`Transport` subclass.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Sequence

import numpy as np

from .signature import NO_SIG, Sig
from .window_contract import SharedWindow

__all__ = ["Request", "Transport", "SharedWindow", "CompletedRequest"]


class Request(abc.ABC):
    """A pending send or receive."""

    __slots__ = ()

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until complete.

        Args:
            timeout: seconds; None waits for the transport's default timeout.

        Raises:
            CollectiveTimeout, PeerLost, MismatchedCollective.
        """

    @abc.abstractmethod
    def test(self) -> bool:
        """Return True when complete (raises the request's error if it failed)."""


class CompletedRequest(Request):
    """A request that is already complete (for sends that finish eagerly)."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> None:
        return None

    def test(self) -> bool:
        return True


COMPLETED = CompletedRequest()


class _ReduceOnCompletion(Request):
    """A receive into scratch whose completion also reduces it into place
    (:meth:`Transport.irecv_reduce`'s default)."""

    __slots__ = ("_inner", "_out", "_mine", "_tmp", "_op")

    def __init__(self, inner: Request, out: np.ndarray, mine: np.ndarray, tmp: np.ndarray, op: Any) -> None:
        self._inner, self._out, self._mine, self._tmp, self._op = inner, out, mine, tmp, op

    def _reduce(self) -> None:
        if self._op is not None:
            op, self._op = self._op, None
            op.reduce_into(self._out, self._mine, self._tmp)

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)
        self._reduce()

    def test(self) -> bool:
        if self._op is None:
            return True
        if self._inner.test():
            self._reduce()
            return True
        return False


class Transport(abc.ABC):
    """Base class of transport plugins.

    Subclasses set ``name`` and ``capabilities`` and implement the abstract
    methods. ``open`` is the constructor the library calls.
    """

    name: ClassVar[str] = "?"
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: True when a send stops reading its buffer once the receiver holds the
    #: whole message. Data that causally follows that delivery (a reply
    #: built from it) may then be received into the buffer before the send
    #: request is waited for; algorithms use this to post such receives
    #: early. False (the safe default) for MPI, whose standard forbids it.
    released_on_delivery: ClassVar[bool] = False
    #: Receives a pipelined algorithm keeps posted ahead of the one it
    #: consumes. A transport that must buffer what arrives before its
    #: receive (a byte stream read as it comes) wants them all posted early.
    receives_ahead: int = 4
    #: Cores the ranks of this host share between them (0: not known; each
    #: rank is taken to have one of its own).
    cores: int = 0
    rank: int
    size: int
    #: Default timeout in seconds for waits that pass None.
    timeout: float = 60.0

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Return (True, "") if this transport can run here, else (False, why)."""
        return True, ""

    @classmethod
    @abc.abstractmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "Transport":
        """Connect ``rank`` of ``size`` ranks of job ``job``.

        ``options`` holds transport-specific settings (addresses, secrets,
        interface names); unknown keys are ignored.
        """

    @abc.abstractmethod
    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start sending the bytes of the C-contiguous array ``buf`` to ``peer``,
        with the call's signature ``sig`` in the message's header.
        The caller must not modify ``buf`` until the request completes."""

    @abc.abstractmethod
    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start receiving a message from ``peer`` with ``tag`` into the
        C-contiguous writable array ``buf`` (exactly ``buf.nbytes`` bytes); the
        request fails when the message's signature differs from ``sig``."""

    def send(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG, timeout: float | None = None) -> None:
        """Send and wait until ``buf`` may be reused (:meth:`isend`, then wait
        up to ``timeout`` seconds); transports may override with a faster path."""
        self.isend(buf, peer, tag, sig).wait(timeout)

    def recv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG, timeout: float | None = None) -> None:
        """Receive and wait for the message (:meth:`irecv`, then wait up to
        ``timeout`` seconds); transports may override with a faster path."""
        self.irecv(buf, peer, tag, sig).wait(timeout)

    def compiled_p2p(self, gate: Any) -> Any:
        """A communicator's point-to-point calls run from C, or None (the
        default: every call takes the methods above). The object's
        ``send(buf, dst, tag)`` (which never waits: for ``send`` and
        ``isend``), ``recv(buf, src, tag)`` (which may wait a little) and
        ``take(buf, src, tag)`` (which only looks: for ``irecv``), each with
        a user's tag, not yet doubled, return True when they did the whole
        call, with every check of the Python path's, and False when they did
        nothing (the caller then takes the Python path); all three do
        nothing while ``gate.open`` is 0."""
        return None

    def begin_call(self, seq: int, sig: Sig, refusal: str | None = None) -> None:
        """A collective call with signature ``sig`` (its sequence number
        included) starts on this rank: a transport that lets peers see what
        each rank is doing (the shared window, a timeout's diagnosis)
        publishes it here. ``refusal``: why this rank, the call's root,
        refuses its own arguments (``sig`` is then marked refused, see
        :func:`~collectives.signature.refused`), for the peers' errors.
        Default: nothing."""

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Start receiving ``out.nbytes`` bytes from ``peer`` with ``tag`` and
        setting ``out = mine (op) received`` (``out`` may alias ``mine``).

        ``tmp`` (``out``'s size and dtype) is scratch the transport may receive
        into; the reduction is done by the time the request completes. A
        transport that can reduce straight from its own receive buffers
        overrides this and saves a copy; it may then reduce before ``wait``,
        so ``out`` and ``mine`` must not change while the request is pending.
        """
        return _ReduceOnCompletion(self.irecv(tmp, peer, tag, sig), out, mine, tmp, op)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request (transports may override with a faster path)."""
        for r in requests:
            r.wait(timeout)

    @abc.abstractmethod
    def abort(self, reason: str, seq: int | None = None) -> None:
        """Best effort: make every peer's pending and future waits raise the
        error ``reason`` encodes (see :func:`~collectives.errors.abort_reason`).
        ``seq``: the first call this rank did not complete (None: unknown); a
        peer still finishing an earlier call may finish it. Never blocks for
        long, never raises."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource (idempotent)."""

    # Optional capabilities -------------------------------------------------

    @property
    def window(self) -> SharedWindow | None:
        """The shared window if ``"window" in capabilities``, else None."""
        return None

    def alloc(self, nbytes: int) -> np.ndarray:
        """Memory for user buffers: shared memory where the transport has it
        (so window algorithms need no copy in), else aligned private memory.
        Returns a uint8 array of ``nbytes`` bytes, 64-byte aligned."""
        raw = np.empty(nbytes + 64, dtype=np.uint8)
        off = (-raw.ctypes.data) % 64
        return raw[off:off + nbytes]

    def native(self, collective: str) -> Any:
        """Native implementation of ``collective`` when ``"native"`` is a
        capability (a callable taking the same arguments as the algorithms)."""
        raise NotImplementedError

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
