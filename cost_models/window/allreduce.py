"""allreduce through the shared window.

* from its span in ``COMPILED_DIRECT`` while (p-1)/p n fits a half of the
  window (taken as PIECE_BYTES), or up to its ``DIRECT_FROM``: one direct
  compiled call, publish F, each rank reduces its
  1/p straight from every rank's buffer (in their pools: nothing copied)
  and writes it into every other rank's ((p-1)/p n copy), F:
  T = 2F + copy((p-1)/p n) + (p-1)/p n gamma.
* where ranks share cores, and at 2 ranks, from 16 KiB to a half of the
  window (taken as PIECE_BYTES): one call of two steps, copy in the
  (p-1)/p the peers reduce, F, reduce this rank's 1/p from p sources into
  the other half, F, copy every reduced block out:
  T = copy((p-1)/p n) + 2F + (p-1)/p n gamma + copy(n).
* n <= max(32 KiB, 1 MiB/p): copy(n) + F + (p-1) n gamma (every rank
  reduces all p vectors itself).
* below its ``DIRECT_FROM``, in pieces: copy the (p-1)/p others reduce in,
  F, reduce this rank's 1/p from p sources ((p-1)/p n gamma), F, copy
  every reduced block out:
  T = 2F per piece + copy((p-1)/p n) + (p-1)/p n gamma + copy(n).
* larger: publish F, each rank reads and reduces its 1/p from every rank
  ((p-1)/p n copy and (p-1)/p n gamma) and writes it into every other
  rank's buffer ((p-1)/p n copy), F:
  T = 2F + 2 (p-1)/p copy(n) + (p-1)/p n gamma.
"""

from __future__ import annotations

from ..model import Params, cost_model
from collectives.algorithms.window.tuning import PIECE_BYTES, allreduce_two_steps, compiled_direct, direct_from

from .common import direct, one_fence, pieces


@cost_model("allreduce", "shared_window", call=False)
def allreduce(p: int, n: int, P: Params) -> float:
    """2F + (p-1)/p (copy(n) + n gamma) by the direct call; copy(n) + F + (p-1) n gamma small; two steps on shared
    cores or at 2 ranks; pieces; 2F + 2 (p-1)/p copy(n) + (p-1)/p n gamma direct."""
    if p > 1 and compiled_direct("allreduce", n, p, P.cores) and (
            (p - 1) * n <= p * PIECE_BYTES or n < direct_from("allreduce", p, P.cores)):
        share = (p - 1) / p * n
        return 2 * P.fence + P.copy(share) + share * P.gamma
    if n < PIECE_BYTES and allreduce_two_steps(n, p, P.cores):
        share = (p - 1) / p * n
        return P.copy(share) + 2 * P.fence + share * P.gamma + P.copy(n)
    small = one_fence(p, n, P)
    if small is not None:
        return small
    share = (p - 1) / p * n
    if not direct("allreduce", p, n, P):
        return 2 * pieces(n) * P.fence + P.copy(share) + share * P.gamma + P.copy(n)
    return 2 * P.fence + 2 * P.copy(share) + share * P.gamma
