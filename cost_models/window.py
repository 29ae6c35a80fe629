"""Formulas of the shared-window algorithms (collectives.algorithms.window).

Their cost is memory traffic and fences, not messages: ``copy(m)`` is a
local copy of m bytes at the memory bandwidth, ``F`` one fence (a barrier
through shared memory), gamma the reduction of one byte. Below
``DIRECT_BYTES`` (times the square of the ranks per core) data goes through the window
(copy in, fence, copy out);
from it on, ranks publish their buffers (one fence) and read each other's
directly (one copy), with a closing fence.

* allreduce, n <= max(32 KiB, 1 MiB/p): copy(n) + F + (p-1) n gamma
  (every rank reduces all p vectors itself).
* allreduce, up to ``DIRECT_ALLREDUCE_BYTES`` times the ranks per core,
  through the window in pieces of at most ``PIECE_BYTES`` per rank: copy
  the (p-1)/p others reduce in, F, reduce this rank's 1/p from p sources
  ((p-1)/p n gamma), F, copy every reduced block out:
  T = 2F per piece + copy((p-1)/p n) + (p-1)/p n gamma + copy(n).
* allreduce, larger: publish F, each rank reads and reduces its 1/p from
  every rank ((p-1)/p n copy and (p-1)/p n gamma), F, reads the others'
  reduced blocks ((p-1)/p n copy), F:
  T = 3F + 2 (p-1)/p copy(n) + (p-1)/p n gamma.
* reduce_scatter: 2F + (p-1) copy(b) + (p-1) b gamma (direct), or
  copy((p-1) b) + F + (p-1) b gamma through the window.
* allgather: 2F + (p-1) copy(b) (direct), or copy(b) + F + (p-1) copy(b).
* bcast: 2F + copy(n) (direct), or 2 copy(n) + F.
"""

from __future__ import annotations

import math

from .model import Params, cost_model

from collectives.algorithms.window import (DIRECT_ALLREDUCE_BYTES, DIRECT_BYTES, PIECE_BYTES,  # noqa: F401
                                           SMALL_BYTES, SMALL_TOTAL_BYTES)


def direct_from(threshold: int, p: int, P: Params, power: int = 1) -> int:
    """Bytes from which the algorithms read peers' buffers directly:
    ``threshold`` times the ranks per core to ``power`` (as the implementation decides)."""
    return threshold * (math.ceil(p / P.cores) if P.cores else 1) ** power


def one_fence(p: int, n: int, P: Params) -> float | None:
    """copy(n) + F + (p-1) n gamma where n takes the one-fence path (every
    rank's vector in the window, one rank or all reducing them; nothing for
    one rank or no bytes), else None."""
    if p == 1 or n == 0:
        return 0.0
    if n <= max(SMALL_BYTES, SMALL_TOTAL_BYTES // p):
        return P.copy(n) + P.fence + (p - 1) * n * P.gamma
    return None


@cost_model("allreduce", "shared_window")
def allreduce(p: int, n: int, P: Params) -> float:
    """copy(n) + F + (p-1) n gamma small; pieces; 3F + 2 (p-1)/p copy(n) + (p-1)/p n gamma direct."""
    small = one_fence(p, n, P)
    if small is not None:
        return small
    share = (p - 1) / p * n
    if n < direct_from(DIRECT_ALLREDUCE_BYTES, p, P):
        pieces = max(1, math.ceil(n / PIECE_BYTES))
        return 2 * pieces * P.fence + P.copy(share) + share * P.gamma + P.copy(n)
    return 3 * P.fence + 2 * P.copy(share) + share * P.gamma


@cost_model("reduce_scatter", "shared_window")
def reduce_scatter(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b) + (p-1) b gamma."""
    if p == 1:
        return P.copy(n)
    b = n / p
    if n >= direct_from(DIRECT_BYTES, p, P, 2):
        return 2 * P.fence + P.copy((p - 1) * b) + (p - 1) * b * P.gamma
    return P.copy((p - 1) * b) + P.fence + (p - 1) * b * P.gamma


@cost_model("allgather", "shared_window")
def allgather(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b)."""
    if p == 1 or n == 0:
        return 0.0
    b = n / p
    if n >= direct_from(DIRECT_BYTES, p, P, 2):
        return 2 * P.fence + P.copy((p - 1) * b)
    return P.copy(b) + P.fence + P.copy((p - 1) * b)


@cost_model("bcast", "shared_window")
def bcast(p: int, n: int, P: Params) -> float:
    """2F + copy(n)."""
    if p == 1 or n == 0:
        return 0.0
    if n >= direct_from(DIRECT_BYTES, p, P, 2):
        return 2 * P.fence + P.copy(n)
    return 2 * P.copy(n) + P.fence
