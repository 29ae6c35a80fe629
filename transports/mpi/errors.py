"""MPI's errors as the library's.

Both communicators use ``MPI_ERRORS_RETURN``: an MPI error comes back to
the caller as an exception and becomes one of the library's errors: a
truncated message :class:`~collectives.errors.MismatchedCollective`, an
argument MPI refuses :class:`~collectives.errors.BadArgument`, anything
else :class:`~collectives.errors.PeerLost`.
"""

from __future__ import annotations

from typing import Any

from collectives.errors import BadArgument, CollectiveError, MismatchedCollective, PeerLost

__all__ = ["mpi_error"]


def mpi_error(MPI: Any, rank: int, exc: Any, what: str, peer: int | None = None) -> CollectiveError:
    """The library's error for the MPI error ``exc`` (of the module ``MPI``)
    raised on ``rank`` in ``what``."""
    code = exc.Get_error_class()
    lines = [line.strip() for line in exc.Get_error_string().splitlines() if line.strip()]
    detail = lines[-1] if lines else f"MPI error class {code}"
    if code == MPI.ERR_TRUNCATE:
        return MismatchedCollective(f"rank {rank}: {what}: a message larger than the receive arrived "
                                    f"({detail})")
    if code in (MPI.ERR_ARG, MPI.ERR_BUFFER, MPI.ERR_COUNT, MPI.ERR_TYPE, MPI.ERR_TAG, MPI.ERR_RANK,
                MPI.ERR_ROOT, MPI.ERR_OP):
        return BadArgument(f"rank {rank}: {what}: MPI refused an argument ({detail})")
    return PeerLost(f"rank {rank}: {what} failed in MPI ({detail})", peer)
