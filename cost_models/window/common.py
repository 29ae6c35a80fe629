"""What the shared-window formulas share: the algorithms' switch points."""

from __future__ import annotations

import math

from collectives.algorithms.window.tuning import PIECE_BYTES, direct_from, one_fence_limit

from ..model import Params

__all__ = ["direct", "one_fence", "pieces"]


def direct(collective: str, p: int, n: int, P: Params) -> bool:
    """Whether ``collective`` reads peers' buffers directly at ``n`` bytes (as the implementation decides)."""
    return n >= direct_from(collective, p, P.cores)


def one_fence(p: int, n: int, P: Params) -> float | None:
    """copy(n) + F + (p-1) n gamma where n takes the one-fence path (every
    rank's vector in the window, one rank or all reducing them; nothing for
    one rank or no bytes), else None."""
    if p == 1 or n == 0:
        return 0.0
    if n <= one_fence_limit(p):
        return P.copy(n) + P.fence + (p - 1) * n * P.gamma
    return None


def pieces(per_rank_bytes: float) -> int:
    """Pieces of at most ``PIECE_BYTES`` per rank that ``per_rank_bytes`` take."""
    return max(1, math.ceil(per_rank_bytes / PIECE_BYTES))
