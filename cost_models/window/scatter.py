"""scatter through the shared window: the root copies (p-1)/p n in, F per
piece, each rank copies n/p out; direct, 2F + copy(n/p)."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct, filled, pieces


@cost_model("scatter", "shared_window", call=False)
def scatter(p: int, n: int, P: Params) -> float:
    """copy((p-1)/p n) + F per piece + copy(n/p); direct 2F + copy(n/p)."""
    if p == 1 or n == 0:
        return P.copy(n)
    if direct("scatter", p, n, P):
        return 2 * P.fence + P.copy(n / p)
    # in pieces, the last reader copies its block behind the root's last copy: one piece after it
    return P.copy((p - 1) / p * n) + pieces(n) * P.fence + filled(n / p, n / p, n, p, P)
