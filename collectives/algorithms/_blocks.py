"""Building blocks of the data-movement algorithms (bcast, scatter, gather, allgather).

Blocks are described by ``bounds`` over *virtual* ranks: block ``v`` is
``buf[bounds[v]:bounds[v + 1]]`` and belongs to virtual rank ``v``; a
virtual rank is the rank relative to a root, ``v = (rank - root) % p``.

* :func:`binomial_scatter_blocks`: the root's blocks go down a binomial tree,
  each rank receiving its subtree's contiguous range of blocks at once.
* :func:`binomial_gather_blocks`: the mirror image, towards the root.
* :func:`ring_allgather_blocks`, :func:`recursive_doubling_allgather_blocks`:
  every rank ends with every block.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..arithmetic import pow2_floor
from ..context import CallContext

__all__ = ["lowbit_parent", "binomial_scatter_blocks", "binomial_gather_blocks",
           "ring_allgather_blocks", "recursive_doubling_allgather_blocks", "rotated"]


def lowbit_parent(v: int, p: int) -> tuple[int, int]:
    """(mask, parent) of virtual rank ``v`` in a binomial tree of ``p`` ranks:
    ``v`` owns blocks ``[v, v + mask)``; the root (v = 0) has parent -1 and
    mask = the smallest power of two >= p."""
    if v == 0:
        return 1 << max(p - 1, 0).bit_length(), -1
    mask = v & -v
    return mask, v - mask


def binomial_scatter_blocks(ctx: CallContext, buf: np.ndarray, bounds: Sequence[int], v: int,
                            real: Callable[[int], int]) -> None:
    """Scatter blocks down a binomial tree over virtual ranks.

    ``buf`` holds (or receives) the blocks of this rank's subtree, starting at
    ``bounds[v]``: on the root the whole range, elsewhere ``[v, v + mask)``.
    """
    p = ctx.size
    mask, parent = lowbit_parent(v, p)
    hi = min(v + mask, p)
    if parent >= 0:
        ctx.recv(buf[bounds[v]:bounds[hi]], real(parent))
    sends = []
    m = mask >> 1
    while m > 0:
        child = v + m
        if child < p:
            sends.append(ctx.isend(buf[bounds[child]:bounds[min(child + m, p)]], real(child)))
        m >>= 1
    ctx.waitall(sends)


def binomial_gather_blocks(ctx: CallContext, buf: np.ndarray, bounds: Sequence[int], v: int,
                           real: Callable[[int], int]) -> None:
    """Gather blocks up a binomial tree; this rank's own block is in place."""
    p = ctx.size
    mask, parent = lowbit_parent(v, p)
    recvs = []
    m = 1
    while m < mask:
        child = v + m
        if child < p:
            recvs.append(ctx.irecv(buf[bounds[child]:bounds[min(child + m, p)]], real(child)))
        m <<= 1
    ctx.waitall(recvs)
    if parent >= 0:
        ctx.send(buf[bounds[v]:bounds[min(v + mask, p)]], real(parent))


def ring_allgather_blocks(ctx: CallContext, buf: np.ndarray, bounds: Sequence[int], v: int,
                          real: Callable[[int], int]) -> None:
    """p - 1 steps: pass the block received last to the next rank."""
    p = ctx.size
    nxt, prv = real((v + 1) % p), real((v - 1) % p)
    for s in range(p - 1):
        out, inc = (v - s) % p, (v - s - 1) % p
        ctx.sendrecv(buf[bounds[out]:bounds[out + 1]], nxt, buf[bounds[inc]:bounds[inc + 1]], prv)


def _ranges(group: int, size: int, pof2: int, p: int) -> list[tuple[int, int]]:
    """Blocks held by the group of ``size`` virtual ranks starting at ``group``
    after folding: its own, plus those of the folded-in ranks ``v + pof2``."""
    out = [(group, group + size)]
    lo, hi = group + pof2, min(group + size + pof2, p)
    if lo < hi:
        out.append((lo, hi))
    return out


def recursive_doubling_allgather_blocks(ctx: CallContext, buf: np.ndarray, bounds: Sequence[int],
                                        v: int, real: Callable[[int], int]) -> None:
    """log2(p') exchange steps doubling the blocks held; non-powers of two are
    folded: virtual ranks v >= p' first hand their block to v - p', and get
    the whole result back at the end."""
    p = ctx.size
    pof2 = pow2_floor(p)

    def part(a: int, b: int) -> np.ndarray:
        return buf[bounds[a]:bounds[b]]

    if v >= pof2:
        ctx.send(part(v, v + 1), real(v - pof2))
        ctx.recv(buf[bounds[0]:bounds[p]], real(v - pof2))
        return
    if v + pof2 < p:
        ctx.recv(part(v + pof2, v + pof2 + 1), real(v + pof2))
    mask = 1
    while mask < pof2:
        partner = v ^ mask
        mine, theirs = v & ~(mask - 1), partner & ~(mask - 1)
        reqs = [ctx.irecv(part(a, b), real(partner)) for a, b in _ranges(theirs, mask, pof2, p)]
        reqs += [ctx.isend(part(a, b), real(partner)) for a, b in _ranges(mine, mask, pof2, p)]
        ctx.waitall(reqs)
        mask <<= 1
    if v + pof2 < p:
        ctx.send(buf[bounds[0]:bounds[p]], real(v + pof2))


def rotated(counts: Sequence[int], root: int) -> list[int]:
    """``counts`` in virtual-rank order (virtual rank v is rank (v + root) % p)."""
    p = len(counts)
    return [int(counts[(v + root) % p]) for v in range(p)]
