"""allgather through the shared window (b = n/p): 2F + (p-1) copy(b) direct,
or copy(b) + F + (p-1) copy(b) through the window."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct


@cost_model("allgather", "shared_window", call=False)
def allgather(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b)."""
    if p == 1 or n == 0:
        return 0.0
    b = n / p
    if direct("allgather", p, n, P):
        return 2 * P.fence + P.copy((p - 1) * b)
    return P.copy(b) + P.fence + P.copy((p - 1) * b)
