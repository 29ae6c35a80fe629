"""What the shared-window formulas share: the algorithms' switch points."""

from __future__ import annotations

import math

from collectives.algorithms.window.tuning import (PIECE, PIECE_BYTES, compiled_direct, compiled_piece, direct_from,
                                                 one_fence_limit)

from ..model import Params

__all__ = ["direct", "one_fence", "pieces", "filled"]


def direct(collective: str, p: int, n: int, P: Params) -> bool:
    """Whether ``collective`` reads peers' buffers directly at ``n`` bytes (as the implementation decides:
    through the pool from its ``DIRECT_FROM``, or in its direct compiled call below it)."""
    return n >= direct_from(collective, p, P.cores) or compiled_direct(collective, n, p, P.cores, P.cma_from)


def one_fence(p: int, n: int, P: Params, limit: int | None = None) -> float | None:
    """copy(n) + F + (p-1) n gamma where n takes the one-fence path (up to
    ``limit``, default :func:`one_fence_limit`: every rank's vector in the
    window, one rank or all reducing them; nothing for one rank or no
    bytes), else None."""
    if p == 1 or n == 0:
        return 0.0
    if n <= (one_fence_limit(p) if limit is None else limit):
        return P.copy(n) + P.fence + (p - 1) * n * P.gamma
    return None


def pieces(per_rank_bytes: float) -> int:
    """Pieces of at most ``PIECE_BYTES`` per rank that ``per_rank_bytes`` take."""
    return max(1, math.ceil(per_rank_bytes / PIECE_BYTES))


def filled(written: float, largest: float, n: int, p: int, P: Params) -> float:
    """The time readers wait for writers that copy ``written`` bytes into
    the window, their largest copy ``largest`` bytes, in a call of ``n``
    bytes: copy(written), or only copy(a piece) where the call runs in
    pieces (one step, see :func:`~collectives.algorithms.window.tuning.compiled_piece`):
    the readers copy behind the writers."""
    if pieces(n) == 1 and compiled_piece(int(largest), p, P.cores):
        return P.copy(min(PIECE, written))
    return P.copy(written)
