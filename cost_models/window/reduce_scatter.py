"""reduce_scatter through the shared window (b = n/p): 2F + (p-1) copy(b) +
(p-1) b gamma direct, or copy((p-1) b) + F + (p-1) b gamma through the window."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct


@cost_model("reduce_scatter", "shared_window", call=False)
def reduce_scatter(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b) + (p-1) b gamma."""
    if p == 1:
        return P.copy(n)
    b = n / p
    if direct("reduce_scatter", p, n, P):
        return 2 * P.fence + P.copy((p - 1) * b) + (p - 1) * b * P.gamma
    return P.copy((p - 1) * b) + P.fence + (p - 1) * b * P.gamma
