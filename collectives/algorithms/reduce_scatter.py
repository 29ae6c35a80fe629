"""reduce_scatter algorithms (p ranks, n bytes in all, alpha-beta-gamma costs).

* ``recursive_halving``: fold p onto p' = 2^floor(log2 p) (the first 2(p-p')
  ranks pair up, evens hand their data to odds), log2 p' halving steps each
  exchanging and reducing half the remaining data, then the odds return the
  folded-out ranks' blocks.
  T = (lg p' + 2[p'<p]) alpha + (n(p'-1)/p' + 2n[p'<p]) beta + (n(p'-1)/p' + n[p'<p]) gamma.
* ``ring``: p-1 ring steps; in each, every rank forwards one partially
  reduced block to its right neighbour and reduces the block arriving from
  its left, streamed in segments. T = (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..context import CallContext
from ..ops import Op
from ..registry import register
from ..arithmetic import prefix
from ._folding import WORK, Fold, fold_in, recursive_halving, ring_pipeline

__all__ = ["reduce_scatter_recursive_halving", "reduce_scatter_ring"]


@register("reduce_scatter", "recursive_halving",
          description="fold to a power of two, recursive halving, unfold (MPICH, short messages)")
def reduce_scatter_recursive_halving(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray,
                                     counts: Sequence[int], op: Op) -> None:
    """Reduce-scatter by recursive halving with non-power-of-two folding.

    Args:
        ctx: the call context.
        sendbuf: p blocks of ``counts[i]`` elements (unchanged).
        recvbuf: receives the reduced block ``ctx.rank``.
        counts: elements per block.
        op: the reduction.
    """
    p, rank = ctx.size, ctx.rank
    if p == 1:
        compiled.copy(recvbuf, sendbuf)
        return
    fold = Fold(rank, p)
    displs = prefix(counts)
    if fold.folded_out:
        fold_in(ctx, fold, sendbuf, sendbuf, op)
        ctx.recv(recvbuf, rank + 1)
        return
    work = ctx.scratch(displs[-1], sendbuf.dtype, WORK)
    in_work = fold_in(ctx, fold, sendbuf, work, op)
    bounds = [displs[fold.first_block(nr)] for nr in range(fold.pof2)] + [displs[-1]]
    recursive_halving(ctx, fold, work, bounds, op, None if in_work else sendbuf)
    if fold.absorbs:  # hand the folded-out rank below its block
        send = ctx.isend(work[displs[rank - 1]:displs[rank]], rank - 1)
        compiled.copy(recvbuf, work[displs[rank]:displs[rank + 1]])
        ctx.wait(send)
    else:
        compiled.copy(recvbuf, work[displs[rank]:displs[rank + 1]])


@register("reduce_scatter", "ring",
          description="p-1 ring steps, one block reduced per step, streamed in segments")
def reduce_scatter_ring(ctx: CallContext, sendbuf: np.ndarray, recvbuf: np.ndarray,
                        counts: Sequence[int], op: Op) -> None:
    """Reduce-scatter around a ring (bucket algorithm).

    Args:
        ctx: the call context.
        sendbuf: p blocks of ``counts[i]`` elements (unchanged).
        recvbuf: receives the reduced block ``ctx.rank``.
        counts: elements per block.
        op: the reduction.
    """
    bounds = prefix(counts)
    partial = ctx.scratch(bounds[-1], sendbuf.dtype, WORK)

    def dest_of(block: int) -> np.ndarray:
        if block == ctx.rank:
            return recvbuf
        return partial[bounds[block]:bounds[block + 1]]

    ring_pipeline(ctx, sendbuf, dest_of, bounds, op, allgather=False)
