"""reduce_scatter through the shared window: copy in the blocks the others
reduce, fence, each rank reduces its block into recvbuf straight from every
region; from :data:`~.tuning.DIRECT_FROM` on, straight from every rank's
sendbuf (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...ops import Op
from ...registry import register
from ...tracing import COPYING
from .direct import SCRATCH_PEER_FIRST, Readers, direct, window_direct_from
from .pieces import displs, one_piece, piece_elems, striped_cached
from .compiled_calls import arr, first_two, compile_call, prepared_from, reduction, run_prepared, slot
from .reduction import LOW, reduce
from .state import state_of, window_state

__all__ = ["reduce_scatter"]


def _prepare(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list[int], op: Op):
    """One compiled call for the one-piece case through the window: copy in the
    blocks the others reduce, fence, reduce this rank's block into recvbuf."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item, dtype = sendbuf.itemsize, sendbuf.dtype
    if p == 1 or sendbuf.nbytes >= window_direct_from("reduce_scatter", window, p) or dtype in LOW \
            or not sum(counts):
        return None
    parts = one_piece(st, counts, piece_elems(st.half, p, item))
    if parts is None:
        return None
    peers = [r for r in range(p) if r != me]
    before = [(arr(0, start * item), slot(st, me, off * item), n * item)
              for r, (start, n, off) in enumerate(parts) if r != me and n]
    start, n, off = parts[me]
    reduced = reduction(arr(1), [arr(0, start * item)] + [slot(st, r, off * item) for r in peers],
                        n, dtype, op)
    return prepared_from(compile_call(window, 2, before, [], reduced, peers) if reduced else None, first_two)


@register("reduce_scatter", "shared_window", needs=("window",), prepare=_prepare,
          description="each rank reduces its block straight from every rank's window region")
def reduce_scatter(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list[int], op: Op) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1:
        compiled.copy(recvbuf, sendbuf[:counts[0]])
        return
    if sum(counts) == 0:
        return
    key = ("reduce_scatter", sendbuf.dtype, sendbuf.size, tuple(counts), op.name)
    if run_prepared(ctx, _prepare, key, sendbuf, recvbuf, counts, op):
        return
    window, st = state_of(ctx)
    readers = direct(ctx, window, st, sendbuf, sendbuf.nbytes, "reduce_scatter")
    if readers is not None:
        _direct(ctx, window, readers, sendbuf, recvbuf, counts, op)
        return
    item = sendbuf.itemsize
    step = piece_elems(st.half, p, item)
    starts = displs(counts)
    peers = [r for r in range(p) if r != me]
    dt = sendbuf.dtype
    tracer = ctx.tracer
    for parts, used in striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        for r in peers:
            start, n, off = parts[r]
            if n:
                compiled.copy(st.views(base + off * item, n * item, dt)[me], sendbuf[start:start + n])
        if tracer is not None:  # a timeline's phase (tracing only)
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        start, n, off = parts[me]
        if n:
            srcs = st.views(base + off * item, n * item, sendbuf.dtype)
            lo = start - starts[me]
            reduce(ctx, op, recvbuf[lo:lo + n], [sendbuf[start:start + n]] + [srcs[r] for r in peers])


def _direct(ctx, window, readers: Readers, sendbuf: np.ndarray, recvbuf: np.ndarray,
            counts: list[int], op: Op) -> None:
    """Reduce this rank's block straight from every rank's sendbuf, piece by piece."""
    p, me, item = ctx.size, ctx.rank, sendbuf.itemsize
    lo = displs(counts)[me]
    peers = [r for r in range(p) if r != me]
    step = max(1, (ctx.segment_bytes if p <= 4 else ctx.segment_bytes // 4) // item)
    scratch = [ctx.scratch(min(step, counts[me]), sendbuf.dtype, slot=SCRATCH_PEER_FIRST + i)
               for i in range(p - 1)]
    for a in range(0, counts[me], step):
        b = min(a + step, counts[me])
        parts = [readers.fetch(r, (lo + a) * item, s[:b - a]) for r, s in zip(peers, scratch)]
        reduce(ctx, op, recvbuf[a:b], [sendbuf[lo + a:lo + b]] + parts)
    window.fence(ctx.deadline)  # every rank has read the others' sendbuf
