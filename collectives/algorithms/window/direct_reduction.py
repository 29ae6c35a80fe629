"""The direct compiled calls that reduce: allreduce's and reduce's.

Each rank reduces its block (1/p of the vector) straight from its own
array and every peer's, and writes the result into the peers' arrays that
want it (allreduce: every peer's; reduce: the root's), in one step (see
:func:`~.compiled_calls.compile_reduction`). A peer's block is reduced
where it lies: in its pool (nothing copied), across from huge pages, or
from the copy in the peer's region that a rank whose array lies in 4 KiB
pages outside its pool makes before its post (its peers' blocks one after
another, :func:`placed_blocks`); such a rank gets the reduced blocks in
the same places and copies them out once every peer is done. Where those
blocks do not fit a half (:func:`falls_back`), such an array is read
across. Ranks in place and out of place mix: every peer is read as its
array 1, which a call in place publishes as its one array too.
"""

from __future__ import annotations

import numpy as np

from ... import compiled
from ...ops import Op
from ...window_contract import COMPILED_CALLS, DIRECT_ACCESS
from .compiled_calls import arr, compile_reduction, peer, reduction, slot
from .direct import window_direct_from
from .pieces import blocks, displs
from .reduction import LOW
from .state import WindowState
from .tuning import DIRECT_REDUCTION_PIECE, DIRECT_REDUCTION_HUGE_FROM, compiled_direct

__all__ = ["takes_direct_call", "direct_call", "falls_back", "placed_blocks"]


def takes_direct_call(collective: str, window, st: WindowState, buf: np.ndarray, op: Op) -> bool:
    """Whether ``buf`` takes ``collective``'s direct call: the window has one,
    ``buf``'s size is in its span (:data:`~.tuning.COMPILED_DIRECT`), it
    has an element for every rank and a compiled kernel; and either the
    blocks a rank's peers reduce fit a half (:func:`falls_back`) or the
    pool's direct path has not begun (:data:`~.tuning.DIRECT_FROM`, which
    decides once every rank published whether every buffer can be
    reached); reduce's at any size (a rank that is not the root reduces
    its block a piece at a time into one piece of its region, and arrays
    are read across where the blocks it holds for its peers and that
    piece do not fit a half). The same on every rank."""
    p = window.size
    if collective == "reduce":  # a rank that is not the root reduces into one piece of its region
        fits = True
    else:
        fits = falls_back(st, buf, p) or buf.nbytes < window_direct_from(collective, window, p)
    return (fits and compiled_direct(collective, buf.nbytes, p, window.cores)
            and {COMPILED_CALLS, DIRECT_ACCESS} <= window.features and p <= buf.size and buf.dtype not in LOW
            and compiled.kernel_codes(buf.dtype, op.name, op.ufunc) is not None)


def falls_back(st: WindowState, buf: np.ndarray, p: int, reduce: bool = False) -> bool:
    """Whether the direct call takes an array in 4 KiB pages outside its
    rank's pool through the window: the blocks its peers reduce fit a half
    (``reduce``: with one piece of a reduction after them). Otherwise it
    reads such an array across (allreduce, from its span's start up to
    :data:`~.tuning.DIRECT_FROM`, where the window's pieces ran before: 4
    ranks on 2 cores, 3 MiB, 202-342 us against 825, Open MPI 367-641)."""
    others = buf.nbytes - buf.size // p * buf.itemsize
    piece = min(DIRECT_REDUCTION_PIECE, -(-buf.size // p) * buf.itemsize) if reduce else 0
    return others + piece <= st.half


def direct_call(window, st: WindowState, rank: int, buf: np.ndarray, op: Op, src: int = 0, root: int | None = None):
    """``(run, settle)`` of the direct call: allreduce's (``root`` None:
    each block reduced in rank order, as the window's calls reduce it,
    written into every peer), or reduce's (each block reduced its owner's
    values first, then the others' in rank order, as reduce's window calls
    do; written into the root's array only, a rank that is not the root
    reducing into its region after the blocks it holds for its peers).
    ``src``: the array the vector is read from (1: out of place). A rank
    that is not reduce's root reduces one piece at a time into one piece of
    its region (after the blocks it holds for its peers, where it holds
    them) and writes each from there."""
    item, p = buf.itemsize, window.size
    counts = blocks(buf.size, p)
    starts = [s * item for s in displs(counts)]
    mine, n = starts[rank], counts[rank] * item
    peers = [r for r in range(p) if r != rank]
    order = list(range(p)) if root is None else [rank] + peers
    srcs = [arr(src, mine) if r == rank else peer(r, 1, mine) for r in order]
    falls = falls_back(st, buf, p, reduce=root is not None)  # else arrays neither in huge pages nor in a pool
    one = root not in (None, rank)                           # are read across
    into = arr(0, mine) if not one else slot(st, rank, buf.nbytes - n if falls else 0)
    reduced = reduction(into, srcs, counts[rank], buf.dtype, op)
    if reduced is None:
        return None
    targets = peers if root is None else [root] if root != rank else []  # the peers this rank writes into
    gets = root in (None, rank)  # whether this rank's array gets the peers' reduced blocks
    if not falls:
        writes = [(into, peer(r, 0, mine), n) for r in targets]
        return compile_reduction(window, src + 1, writes, reduced, peers, sorted({0, src}), None, [None] * p, [],
                                 DIRECT_REDUCTION_PIECE, one=one)
    placed = [placed_blocks(counts, q, item) for q in range(p)]  # placed[q][b]: block b in q's region
    writes = [(into, peer(r, 0, mine), n, slot(st, r, placed[r][rank])) for r in targets]
    copies_in = [(arr(src, starts[b]), slot(st, rank, placed[rank][b]), counts[b] * item) for b in peers]
    ralts = [None if r == rank else slot(st, r, placed[r][rank]) for r in order]
    copies_out = [(slot(st, rank, placed[rank][b]), arr(0, starts[b]), counts[b] * item) for b in peers if gets]
    return compile_reduction(window, src + 1, writes, reduced, peers, sorted({0, src}), copies_in, ralts, copies_out,
                             DIRECT_REDUCTION_PIECE, DIRECT_REDUCTION_HUGE_FROM, one=one)


def placed_blocks(counts: list[int], owner: int, item: int) -> dict[int, int]:
    """Byte offset in ``owner``'s region of each block but its own, one after
    another in rank order (where a rank whose array goes through the window
    puts the blocks its peers reduce)."""
    at, offsets = 0, {}
    for b, c in enumerate(counts):
        if b != owner:
            offsets[b] = at
            at += c * item
    return offsets
