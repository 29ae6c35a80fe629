"""Building blocks shared by the reduce, allreduce and reduce_scatter algorithms.

* :class:`Fold`: MPICH's folding of a non-power-of-two world onto p' = 2^floor(log2 p)
  ranks: of the first 2r ranks (r = p - p'), each even rank hands its data to
  the odd rank above it and sits out; the p' remaining ranks get new ranks.
* segmented point-to-point (:func:`pieces`, :func:`send_segments`,
  :func:`recv_reduce`): long messages travel in ``ctx.segment_bytes`` pieces
  so that reducing one piece overlaps the arrival of the next.
* :func:`recursive_halving`, :func:`recursive_doubling_allgather`,
  :func:`binomial_gather` over the folded group, and :func:`ring_pipeline`,
  the streaming ring reduce-scatter (+ allgather).
* :func:`binomial_reduce` and :func:`binomial_bcast`, segmented and pipelined.

Blocks are described by ``bounds``: block ``i`` is ``work[bounds[i]:bounds[i+1]]``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .. import compiled
from ..arithmetic import pow2_floor
from ..context import CallContext
from ..ops import Op
from ..transport import Request

__all__ = [
    "Fold", "pieces", "even_bounds", "send_segments", "recv_segments", "recv_reduce",
    "exchange_reduce", "fold_in", "recursive_halving", "recursive_doubling_allgather",
    "binomial_gather", "ring_pipeline", "binomial_reduce", "binomial_bcast",
    "WORK", "TMP", "ACC32", "ROTATE",
]

# Scratch slots these algorithms use (ctx.scratch); distinct slots never alias.
WORK, TMP, ACC32, ROTATE = 0, 1, 2, 3


class Fold:
    """The power-of-two group a world of ``size`` ranks is folded onto.

    Attributes:
        rank, size: this rank and the world size.
        pof2: the group size p' (largest power of two <= size).
        rem: size - pof2; ranks below ``2 * rem`` are paired.
        newrank: this rank's rank in the group, or -1 if it sits out (even
            ranks below ``2 * rem``).
    """

    __slots__ = ("rank", "size", "pof2", "rem", "newrank")

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.pof2 = pow2_floor(size)
        self.rem = size - self.pof2
        self.newrank = self.newrank_of(rank)

    def newrank_of(self, rank: int) -> int:
        """The group rank of world ``rank`` (-1 for a rank that sits out)."""
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else -1
        return rank - self.rem

    def real(self, newrank: int) -> int:
        """The world rank of group rank ``newrank``."""
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem

    def first_block(self, newrank: int) -> int:
        """The first world block group rank ``newrank`` stands for (it stands for
        two, ``2n`` and ``2n + 1``, when it absorbed a folded-out rank)."""
        return 2 * newrank if newrank < self.rem else newrank + self.rem

    @property
    def folded_out(self) -> bool:
        return self.newrank < 0

    @property
    def absorbs(self) -> bool:
        """True if this rank received a folded-out rank's data."""
        return self.newrank >= 0 and self.rank < 2 * self.rem


# ---------------------------------------------------------------- segmenting

def segment_elems(ctx: CallContext, dtype: np.dtype) -> int:
    """Elements per pipeline segment for ``dtype``."""
    return max(1, ctx.segment_bytes // max(np.dtype(dtype).itemsize, 1))


def pieces(n: int, seg: int) -> list[tuple[int, int]]:
    """Half-open ranges cutting ``n`` elements into pieces of at most ``seg``
    (none for n == 0; both ends of a message compute the same pieces)."""
    return [(a, min(a + seg, n)) for a in range(0, n, seg)]


def even_bounds(count: int, parts: int) -> list[int]:
    """Offsets cutting ``count`` elements into ``parts`` blocks that differ by at most one."""
    q, r = divmod(count, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def send_segments(ctx: CallContext, arr: np.ndarray, peer: int) -> list[Request]:
    """Start sending ``arr`` to ``peer`` as pipeline pieces."""
    if arr.nbytes <= ctx.segment_bytes:  # one piece, or none for an empty array
        return [ctx.isend(arr, peer)] if arr.size else []
    seg = segment_elems(ctx, arr.dtype)
    return [ctx.isend(arr[a:b], peer) for a, b in pieces(arr.size, seg)]


def recv_segments(ctx: CallContext, arr: np.ndarray, peer: int) -> list[Request]:
    """Start receiving ``arr`` from ``peer`` as pipeline pieces."""
    if arr.nbytes <= ctx.segment_bytes:
        return [ctx.irecv(arr, peer)] if arr.size else []
    seg = segment_elems(ctx, arr.dtype)
    return [ctx.irecv(arr[a:b], peer) for a, b in pieces(arr.size, seg)]


def recv_reduce(ctx: CallContext, peer: int, tmp: np.ndarray, out: np.ndarray,
                mine: np.ndarray, op: Op, sends: Sequence[Request] = ()) -> None:
    """Receive ``out.size`` elements from ``peer`` piece by piece and set
    ``out = mine (op) received`` as each piece lands (``tmp``: scratch of
    ``out``'s size).

    ``sends``, if given, are requests over the same pieces of a buffer that
    aliases ``out``; piece i is reduced only after send i completed.
    """
    if not sends and out.nbytes <= ctx.segment_bytes:  # one piece (or none)
        if out.size:
            ctx.wait(ctx.irecv_reduce(out, mine, peer, op, tmp))
        return
    seg = segment_elems(ctx, out.dtype)
    parts = pieces(out.size, seg)
    if sends and not all(s.test() for s in sends):
        reqs = [ctx.irecv(tmp[a:b], peer) for a, b in parts]
        for i, ((a, b), req) in enumerate(zip(parts, reqs)):
            ctx.wait(req)
            ctx.wait(sends[i])
            op.reduce_into(out[a:b], mine[a:b], tmp[a:b])
        return
    reqs = [ctx.irecv_reduce(out[a:b], mine[a:b], peer, op, tmp[a:b]) for a, b in parts]
    for req in reqs:  # in order: piece i is reduced while piece i + 1 arrives
        ctx.wait(req)


def exchange_reduce(ctx: CallContext, peer: int, send: np.ndarray, keep: np.ndarray,
                    op: Op, mine: np.ndarray | None = None) -> None:
    """Send ``send`` to ``peer`` while receiving its counterpart of ``keep``;
    set ``keep = mine (op) received`` (``mine`` defaults to ``keep``; ``send``
    may overlap ``keep``)."""
    tmp = ctx.scratch(keep.size, keep.dtype, TMP)
    sends = send_segments(ctx, send, peer)
    unsent = [s for s in sends if not s.test()]  # small sends are done at once
    aliased = bool(unsent) and np.may_share_memory(send, keep)
    recv_reduce(ctx, peer, tmp, keep, keep if mine is None else mine, op,
                sends if aliased else ())
    if unsent:
        ctx.waitall(unsent)


# ------------------------------------------------------------------ folding

def fold_in(ctx: CallContext, fold: Fold, src: np.ndarray, work: np.ndarray, op: Op) -> bool:
    """Fold the world onto the power-of-two group.

    A folded-out rank sends ``src`` to the rank above; the rank above sets
    ``work = src (op) received``; other ranks do nothing.

    Returns:
        True if ``work`` now holds this rank's contribution, False if it is
        still in ``src`` (pass ``src`` on to :func:`recursive_halving`).
    """
    if fold.folded_out:
        ctx.waitall(send_segments(ctx, src, fold.rank + 1))
        return False
    if fold.absorbs:
        tmp = ctx.scratch(src.size, src.dtype, TMP)
        recv_reduce(ctx, fold.rank - 1, tmp, work, src, op)
        return True
    return work is src


def recursive_halving(ctx: CallContext, fold: Fold, work: np.ndarray, bounds: Sequence[int],
                      op: Op, src: np.ndarray | None = None) -> tuple[int, int]:
    """Reduce-scatter over the group by recursive halving.

    ``work`` holds this rank's (folded) contribution, or ``src`` does (then
    the first step reads it from there and ``work`` needs no copy);
    ``bounds`` has ``pof2 + 1`` offsets. Afterwards block ``newrank`` of
    ``work`` holds the reduction over every rank. Returns that block's
    element range.
    """
    nr, lo, hi = fold.newrank, 0, fold.pof2
    mask = fold.pof2 >> 1
    if src is None or src is work:
        src = work
    elif mask == 0:
        compiled.copy(work, src)
    while mask:
        peer = fold.real(nr ^ mask)
        mid = lo + mask
        lower_half = nr & mask == 0  # the lower rank of the pair keeps the lower half
        (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if lower_half else ((mid, hi), (lo, mid))
        keep = slice(bounds[klo], bounds[khi])
        exchange_reduce(ctx, peer, src[bounds[slo]:bounds[shi]], work[keep], op, src[keep])
        src = work
        lo, hi = klo, khi
        mask >>= 1
    return bounds[nr], bounds[nr + 1]


def _group_range(nr: int, mask: int, bounds: Sequence[int]) -> slice:
    """Elements of the aligned group of ``mask`` blocks that holds block ``nr``."""
    first = nr & ~(mask - 1)
    return slice(bounds[first], bounds[first + mask])


def recursive_doubling_allgather(ctx: CallContext, fold: Fold, work: np.ndarray,
                                 bounds: Sequence[int]) -> None:
    """Allgather over the group by recursive doubling: each rank starts with
    block ``newrank`` of ``work`` and ends with every block."""
    nr, mask = fold.newrank, 1
    while mask < fold.pof2:
        partner = nr ^ mask
        ctx.sendrecv(work[_group_range(nr, mask, bounds)], fold.real(partner),
                     work[_group_range(partner, mask, bounds)], fold.real(partner))
        mask <<= 1


def binomial_gather(ctx: CallContext, fold: Fold, work: np.ndarray,
                    bounds: Sequence[int], root_nr: int) -> None:
    """Gather the blocks of ``work`` (block ``newrank`` on each group rank) to
    group rank ``root_nr`` along the binomial tree that mirrors the halving."""
    nr, mask = fold.newrank, 1
    rel = nr ^ root_nr
    while mask < fold.pof2:
        partner = nr ^ mask
        if rel & mask:
            ctx.send(work[_group_range(nr, mask, bounds)], fold.real(partner))
            return
        ctx.recv(work[_group_range(partner, mask, bounds)], fold.real(partner))
        mask <<= 1


# --------------------------------------------------------------------- ring

def ring_pipeline(ctx: CallContext, src: np.ndarray, dest_of: Callable[[int], np.ndarray],
                  bounds: Sequence[int], op: Op, allgather: bool) -> None:
    """Streaming ring reduce-scatter, optionally followed by a ring allgather.

    In reduce-scatter step t (0..p-2) rank r sends its partial of block
    r-t-1 to r+1 and receives block r-t-2 from r-1, reducing it with its own
    ``src`` block into ``dest_of(block)``; after p-1 steps ``dest_of(r)``
    holds the full reduction of block r. The allgather then passes the final
    blocks around the ring, received straight into ``dest_of(block)``. Each
    block travels in pieces, and a piece is forwarded as soon as it is
    reduced, so the steps overlap.

    Args:
        src: this rank's contribution, indexed by ``bounds``.
        dest_of: block -> array (of the block's size) for its reduced data.
        bounds: p + 1 block offsets.
        op: the reduction.
        allgather: also circulate the final blocks (allreduce).
    """
    p, rank = ctx.size, ctx.rank
    if p == 1:
        if not np.shares_memory(src, dest_of(0)):
            compiled.copy(dest_of(0), src)
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    seg = segment_elems(ctx, src.dtype)
    steps = (p - 1) * (2 if allgather else 1)

    def block_at(t: int) -> int:  # the block received in step t
        return (rank - t - 2) % p if t < p - 1 else (rank - (t - (p - 1)) - 1) % p

    def size(b: int) -> int:
        return bounds[b + 1] - bounds[b]

    units = [(t, j, a, b) for t in range(steps)
             for j, (a, b) in enumerate(pieces(size(block_at(t)), seg))]
    longest = max((b - a for _, _, a, b in units), default=0)
    window = max(1, ctx.transport.receives_ahead)  # receives in flight ahead of the one reduced
    tmp = ctx.scratch(window * longest, src.dtype, TMP)
    sent: dict[tuple[int, int], Request] = {}
    first = (rank - 1) % p
    for j, (a, b) in enumerate(pieces(size(first), seg)):
        sent[(0, j)] = ctx.isend(src[bounds[first] + a:bounds[first] + b], right)
    posted: list[Request] = []
    early = ctx.transport.released_on_delivery

    def post(i: int) -> None:
        t, j, a, b = units[i]
        if t < p - 1:
            blk = block_at(t)
            off = bounds[blk]
            posted.append(ctx.irecv_reduce(dest_of(blk)[a:b], src[off + a:off + b], left, op,
                                           tmp[(i % window) * longest:][:b - a]))
        else:  # allgather: straight into place, where our earlier send of it was read from
            req = sent.get((t - (p - 1), j))
            # What lands here was reduced from that very send, so a transport
            # that releases sends on delivery is done with the buffer by then.
            if req is not None and not early:
                ctx.wait(req)
            posted.append(ctx.irecv(dest_of(block_at(t))[a:b], left))

    for i in range(min(window, len(units))):
        post(i)
    for i, (t, j, a, b) in enumerate(units):
        ctx.wait(posted[i])
        out = dest_of(block_at(t))[a:b]
        if i + window < len(units):
            post(i + window)
        if t + 1 < steps:
            sent[(t + 1, j)] = ctx.isend(out, right)
    ctx.waitall(list(sent.values()))


# ----------------------------------------------------------------- binomial

def _tree(vrank: int, p: int) -> tuple[int | None, list[int]]:
    """(parent, children) of relative rank ``vrank`` in the binomial tree
    rooted at 0; children in increasing subtree size."""
    mask, children = 1, []
    while mask < p:
        if vrank & mask:
            return vrank - mask, children
        if vrank + mask < p:
            children.append(vrank + mask)
        mask <<= 1
    return None, children


def binomial_reduce(ctx: CallContext, buf: np.ndarray, root: int, op: Op,
                    in_place: bool) -> None:
    """Reduce ``buf`` to ``root`` along a binomial tree, segment by segment.

    Each inner rank reduces segment k of its children's data while segment
    k+1 is arriving, and sends it up at once, so the levels overlap. With
    ``in_place`` false only the root's ``buf`` changes; others use scratch.
    """
    p, rank = ctx.size, ctx.rank
    parent_v, children_v = _tree((rank - root) % p, p)
    parent = None if parent_v is None else (parent_v + root) % p
    children = [(c + root) % p for c in children_v]
    seg = segment_elems(ctx, buf.dtype)
    parts = pieces(buf.size, seg)
    if not children:
        if parent is not None:
            ctx.waitall([ctx.isend(buf[a:b], parent) for a, b in parts])
        return
    depth, width = 2, min(seg, buf.size)
    nch = len(children)
    tmp = ctx.scratch(depth * nch * width, buf.dtype, TMP)
    acc32 = ctx.scratch(width, np.float32, ACC32)
    accumulate_in_buf = in_place or parent is None
    rotate = None if accumulate_in_buf else ctx.scratch(depth * width, buf.dtype, ROTATE)
    recvs: list[list[Request]] = []
    sends: list[Request] = []

    def tmp_piece(k: int, ci: int, n: int) -> np.ndarray:
        return tmp[((k % depth) * nch + ci) * width:][:n]

    def post(k: int) -> None:
        a, b = parts[k]
        recvs.append([ctx.irecv(tmp_piece(k, ci, b - a), c) for ci, c in enumerate(children)])

    for k in range(min(depth, len(parts))):
        post(k)
    for k, (a, b) in enumerate(parts):
        ctx.waitall(recvs[k])
        if accumulate_in_buf:
            out = buf[a:b]
        else:
            if k >= depth:
                ctx.wait(sends[k - depth])
            out = rotate[(k % depth) * width:][:b - a]
        op.reduce_many(out, [buf[a:b]] + [tmp_piece(k, ci, b - a) for ci in range(nch)],
                       acc32[:b - a])
        if k + depth < len(parts):
            post(k + depth)
        if parent is not None:
            sends.append(ctx.isend(out, parent))
    ctx.waitall(sends)


def binomial_bcast(ctx: CallContext, buf: np.ndarray, root: int) -> None:
    """Broadcast ``buf`` from ``root`` along a binomial tree, segment by
    segment (a rank forwards segment k while segment k+1 arrives)."""
    p, rank = ctx.size, ctx.rank
    parent_v, children_v = _tree((rank - root) % p, p)
    children = [(c + root) % p for c in reversed(children_v)]
    recvs = [] if parent_v is None else recv_segments(ctx, buf, (parent_v + root) % p)
    seg = segment_elems(ctx, buf.dtype)
    sends: list[Request] = []
    for k, (a, b) in enumerate(pieces(buf.size, seg)):
        if recvs:
            ctx.wait(recvs[k])
        sends.extend(ctx.isend(buf[a:b], c) for c in children)
    ctx.waitall(sends)
