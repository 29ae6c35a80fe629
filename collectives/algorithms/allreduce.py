"""allreduce algorithms (p ranks, n bytes, alpha-beta-gamma costs; p' = 2^floor(log2 p),
f = 1 when p is not a power of two, else 0).

* ``mst``: binomial reduce to rank 0, then binomial bcast from rank 0, both
  segmented. T = 2 lg p (alpha + n beta) + lg p n gamma unsegmented.
* ``ring``: bucket algorithm: ring reduce-scatter (p-1 steps) then ring
  allgather (p-1 steps), one stream of segments.
  T = 2 (p-1) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma.
* ``recursive_doubling``: fold p onto p', lg p' steps exchanging and reducing
  the whole buffer, unfold.
  T = (lg p' + 2f) alpha + (lg p' + 2f) n beta + (lg p' + f) n gamma.
* ``rabenseifner``: fold, recursive-halving reduce-scatter, recursive-doubling
  allgather, unfold. T = (2 lg p' + 2f) alpha + (2 n (p'-1)/p' + 2 f n) beta
  + (n (p'-1)/p' + f n) gamma.
"""

from __future__ import annotations

import numpy as np

from ..context import CallContext
from ..ops import Op
from ..registry import register
from ._folding import (Fold, binomial_bcast, binomial_reduce, even_bounds, exchange_reduce,
                       fold_in, recursive_doubling_allgather, recursive_halving, recv_segments,
                       ring_pipeline, send_segments)

__all__ = ["allreduce_mst", "allreduce_ring", "allreduce_recursive_doubling",
           "allreduce_rabenseifner"]


def _unfold(ctx: CallContext, fold: Fold, buf: np.ndarray) -> None:
    """Return the full result to the ranks that sat out the folded phase."""
    if fold.folded_out:
        ctx.waitall(recv_segments(ctx, buf, fold.rank + 1))
    elif fold.absorbs:
        ctx.waitall(send_segments(ctx, buf, fold.rank - 1))


@register("allreduce", "mst", description="binomial reduce to rank 0 + binomial bcast")
def allreduce_mst(ctx: CallContext, buf: np.ndarray, op: Op) -> None:
    """Allreduce as a binomial-tree reduce followed by a binomial-tree bcast.

    Args:
        ctx: the call context.
        buf: this rank's data, replaced by the reduction.
        op: the reduction.
    """
    binomial_reduce(ctx, buf, 0, op, in_place=True)
    binomial_bcast(ctx, buf, 0)


@register("allreduce", "ring",
          description="bucket: ring reduce-scatter + ring allgather, streamed in segments")
def allreduce_ring(ctx: CallContext, buf: np.ndarray, op: Op) -> None:
    """Allreduce around a ring (reduce-scatter then allgather, pipelined).

    Args:
        ctx: the call context.
        buf: this rank's data, replaced by the reduction.
        op: the reduction.
    """
    bounds = even_bounds(buf.size, ctx.size)
    ring_pipeline(ctx, buf, lambda b: buf[bounds[b]:bounds[b + 1]], bounds, op, allgather=True)


@register("allreduce", "recursive_doubling",
          description="recursive doubling on the whole buffer, non-powers of two folded")
def allreduce_recursive_doubling(ctx: CallContext, buf: np.ndarray, op: Op) -> None:
    """Allreduce by recursive doubling (short messages).

    Args:
        ctx: the call context.
        buf: this rank's data, replaced by the reduction.
        op: the reduction.
    """
    fold = Fold(ctx.rank, ctx.size)
    fold_in(ctx, fold, buf, buf, op)
    if not fold.folded_out:
        mask = 1
        while mask < fold.pof2:
            exchange_reduce(ctx, fold.real(fold.newrank ^ mask), buf, buf, op)
            mask <<= 1
    _unfold(ctx, fold, buf)


@register("allreduce", "rabenseifner",
          description="recursive-halving reduce-scatter + recursive-doubling allgather")
def allreduce_rabenseifner(ctx: CallContext, buf: np.ndarray, op: Op) -> None:
    """Rabenseifner's allreduce (long messages).

    Args:
        ctx: the call context.
        buf: this rank's data, replaced by the reduction.
        op: the reduction.
    """
    fold = Fold(ctx.rank, ctx.size)
    fold_in(ctx, fold, buf, buf, op)
    if not fold.folded_out:
        bounds = even_bounds(buf.size, fold.pof2)
        recursive_halving(ctx, fold, buf, bounds, op)
        recursive_doubling_allgather(ctx, fold, buf, bounds)
    _unfold(ctx, fold, buf)
