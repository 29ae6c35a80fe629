"""gather through the shared window (the root's time): through the window,
copy(n/p) in on the senders, F per piece, the root copies (p-1)/p n out;
direct, 2F + copy(n/p): every sender writes its block into the root's
buffer at once."""

from __future__ import annotations

from ..model import Params, cost_model
from .common import direct, pieces


@cost_model("gather", "shared_window", call=False)
def gather(p: int, n: int, P: Params) -> float:
    """copy(n/p) + F per piece + copy((p-1)/p n); direct 2F + copy(n/p)."""
    if p == 1 or n == 0:
        return P.copy(n)
    rest = (p - 1) / p * n
    if direct("gather", p, n, P):
        return 2 * P.fence + P.copy(n / p)
    return P.copy(n / p) + pieces(n / p) * P.fence + P.copy(rest)
