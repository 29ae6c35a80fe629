"""gather algorithms (``f(ctx, sendbuf, recvbuf, root, counts)``).

* ``linear``: the root receives p - 1 messages: (p-1) alpha + (p-1)/p n beta.
* ``binomial``: ceil(log2 p) rounds, each rank sending its subtree's blocks
  at once: ceil(log2 p) alpha + (p-1)/p n beta, plus one local rotation on
  the root when root != 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..context import CallContext
from ..registry import register
from ..arithmetic import prefix
from ._blocks import binomial_gather_blocks, rotated

__all__ = ["linear", "binomial"]


@register("gather", "linear", description="each rank sends its block to the root directly")
def linear(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int,
           counts: Sequence[int]) -> None:
    """The root posts one receive per rank."""
    if ctx.rank != root:
        ctx.send(sendbuf, root)
        return
    bounds = prefix(counts)
    recvs = [ctx.irecv(recvbuf[bounds[i]:bounds[i + 1]], i) for i in range(ctx.size) if i != root]
    compiled.copy(recvbuf[bounds[root]:bounds[root + 1]], sendbuf)
    ctx.waitall(recvs)


@register("gather", "binomial", description="binomial tree; each rank forwards its subtree's blocks")
def binomial(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int,
             counts: Sequence[int]) -> None:
    """Blocks in virtual-rank order go up a binomial tree."""
    p = ctx.size
    v = (ctx.rank - root) % p
    bounds = prefix(rotated(counts, root))
    work = recvbuf if v == 0 and root == 0 else ctx.scratch(bounds[p], sendbuf.dtype)
    compiled.copy(work[bounds[v]:bounds[v + 1]], sendbuf)
    binomial_gather_blocks(ctx, work, bounds, v, lambda u: (u + root) % p)
    if v == 0 and root != 0:
        split = sum(int(c) for c in counts[:root])
        recvbuf[split:] = work[:bounds[p] - split]
        recvbuf[:split] = work[bounds[p] - split:bounds[p]]
