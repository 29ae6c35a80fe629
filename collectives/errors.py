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
    "BadArgument",
    "CollectiveTimeout",
    "PeerLost",
    "MismatchedCollective",
    "TransportUnavailable",
]


class CollectiveError(RuntimeError):
    """Base class of every error raised by the library."""


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
