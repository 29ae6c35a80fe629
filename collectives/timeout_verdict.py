"""What a timed-out call says, on every transport that can ask its peers where they are.

A rank whose wait ran out asks every peer where it is (the transport's
status query) and decides (:func:`timeout_verdict`): the ranks that did not
answer within the query's time (stopped, hung, or busy outside the library)
have not arrived; else those still in an earlier call; else, every rank
being in this call, their signatures are compared (ranks that only wait,
such as roots that disagree, exchange no message that would show it). The
error names the call, this rank, how long it waited against its timeout,
for whom, the verdict, and where each rank is.
"""

from __future__ import annotations

from typing import Sequence

from .errors import CollectiveError, CollectiveTimeout

__all__ = ["timeout_verdict"]


def _cause(silent: Sequence[str], behind: Sequence[str], mismatch: CollectiveError | None,
           query_seconds: float) -> tuple[type[CollectiveError], str]:
    late = silent or behind
    names = " and ".join(late)
    verb = "has" if len(late) == 1 else "have"
    if silent:
        return CollectiveTimeout, (f"{names} {verb} not arrived: no answer within {query_seconds:g} s "
                                   "(stopped, hung, or busy outside the library)")
    if behind:
        return CollectiveTimeout, f"{names} {verb} not arrived: still in an earlier call"
    if mismatch is not None:
        return type(mismatch), str(mismatch)
    return CollectiveTimeout, ("every rank has arrived, yet none sent what the others wait for "
                               "(do all ranks make the same calls with the same arguments?)")


def timeout_verdict(call: str, me: str, elapsed: float, limit: float, doing: str, silent: Sequence[str],
                    behind: Sequence[str], mismatch: CollectiveError | None, where: Sequence[str],
                    query_seconds: float, origin: int) -> CollectiveError:
    """The error of a call that timed out (see the module docstring).

    Args:
        call: the call, described (``allreduce #5 (ring)``).
        me: this rank, named (``rank 0 (host h, pid 11)``).
        elapsed, limit: seconds waited, and the call's timeout.
        doing: what the wait was, with whom (``receiving from rank 1``).
        silent, behind: the ranks (named) that did not answer, and those in an earlier call.
        mismatch: the disagreement of the ranks' signatures when all are in this call, else None.
        where: each rank's whereabouts, in rank order.
        query_seconds: how long the peers had to answer.
        origin: this rank (the error's ``origin``).
    """
    kind, cause = _cause(silent, behind, mismatch, query_seconds)
    error = kind(f"{call}: {me} timed out after {elapsed:.1f} s (timeout {limit:.1f} s) {doing}; "
                 f"verdict: {cause}; where each rank is: {'; '.join(where)}")
    error.origin = origin
    return error
