"""bcast algorithms (in place; ``f(ctx, buf, root)``).

Costs for p ranks and n bytes (alpha latency, beta seconds per byte):

* ``binomial``: ceil(log2 p) rounds, segmented so that a rank forwards piece
  k while piece k+1 arrives: ceil(log2 p) * (alpha + n beta) unpipelined.
* ``scatter_ring_allgather`` (van de Geijn): binomial scatter then ring
  allgather: (ceil(log2 p) + p - 1) alpha + 2 (p-1)/p n beta.
* ``scatter_recursive_doubling_allgather``: binomial scatter then recursive
  doubling allgather: 2 log2 p alpha + 2 (p-1)/p n beta (p a power of two;
  otherwise two extra full-message steps of the fold).
* ``pipelined_chain``: a chain from the root, the buffer cut into s pieces:
  (p - 2 + s) (alpha + n/s beta).
"""

from __future__ import annotations

import numpy as np

from ..context import CallContext
from ..registry import register
from ._blocks import binomial_scatter_blocks, recursive_doubling_allgather_blocks, ring_allgather_blocks
from ._folding import binomial_bcast, even_bounds, pieces, segment_elems

__all__ = ["binomial", "scatter_ring_allgather", "scatter_recursive_doubling_allgather", "pipelined_chain"]


@register("bcast", "binomial", description="binomial tree (MST), segmented and pipelined")
def binomial(ctx: CallContext, buf: np.ndarray, root: int) -> None:
    """Binomial tree from the root; large buffers travel in pipelined segments."""
    if ctx.size > 1:
        binomial_bcast(ctx, buf, root)


def _scatter_allgather(ctx: CallContext, buf: np.ndarray, root: int, allgather) -> None:
    p = ctx.size
    if p == 1:
        return
    v = (ctx.rank - root) % p
    bounds = even_bounds(buf.size, p)

    def real(u: int) -> int:
        return (u + root) % p

    binomial_scatter_blocks(ctx, buf, bounds, v, real)
    allgather(ctx, buf, bounds, v, real)


@register("bcast", "scatter_ring_allgather",
          description="van de Geijn: binomial scatter + ring allgather (large messages)")
def scatter_ring_allgather(ctx: CallContext, buf: np.ndarray, root: int) -> None:
    """Binomial scatter of p blocks, then a ring allgather."""
    _scatter_allgather(ctx, buf, root, ring_allgather_blocks)


@register("bcast", "scatter_recursive_doubling_allgather",
          description="binomial scatter + recursive doubling allgather (medium messages)")
def scatter_recursive_doubling_allgather(ctx: CallContext, buf: np.ndarray, root: int) -> None:
    """Binomial scatter of p blocks, then a recursive-doubling allgather."""
    _scatter_allgather(ctx, buf, root, recursive_doubling_allgather_blocks)


@register("bcast", "pipelined_chain", description="chain from the root, pipelined in segments")
def pipelined_chain(ctx: CallContext, buf: np.ndarray, root: int) -> None:
    """Each rank receives segment k from its predecessor and forwards it to
    its successor while segment k+1 arrives."""
    p = ctx.size
    if p == 1:
        return
    v = (ctx.rank - root) % p
    prev = (ctx.rank - 1) % p if v > 0 else None
    nxt = (ctx.rank + 1) % p if v < p - 1 else None
    segs = pieces(buf.size, segment_elems(ctx, buf.dtype)) or [(0, 0)]
    recvs = [ctx.irecv(buf[a:b], prev) for a, b in segs] if prev is not None else []
    sends = []
    for k, (a, b) in enumerate(segs):
        if recvs:
            ctx.wait(recvs[k])
        if nxt is not None:
            sends.append(ctx.isend(buf[a:b], nxt))
    ctx.waitall(sends)
