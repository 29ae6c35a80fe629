"""alltoall algorithms (``f(ctx, sendbuf, recvbuf)``, p equal blocks; ``pairwise``
also takes uneven blocks: ``f(ctx, sendbuf, recvbuf, sendcounts, recvcounts)``).

* ``pairwise``: p - 1 exchange steps (partner rank ^ k for p a power of two,
  else send to rank + k and receive from rank - k):
  (p-1) alpha + (p-1)/p n beta.
* ``bruck``: ceil(log2 p) steps, each moving the blocks whose index has bit k
  set: ceil(log2 p) alpha + ceil(log2 p) n/2 beta, plus packing copies and
  two rotations of n bytes (wins for small blocks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..arithmetic import prefix
from ..context import CallContext
from ..registry import register
from ..signature import counts_digest

__all__ = ["pairwise", "bruck"]


@register("alltoall", "pairwise", description="p-1 pairwise exchanges (large messages; uneven blocks too)")
def pairwise(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray, sendcounts: Sequence[int] | None = None,
             recvcounts: Sequence[int] | None = None) -> None:
    """Step k exchanges one block with one partner; with counts (alltoallv),
    block i of ``sendbuf`` holds ``sendcounts[i]`` elements for rank i, and
    block i of ``recvbuf`` ``recvcounts[i]`` from rank i."""
    p, r = ctx.size, ctx.rank
    uneven = sendcounts is not None
    if not uneven:
        sendcounts = recvcounts = [sendbuf.size // p] * p
    so, ro = prefix(sendcounts), prefix(recvcounts)
    recvbuf[ro[r]:ro[r + 1]] = sendbuf[so[r]:so[r + 1]]
    pow2 = p & (p - 1) == 0
    for k in range(1, p):
        dst, src = (r ^ k, r ^ k) if pow2 else ((r + k) % p, (r - k) % p)
        out, into = sendbuf[so[dst]:so[dst + 1]], recvbuf[ro[src]:ro[src + 1]]
        if not uneven:
            ctx.sendrecv(out, dst, into, src)
            continue
        # Each message says what its sender sends and expects back; each receive, what it
        # expects and sends back: the two signatures are equal only when both ranks agree.
        w0 = ctx.sig[0]
        s = ctx.transport.isend(out, dst, ctx.tag, (w0, sendcounts[dst], counts_digest([recvcounts[dst]])))
        q = ctx.transport.irecv(into, src, ctx.tag, (w0, recvcounts[src], counts_digest([sendcounts[src]])))
        ctx.waitall((q, s))


@register("alltoall", "bruck", description="Bruck: ceil(log p) steps with packing (small messages)")
def bruck(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Rotate so block i is for rank r + i; step k sends the blocks with bit k
    set to rank r + 2^k; then rotate back."""
    p, r = ctx.size, ctx.rank
    b = sendbuf.size // p
    blocks = sendbuf.reshape(p, b)
    tmp = ctx.scratch(p * b, sendbuf.dtype, slot=0).reshape(p, b)
    tmp[:p - r] = blocks[r:]
    tmp[p - r:] = blocks[:r]
    idx = np.arange(p)
    dist = 1
    while dist < p:
        sel = idx[(idx & dist) != 0]
        out = ctx.scratch(sel.size * b, sendbuf.dtype, slot=1).reshape(sel.size, b)
        inc = ctx.scratch(sel.size * b, sendbuf.dtype, slot=2).reshape(sel.size, b)
        np.take(tmp, sel, axis=0, out=out)
        ctx.sendrecv(out.reshape(-1), (r + dist) % p, inc.reshape(-1), (r - dist) % p)
        tmp[sel] = inc
        dist <<= 1
    # tmp[i] now holds the block from rank (r - i) % p.
    out_blocks = recvbuf.reshape(p, b)
    src = (r - idx) % p
    out_blocks[src] = tmp
