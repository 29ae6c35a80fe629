"""scatter algorithms (``f(ctx, sendbuf, recvbuf, root, counts)``).

* ``linear``: the root sends p - 1 messages: (p-1) alpha + (p-1)/p n beta.
* ``binomial``: ceil(log2 p) rounds, each rank receiving its subtree's
  blocks at once: ceil(log2 p) alpha + (p-1)/p n beta, plus one local
  rotation on the root when root != 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..context import CallContext
from ..registry import register
from ..arithmetic import prefix
from ._blocks import binomial_scatter_blocks, rotated

__all__ = ["linear", "binomial"]


@register("scatter", "linear", description="root sends each rank its block directly")
def linear(ctx: CallContext, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int,
           counts: Sequence[int]) -> None:
    """The root posts one send per rank."""
    if ctx.rank != root:
        ctx.recv(recvbuf, root)
        return
    bounds = prefix(counts)
    sends = [ctx.isend(sendbuf[bounds[i]:bounds[i + 1]], i) for i in range(ctx.size) if i != root]
    compiled.copy(recvbuf, sendbuf[bounds[root]:bounds[root + 1]])
    ctx.waitall(sends)


@register("scatter", "binomial", description="binomial tree; each rank forwards its subtree's blocks")
def binomial(ctx: CallContext, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int,
             counts: Sequence[int]) -> None:
    """Blocks in virtual-rank order go down a binomial tree."""
    p = ctx.size
    v = (ctx.rank - root) % p
    rc = rotated(counts, root)
    bounds = prefix(rc)
    if v == 0:
        if root == 0:
            work = sendbuf
        else:
            work = ctx.scratch(bounds[p], recvbuf.dtype)
            split = sum(int(c) for c in counts[:root])
            work[:bounds[p] - split] = sendbuf[split:]
            work[bounds[p] - split:] = sendbuf[:split]
    else:
        work = ctx.scratch(bounds[p], recvbuf.dtype)
    binomial_scatter_blocks(ctx, work, bounds, v, lambda u: (u + root) % p)
    compiled.copy(recvbuf, work[bounds[v]:bounds[v + 1]])
