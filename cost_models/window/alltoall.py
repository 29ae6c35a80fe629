"""alltoall through the shared window: copy((p-1)/p n) in, F per piece,
copy((p-1)/p n) out; direct, 2F + copy((p-1)/p n)."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct, filled, pieces


@cost_model("alltoall", "shared_window", call=False)
def alltoall(p: int, n: int, P: Params) -> float:
    """2 copy((p-1)/p n) + F per piece; direct 2F + copy((p-1)/p n)."""
    if p == 1 or n == 0:
        return P.copy(n / max(p, 1))
    rest = (p - 1) / p * n
    if direct("alltoall", p, n, P):
        return 2 * P.fence + P.copy(rest)
    return filled(rest, n / p, n, p, P) + P.copy(rest) + pieces(n) * P.fence
