"""reduce through the shared window: n <= max(32 KiB, 1 MiB/p) (2 MiB where
each rank has a core), copy(n) + F + (p-1) n gamma (the root reduces every region); larger, per piece 2F,
copy((p-1)/p n) in, the reduction of a 1/p block from p sources
((p-1)/p n gamma; the root's block straight into its buffer), and the
root copies the others' (p-1)/p n out. Where ranks share cores, from
REDUCE_TWO_STEPS_FROM to a half (taken as PIECE_BYTES), the same in one
call of two steps: 2F + 2 copy((p-1)/p n) + (p-1)/p n gamma; from its span
in COMPILED_DIRECT (1 MiB where ranks share cores, 2 MiB where each has a
core) on, one direct call: each rank reduces its 1/p from every rank's
buffer (in their pools: nothing copied) and writes it into the root's:
2F + copy(n/p) + (p-1)/p n gamma."""

from __future__ import annotations

from ..model import Params, cost_model
from collectives.algorithms.window.tuning import PIECE_BYTES, compiled_direct, reduce_one_fence_limit, reduce_two_steps

from .common import one_fence, pieces


@cost_model("reduce", "shared_window", call=False)
def reduce(p: int, n: int, P: Params) -> float:
    """copy(n) + F + (p-1) n gamma small; 2F per piece (or two steps on shared cores) + 2 copy((p-1)/p n) +
    (p-1)/p n gamma; the direct call 2F + copy(n/p) + (p-1)/p n gamma."""
    share = (p - 1) / p * n
    if p > 1 and compiled_direct("reduce", n, p, P.cores):
        return 2 * P.fence + P.copy(n / p) + share * P.gamma
    if n < PIECE_BYTES and reduce_two_steps(n, p, P.cores):
        return 2 * P.fence + 2 * P.copy(share) + share * P.gamma
    small = one_fence(p, n, P, reduce_one_fence_limit(p, P.cores))
    if small is not None:
        return small
    return 2 * pieces(n) * P.fence + 2 * P.copy(share) + share * P.gamma
