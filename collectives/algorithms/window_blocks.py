"""More shared-window algorithms: gather, scatter, alltoall, reduce and barrier.

Like :mod:`.window` (whose state, turns and direct readers they share): data
goes through the window regions in pieces that fit one half, copy in, fence,
copy out, the halves used in turns so that a half is rewritten only after a
fence every reader has passed. From each collective's
:data:`~.window.DIRECT_FROM` on, where every rank's buffer can be read
directly (the shared pool, or cross-memory attach), the ranks publish their
buffers (one fence) and copy straight from them, with a closing fence so
that no rank changes its buffer while another still reads.

* ``barrier``: one fence.
* ``gather``: each rank copies its block into its region; the root copies
  every block out (or reads them straight from the senders' buffers).
* ``scatter``: the root copies every block into its region; each rank copies
  its own out (or reads it straight from the root's buffer).
* ``alltoall``: each rank copies its p blocks into its region; each rank
  copies block ``rank`` of every region out (or reads it from every buffer).
* ``reduce``: small vectors as allreduce's single-fence path, the root alone
  reducing; larger ones in pieces: each rank reduces 1/p of the piece from
  every region, then the root copies the reduced blocks out. Other ranks'
  buffers stay unchanged.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import native
from ..ops import Op
from ..registry import register
from .window import (_LOW, PIECE_BYTES, _arr, _blocks, _direct, _direct_from, _displs, _first,
                     _first_two, _one_piece,
                     _plan, _planned, _reduce, _reduction, _run_planned, _single_fence, _slot, _state_of,
                     _striped_cached, _window_state)

__all__ = ["barrier", "gather", "scatter", "alltoall", "reduce"]


def _budget(st) -> int:
    """Bytes one rank may put in a half at a time."""
    return min(st.half, PIECE_BYTES)


def _region(st, rank: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``offset`` of ``rank``'s region."""
    return st.regions[rank][offset:offset + count * dtype.itemsize].view(dtype)


def _no_arrays(*args) -> tuple:
    return ()


def _prepare_barrier(transport):
    """One native call: post, wait for every rank's post."""
    window, _ = _window_state(transport.window, transport.size)
    if transport.size == 1:
        return None
    return _planned(_plan(window, 0, [], [], None, []), _no_arrays)


@register("barrier", "shared_window", needs=("window",), prepare=_prepare_barrier,
          description="every rank posts to the shared window and waits for every post")
def barrier(ctx) -> None:
    if ctx.size == 1:
        return
    if _run_planned(ctx, _prepare_barrier, ("barrier",)):
        return
    window = ctx.transport.window
    window.step(ctx.deadline)
    window.fence(ctx.deadline)  # the call's arrival


def _prepare_gather(transport, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int, counts: list[int]):
    """One native call when every block fits one piece through the window."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    item = sendbuf.itemsize
    total = sum(counts) * item
    if p == 1 or not total or total >= _direct_from("gather", window, p) or max(counts) * item > _budget(st):
        return None
    displs = _displs(list(counts))
    if me == root:
        before = [(_arr(0), _arr(1, displs[me] * item), counts[me] * item)] if counts[me] else []
        sources = [r for r in range(p) if r != me and counts[r]]
        after = [(_slot(st, r), _arr(1, displs[r] * item), counts[r] * item) for r in sources]
    else:
        before, after, sources = ([(_arr(0), _slot(st, me), counts[me] * item)] if counts[me] else []), [], []
    return _planned(_plan(window, 2, before, after, None, sources), _first_two)


@register("gather", "shared_window", needs=("window",), prepare=_prepare_gather,
          description="each rank copies its block into its window region; the root copies all out")
def gather(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int, counts: Sequence[int]) -> None:
    p, me = ctx.size, ctx.rank
    key = ("gather", sendbuf.dtype, tuple(counts), root)
    if p > 1 and _run_planned(ctx, _prepare_gather, key, sendbuf, recvbuf, root, counts):
        return
    displs = _displs(list(counts))
    if me == root:
        native.copy(recvbuf[displs[me]:displs[me] + counts[me]], sendbuf)
    if p == 1 or sum(counts) == 0:
        return
    window, st = _state_of(ctx)
    dt, item = sendbuf.dtype, sendbuf.itemsize
    readers = _direct(ctx, window, st, sendbuf, sum(counts) * item, "gather")
    if readers is not None:
        if me == root:
            for r in range(p):
                if r != me:
                    readers.read(r, 0, recvbuf[displs[r]:displs[r] + counts[r]])
        window.fence(ctx.deadline)  # senders keep their buffers until the root has read them
        return
    step = max(1, _budget(st) // item)
    for a in range(0, max(counts), step):
        base = st.next_half(ctx.deadline)
        n = min(step, counts[me] - a)
        if me != root and n > 0:
            native.copy(_region(st, me, base, n, dt), sendbuf[a:a + n])
        window.fence(ctx.deadline)
        if me == root:
            for r in range(p):
                m = min(step, counts[r] - a)
                if r != me and m > 0:
                    native.copy(recvbuf[displs[r] + a:displs[r] + a + m], _region(st, r, base, m, dt))


def _prepare_scatter(transport, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int, counts: list[int]):
    """One native call when every block fits one piece through the window."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    item = recvbuf.itemsize
    if p == 1 or not sum(counts) or sum(counts) * item >= _direct_from("scatter", window, p):
        return None
    parts = _one_piece(st, list(counts), max(1, _budget(st) // (p * item)))
    if parts is None:
        return None
    if me == root:
        before = [(_arr(0, start * item), _slot(st, me, off * item), n * item)
                  for r, (start, n, off) in enumerate(parts) if r != me and n]
        start, n, _ = parts[me]
        before += [(_arr(0, start * item), _arr(1), n * item)] if n else []
        after, sources = [], []
    else:
        start, n, off = parts[me]
        after = [(_slot(st, root, off * item), _arr(1), n * item)] if n else []
        before, sources = [], ([root] if n else [])
    return _planned(_plan(window, 2, before, after, None, sources), _first_two)


@register("scatter", "shared_window", needs=("window",), prepare=_prepare_scatter,
          description="the root copies every block into its window region; each rank copies its own out")
def scatter(ctx, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int, counts: Sequence[int]) -> None:
    p, me = ctx.size, ctx.rank
    counts = list(counts)
    key = ("scatter", recvbuf.dtype, tuple(counts), root)
    if p > 1 and _run_planned(ctx, _prepare_scatter, key, sendbuf, recvbuf, root, counts):
        return
    displs = _displs(counts)
    if me == root:
        native.copy(recvbuf, sendbuf[displs[me]:displs[me] + counts[me]])
    if p == 1 or sum(counts) == 0:
        return
    window, st = _state_of(ctx)
    dt, item = recvbuf.dtype, recvbuf.itemsize
    readers = _direct(ctx, window, st, sendbuf if me == root else recvbuf, sum(counts) * item, "scatter")
    if readers is not None:
        if me != root:
            readers.read(root, displs[me] * item, recvbuf)
        window.fence(ctx.deadline)  # the root keeps its buffer until everyone has its block
        return
    step = max(1, _budget(st) // (p * item))
    for parts, _ in _striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        if me == root:
            for r, (start, n, off) in enumerate(parts):
                if r != me and n:
                    native.copy(_region(st, me, base + off * item, n, dt), sendbuf[start:start + n])
        window.fence(ctx.deadline)
        start, n, off = parts[me]
        if me != root and n:
            lo = start - displs[me]
            native.copy(recvbuf[lo:lo + n], _region(st, root, base + off * item, n, dt))


def _prepare_alltoall(transport, sendbuf: np.ndarray, recvbuf: np.ndarray):
    """One native call when the blocks fit one piece through the window."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    item = sendbuf.itemsize
    b = sendbuf.size // p * item  # bytes per block
    if p == 1 or not b or sendbuf.nbytes >= _direct_from("alltoall", window, p) or b > _budget(st) // p:
        return None
    before = [(_arr(0, d * b), _slot(st, me, d * b), b) for d in range(p) if d != me]
    before.append((_arr(0, me * b), _arr(1, me * b), b))
    after = [(_slot(st, r, me * b), _arr(1, r * b), b) for r in range(p) if r != me]
    return _planned(_plan(window, 2, before, after, None, [r for r in range(p) if r != me]), _first_two)


@register("alltoall", "shared_window", needs=("window",), prepare=_prepare_alltoall,
          description="each rank copies its blocks into its window region; each copies its own from every region")
def alltoall(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    p, me = ctx.size, ctx.rank
    if p > 1 and _run_planned(ctx, _prepare_alltoall, ("alltoall", sendbuf.dtype, sendbuf.size), sendbuf, recvbuf):
        return
    b = sendbuf.size // p
    native.copy(recvbuf[me * b:(me + 1) * b], sendbuf[me * b:(me + 1) * b])
    if p == 1 or b == 0:
        return
    window, st = _state_of(ctx)
    dt, item = sendbuf.dtype, sendbuf.itemsize
    readers = _direct(ctx, window, st, sendbuf, sendbuf.nbytes, "alltoall")
    if readers is not None:
        for r in range(p):
            if r != me:
                readers.read(r, me * b * item, recvbuf[r * b:(r + 1) * b])
        window.fence(ctx.deadline)  # nobody touches its buffer while others still read it
        return
    step = max(1, _budget(st) // (p * item))
    for a in range(0, b, step):
        m = min(step, b - a)
        base = st.next_half(ctx.deadline)
        for d in range(p):
            if d != me:
                native.copy(_region(st, me, base + d * m * item, m, dt), sendbuf[d * b + a:d * b + a + m])
        window.fence(ctx.deadline)
        for r in range(p):
            if r != me:
                native.copy(recvbuf[r * b + a:r * b + a + m], _region(st, r, base + me * m * item, m, dt))


def _prepare_reduce(transport, buf: np.ndarray, root: int, op: Op):
    """One native call for the one-fence case: copy in, fence, the root reduces."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    if p == 1 or buf.size == 0 or buf.dtype in _LOW or not _single_fence(buf.nbytes, p, st):
        return None
    if _reduction(_arr(0), [], 0, buf.dtype, op) is None:  # every rank declines alike, not the root alone
        return None
    if me == root:
        peers = [r for r in range(p) if r != root]
        reduction = _reduction(_arr(0), [_arr(0)] + [_slot(st, r) for r in peers], buf.size, buf.dtype, op)
        return _planned(_plan(window, 1, [], [], reduction, peers), _first)
    return _planned(_plan(window, 1, [(_arr(0), _slot(st, me), buf.nbytes)], [], None, []), _first)


@register("reduce", "shared_window", needs=("window",), prepare=_prepare_reduce,
          description="small: one fence, the root reduces every region; large: 1/p per rank, the root copies out")
def reduce(ctx, buf: np.ndarray, root: int, op: Op) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1 or buf.size == 0:
        return
    if _run_planned(ctx, _prepare_reduce, ("reduce", buf.dtype, buf.size, root, op.name), buf, root, op):
        return
    window, st = _state_of(ctx)
    dt, item = buf.dtype, buf.itemsize
    if _single_fence(buf.nbytes, p, st):
        base = st.next_half(ctx.deadline)
        if me != root:
            native.copy(st.views(base, buf.nbytes, dt)[me], buf)
        window.fence(ctx.deadline)
        if me == root:
            views = st.views(base, buf.nbytes, dt)
            _reduce(ctx, op, buf, [buf] + [views[r] for r in range(p) if r != root])
        return
    step = max(1, _budget(st) // (p * item))
    peers = [r for r in range(p) if r != me]
    for parts, _ in _striped_cached(st, _blocks(buf.size, p), step):
        base = st.next_half(ctx.deadline)
        for r in peers:  # the pieces of the blocks the others reduce
            start, n, off = parts[r]
            if n:
                native.copy(_region(st, me, base + off * item, n, dt), buf[start:start + n])
        window.fence(ctx.deadline)
        start, n, off = parts[me]
        if n:
            srcs = [_region(st, r, base + off * item, n, dt) for r in range(p)]
            _reduce(ctx, op, srcs[me], [buf[start:start + n]] + [srcs[r] for r in peers])
        window.fence(ctx.deadline)
        if me == root:
            for r, (start, n, off) in enumerate(parts):
                if n:
                    native.copy(buf[start:start + n], _region(st, r, base + off * item, n, dt))
