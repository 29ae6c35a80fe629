"""The one exception hierarchy of the library.

Every error a collective raises is a :class:`CollectiveError`. Bad input is
detected before anything is sent (:class:`BadArgument`); a wait that runs out
raises :class:`CollectiveTimeout`; a peer that died or aborted raises
:class:`PeerLost` on every surviving rank; ranks that disagree about what they
are doing (different collectives, sizes or dtypes) raise
:class:`MismatchedCollective` where the transport can see it.
"""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "annotate",
    "abort_reason",
    "from_abort",
    "BadArgument",
    "CollectiveTimeout",
    "PeerLost",
    "MismatchedCollective",
    "TransportUnavailable",
]


class CollectiveError(RuntimeError):
    """Base class of every error raised by the library.

    Attributes (set by the communicator on errors of a collective call):
        rank: the rank that raised it.
        collective: the collective, e.g. ``"allreduce"``.
        seq: the call's sequence number (the same on every rank).
        origin: the rank where the error arose (another rank for an error
            received through an abort; None when unknown).
    """

    rank: int | None = None
    collective: str | None = None
    seq: int | None = None
    origin: int | None = None


class BadArgument(CollectiveError, ValueError):
    """An argument is invalid; raised before anything is sent."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class PeerLost(CollectiveError, ConnectionError):
    """A peer died, disconnected, or failed and aborted the job.

    Attributes:
        peer: the rank that was lost or that reported the failure (None if unknown).
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class MismatchedCollective(CollectiveError):
    """Ranks disagree about the collective, its size, dtype or root."""


class TransportUnavailable(CollectiveError):
    """A transport cannot run here (missing library, device or kernel support)."""


def annotate(exc: CollectiveError, rank: int, collective: str, seq: int, algorithm: str = "") -> CollectiveError:
    """Prefix ``exc``'s message with ``rank R, collective #seq (algorithm):``
    (once) and record those on it; returns ``exc``."""
    if exc.collective is None:
        exc.rank, exc.collective, exc.seq = rank, collective, seq
        text = str(exc.args[0]) if exc.args else ""
        own = f"rank {rank}: "
        if text.startswith(own):
            text = text[len(own):]
        where = f"{collective} #{seq}" + (f" ({algorithm})" if algorithm else "")
        head = f"rank {rank}, {where}: "
        if not text.startswith((f"{collective} #{seq}", f"call #{seq}")):
            text = head + text
        else:
            text = own + text
        exc.args = (text,) + tuple(exc.args[1:])
    return exc


_KINDS = {"CollectiveTimeout": CollectiveTimeout, "MismatchedCollective": MismatchedCollective,
          "PeerLost": PeerLost, "BadArgument": BadArgument}
_SEP = "\x1f"


def abort_reason(exc: BaseException | str) -> str:
    """The text an abort carries to the peers: the error's kind and message
    (:func:`from_abort` turns it back into an error of the same kind)."""
    if isinstance(exc, str):
        return exc
    kind = type(exc).__name__ if type(exc).__name__ in _KINDS else "PeerLost"
    if not isinstance(exc, CollectiveError):
        return f"PeerLost{_SEP}{type(exc).__name__}: {exc}"
    return f"{kind}{_SEP}{exc}"


def from_abort(text: str, peer: int, rank: int | None = None) -> CollectiveError:
    """The error a rank raises when ``peer`` aborted with ``text`` (see
    :func:`abort_reason`): of the same kind as the peer's own (PeerLost when
    the peer gave none), saying that ``peer`` aborted and why."""
    kind, sep, message = text.partition(_SEP)
    if not sep:
        kind, message = "PeerLost", text
    cls = _KINDS.get(kind, PeerLost)
    where = f"rank {rank}: " if rank is not None else ""
    body = f"{where}rank {peer} aborted: {message}"
    err = PeerLost(body, peer) if cls is PeerLost else cls(body)
    err.origin = peer
    return err
