"""bcast through the shared window: 2F + copy(n) direct, or 2 copy(n) + F
through the window (copy(n) + copy(a piece) + F where it runs in pieces)."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct, filled


@cost_model("bcast", "shared_window", call=False)
def bcast(p: int, n: int, P: Params) -> float:
    """2F + copy(n)."""
    if p == 1 or n == 0:
        return 0.0
    if direct("bcast", p, n, P):
        return 2 * P.fence + P.copy(n)
    return filled(n, n, n, p, P) + P.copy(n) + P.fence
