"""Formulas of the shared-window algorithms (collectives.algorithms.window).

Their cost is memory traffic and fences, not messages: ``copy(m)`` is a
local copy of m bytes at the memory bandwidth, ``F`` one fence (a barrier
through shared memory), gamma the reduction of one byte. Below each
collective's ``DIRECT_FROM`` (see
:func:`collectives.algorithms.window.direct_from`) data goes through the
window (copy in, fence, copy out); from it on, ranks publish their buffers
(one fence) and read each other's directly (one copy), with a closing
fence. Where the algorithms read directly only from buffers in huge pages
(``DIRECT_FROM``'s ``huge``), the models assume such buffers, as
calibration's are; on 4 KiB pages the pieces run instead.

* allreduce, n <= max(32 KiB, 1 MiB/p): copy(n) + F + (p-1) n gamma
  (every rank reduces all p vectors itself).
* allreduce, below its ``DIRECT_FROM``, through the window in pieces of
  at most ``PIECE_BYTES`` per rank: copy
  the (p-1)/p others reduce in, F, reduce this rank's 1/p from p sources
  ((p-1)/p n gamma), F, copy every reduced block out:
  T = 2F per piece + copy((p-1)/p n) + (p-1)/p n gamma + copy(n).
* allreduce, larger: publish F, each rank reads and reduces its 1/p from
  every rank ((p-1)/p n copy and (p-1)/p n gamma) and writes it into every
  other rank's buffer ((p-1)/p n copy), F:
  T = 2F + 2 (p-1)/p copy(n) + (p-1)/p n gamma.
* reduce_scatter: 2F + (p-1) copy(b) + (p-1) b gamma (direct), or
  copy((p-1) b) + F + (p-1) b gamma through the window.
* allgather: 2F + (p-1) copy(b) (direct), or copy(b) + F + (p-1) copy(b).
* bcast: 2F + copy(n) (direct), or 2 copy(n) + F.
"""

from __future__ import annotations

import math

from .model import Params, cost_model

from collectives.algorithms.window import PIECE_BYTES, SMALL_BYTES, SMALL_TOTAL_BYTES, direct_from


def direct(collective: str, p: int, n: int, P: Params) -> bool:
    """Whether ``collective`` reads peers' buffers directly at ``n`` bytes (as the implementation decides)."""
    return n >= direct_from(collective, p, P.cores)


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
    """copy(n) + F + (p-1) n gamma small; pieces; 2F + 2 (p-1)/p copy(n) + (p-1)/p n gamma direct."""
    small = one_fence(p, n, P)
    if small is not None:
        return small
    share = (p - 1) / p * n
    if not direct("allreduce", p, n, P):
        pieces = max(1, math.ceil(n / PIECE_BYTES))
        return 2 * pieces * P.fence + P.copy(share) + share * P.gamma + P.copy(n)
    return 2 * P.fence + 2 * P.copy(share) + share * P.gamma


@cost_model("reduce_scatter", "shared_window")
def reduce_scatter(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b) + (p-1) b gamma."""
    if p == 1:
        return P.copy(n)
    b = n / p
    if direct("reduce_scatter", p, n, P):
        return 2 * P.fence + P.copy((p - 1) * b) + (p - 1) * b * P.gamma
    return P.copy((p - 1) * b) + P.fence + (p - 1) * b * P.gamma


@cost_model("allgather", "shared_window")
def allgather(p: int, n: int, P: Params) -> float:
    """2F + (p-1) copy(b)."""
    if p == 1 or n == 0:
        return 0.0
    b = n / p
    if direct("allgather", p, n, P):
        return 2 * P.fence + P.copy((p - 1) * b)
    return P.copy(b) + P.fence + P.copy((p - 1) * b)


@cost_model("bcast", "shared_window")
def bcast(p: int, n: int, P: Params) -> float:
    """2F + copy(n)."""
    if p == 1 or n == 0:
        return 0.0
    if direct("bcast", p, n, P):
        return 2 * P.fence + P.copy(n)
    return 2 * P.copy(n) + P.fence
