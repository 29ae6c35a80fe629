"""allgather algorithms (in place: ``f(ctx, buf, counts)``; this rank's block
is already in place).

* ``ring``: p - 1 steps passing one block: (p-1) alpha + (p-1)/p n beta.
* ``recursive_doubling``: log2 p steps doubling the data held:
  log2 p alpha + (p-1)/p n beta for p a power of two; otherwise the ranks
  above p' first hand their block to a partner and get the whole buffer
  back at the end (2 more steps, one of n bytes).
* ``bruck``: ceil(log2 p) steps of the dissemination pattern, any p:
  ceil(log2 p) alpha + (p-1)/p n beta, plus two local copies of n bytes
  (into a rotated buffer and back).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..context import CallContext
from ..registry import register
from ..arithmetic import prefix
from ._blocks import recursive_doubling_allgather_blocks, ring_allgather_blocks

__all__ = ["ring", "recursive_doubling", "bruck"]


def _identity(u: int) -> int:
    return u


@register("allgather", "ring", description="ring: p-1 steps of one block (large messages)")
def ring(ctx: CallContext, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Each step passes the block received last to the next rank."""
    if ctx.size > 1:
        ring_allgather_blocks(ctx, buf, prefix(counts), ctx.rank, _identity)


@register("allgather", "recursive_doubling",
          description="recursive doubling: log p steps (non-powers of two folded)")
def recursive_doubling(ctx: CallContext, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Exchange with rank ^ 2^k, doubling the blocks held each step."""
    if ctx.size > 1:
        recursive_doubling_allgather_blocks(ctx, buf, prefix(counts), ctx.rank, _identity)


@register("allgather", "bruck", description="Bruck: ceil(log p) steps for any p, then a rotation")
def bruck(ctx: CallContext, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Dissemination on a buffer rotated so that this rank's block comes first;
    step k sends the first min(2^k, p - 2^k) blocks to rank - 2^k."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    bounds = prefix(counts)
    total, shift = bounds[p], bounds[r]
    rot = prefix([counts[(r + j) % p] for j in range(p)])  # block j of tmp is block (r + j) % p
    tmp = ctx.scratch(total, buf.dtype)
    tmp[:rot[1]] = buf[bounds[r]:bounds[r + 1]]
    dist = 1
    while dist < p:
        cnt = min(dist, p - dist)
        ctx.sendrecv(tmp[:rot[cnt]], (r - dist) % p, tmp[rot[dist]:rot[dist + cnt]], (r + dist) % p)
        dist <<= 1
    buf[shift:] = tmp[:total - shift]
    buf[:shift] = tmp[total - shift:]
