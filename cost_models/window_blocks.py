"""Formulas of the other shared-window algorithms (collectives.algorithms.window_blocks).

As in :mod:`.window`: ``copy(m)`` a local copy of m bytes, ``F`` a fence,
gamma the reduction of one byte; n is the selector's size (the p blocks
together for gather, scatter and alltoall). Through the window, a piece
is at most ``PIECE_BYTES`` per rank and costs one fence (two for reduce);
from each collective's ``DIRECT_FROM`` on (see :mod:`.window`), ranks
publish their buffers (one fence) and read each other's directly, then
fence once more.

* barrier: F.
* gather (the root's time): through the window, copy(n/p) in on the
  senders, F per piece, the root copies (p-1)/p n out; direct, 2F +
  copy((p-1)/p n).
* scatter: the root copies (p-1)/p n in, F per piece, each rank copies n/p
  out; direct, 2F + copy(n/p).
* alltoall: copy((p-1)/p n) in, F per piece, copy((p-1)/p n) out; direct,
  2F + copy((p-1)/p n).
* reduce, n <= max(32 KiB, 1 MiB/p): copy(n) + F + (p-1) n gamma (the root
  reduces every region); larger: per piece 2F, copy((p-1)/p n) in, the
  reduction of a 1/p block from p sources ((p-1)/p n gamma), and the root
  copies n out.
"""

from __future__ import annotations

import math

from .model import Params, cost_model
from .window import PIECE_BYTES, direct, one_fence


def _pieces(per_rank_bytes: float) -> int:
    return max(1, math.ceil(per_rank_bytes / PIECE_BYTES))


@cost_model("barrier", "shared_window")
def barrier(p: int, n: int, P: Params) -> float:
    """F."""
    return P.fence if p > 1 else 0.0


@cost_model("gather", "shared_window")
def gather(p: int, n: int, P: Params) -> float:
    """copy(n/p) + F per piece + copy((p-1)/p n); direct 2F + copy((p-1)/p n)."""
    if p == 1 or n == 0:
        return P.copy(n)
    rest = (p - 1) / p * n
    if direct("gather", p, n, P):
        return 2 * P.fence + P.copy(rest)
    return P.copy(n / p) + _pieces(n / p) * P.fence + P.copy(rest)


@cost_model("scatter", "shared_window")
def scatter(p: int, n: int, P: Params) -> float:
    """copy((p-1)/p n) + F per piece + copy(n/p); direct 2F + copy(n/p)."""
    if p == 1 or n == 0:
        return P.copy(n)
    if direct("scatter", p, n, P):
        return 2 * P.fence + P.copy(n / p)
    return P.copy((p - 1) / p * n) + _pieces(n) * P.fence + P.copy(n / p)


@cost_model("alltoall", "shared_window")
def alltoall(p: int, n: int, P: Params) -> float:
    """2 copy((p-1)/p n) + F per piece; direct 2F + copy((p-1)/p n)."""
    if p == 1 or n == 0:
        return P.copy(n / max(p, 1))
    rest = (p - 1) / p * n
    if direct("alltoall", p, n, P):
        return 2 * P.fence + P.copy(rest)
    return 2 * P.copy(rest) + _pieces(n) * P.fence


@cost_model("reduce", "shared_window")
def reduce(p: int, n: int, P: Params) -> float:
    """copy(n) + F + (p-1) n gamma small; 2F per piece + copy((p-1)/p n) + (p-1)/p n gamma + copy(n)."""
    small = one_fence(p, n, P)
    if small is not None:
        return small
    share = (p - 1) / p * n
    return 2 * _pieces(n) * P.fence + P.copy(share) + share * P.gamma + P.copy(n)
