"""reduce algorithms (p ranks, n bytes, alpha-beta-gamma costs; s segments of a large buffer).

* ``binomial``: minimum spanning tree; each rank reduces its children's data
  and sends the result to its parent, segment by segment so the tree levels
  overlap. T = lg p (alpha + n beta + n gamma) unsegmented;
  about (lg p + s - 1)(alpha + n/s (beta + gamma)) pipelined.
* ``rabenseifner``: reduce-scatter by recursive halving (p folded onto
  p' = 2^floor(log2 p)), then a binomial gather of the reduced blocks to the
  root. T = 2 lg p' alpha + 2 n (p'-1)/p' beta + n (p'-1)/p' gamma,
  plus (2 alpha + 2 n beta + n gamma) when p is not a power of two.
"""

from __future__ import annotations

import numpy as np

from ..context import CallContext
from ..ops import Op
from ..registry import register
from ._folding import (WORK, Fold, binomial_gather, binomial_reduce, even_bounds, fold_in,
                       recursive_halving)

__all__ = ["reduce_binomial", "reduce_rabenseifner"]


@register("reduce", "binomial",
          description="binomial tree (MST), segmented and pipelined for large buffers")
def reduce_binomial(ctx: CallContext, buf: np.ndarray, root: int, op: Op) -> None:
    """Reduce to ``root`` along a binomial tree.

    Args:
        ctx: the call context.
        buf: this rank's data; the result on ``root`` (others unchanged).
        root: the rank that gets the result.
        op: the reduction.
    """
    binomial_reduce(ctx, buf, root, op, in_place=False)


@register("reduce", "rabenseifner",
          description="recursive-halving reduce-scatter + binomial gather (long messages)")
def reduce_rabenseifner(ctx: CallContext, buf: np.ndarray, root: int, op: Op) -> None:
    """Rabenseifner's reduce: reduce-scatter by recursive halving, then gather.

    Args:
        ctx: the call context.
        buf: this rank's data; the result on ``root`` (others unchanged).
        root: the rank that gets the result.
        op: the reduction.
    """
    rank = ctx.rank
    fold = Fold(rank, ctx.size)
    work = buf if rank == root else ctx.scratch(buf.size, buf.dtype, WORK)
    in_work = fold_in(ctx, fold, buf, work, op)
    # A folded-out root is stood in for by the rank above it, which hands it the result.
    root_nr = fold.newrank_of(root) if fold.newrank_of(root) >= 0 else fold.newrank_of(root + 1)
    if fold.folded_out:
        if rank == root:
            ctx.recv(buf, rank + 1)
        return
    bounds = even_bounds(buf.size, fold.pof2)
    recursive_halving(ctx, fold, work, bounds, op, None if in_work else buf)
    binomial_gather(ctx, fold, work, bounds, root_nr)
    if fold.newrank == root_nr and rank != root:
        ctx.send(work, root)
