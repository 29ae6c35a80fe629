"""allgather through the shared window: each rank copies its block into its
region, fence, each copies the others' out; from
:data:`~.tuning.DIRECT_FROM` on, each reads the others' blocks straight
from their buffers (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...prepared import CopyIn
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .pieces import displs, one_piece, striped_cached
from .compiled_calls import (arr, on_window, pool_path, first, first_two, compile_call, compile_direct, direct_mode,
                             peer, prepared_from, run_prepared, slot, with_view)
from .state import budget, state_of, window_state

__all__ = ["allgather"]


def _prepare(transport, buf: np.ndarray, counts: list[int], copy_in: CopyIn | None = None):
    """One compiled call for the one-piece case through the window: copy this
    rank's block in, fence, copy the others' out; a direct call reads each
    peer's block where it published it (its own block: its send buffer out
    of place, else the block in its receive buffer, so ranks in place and
    out of place read each other alike). With ``copy_in`` (out of place),
    the call on ``(buf, sendbuf)``, which copies the block into ``buf``
    once every rank agreed (after the post)."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item = buf.itemsize
    if p == 1 or not sum(counts):
        return None
    starts = displs(counts)
    own, n_own = starts[me] * item, counts[me] * item
    mine = [(arr(1), arr(0, own), n_own)] if copy_in is not None and n_own else []  # once every rank agreed
    parts = one_piece(st, counts, max(1, budget(st) // (p * item)))
    at = [parts[r][2] for r in range(p)] if parts is not None else [0] * p  # each block's place in its region
    if parts is None and max(counts) * item > st.half:
        at = None  # past a half: no copies through the window (see :func:`_through`)
    fallback = _through(st, counts, starts, me, item, at, arr(1), mine)  # a direct call's, on (buf, block)
    mode = direct_mode(window, "allgather", buf.nbytes, fallback)
    if mode is not None:
        fall = on_window(mode, fallback)  # (where each peer's copy in puts its block)
        after = [(peer(r, 1), arr(0, starts[r] * item), counts[r] * item)
                 + ((slot(st, r, at[r] * item),) if fall else ()) for r in range(p) if r != me and counts[r]] + mine
        readers = [r for r in range(p) if r != me and counts[me]]
        made = compile_direct(window, 2, [], after, readers, [1], mode, fallback)
        if made is not None:
            if copy_in is not None:
                return prepared_from(made, first_two)
            return prepared_from(with_view(made, starts[me], starts[me] + counts[me], item), first)
    if parts is None or pool_path(window, "allgather", buf.nbytes):
        return None  # the pool's direct path, or pieces (the algorithm's body)
    through = _through(st, counts, starts, me, item, at, arr(1) if copy_in is not None else arr(0, own), mine)
    sources = [r for r, (_, n, _) in enumerate(parts) if r != me and n]
    return prepared_from(compile_call(window, 1 if copy_in is None else 2, *through, None, sources),
                         first if copy_in is None else first_two)


def _prepare_out_of_place(transport, buf: np.ndarray, sendbuf: np.ndarray, counts: list[int]):
    """:func:`_prepare` of an out-of-place call: its arrays ``(buf, sendbuf)``."""
    return _prepare(transport, buf, counts, CopyIn(displs(counts)[transport.rank]))


def _through(st, counts: list[int], starts: list[int], me: int, item: int, at: list[int] | None,
             block: tuple, mine: list) -> tuple | None:
    """The copies through the window, ``(before, after)`` as a window call's:
    this rank's block (from ``block``, a place in the call's arrays) into its
    region at ``at[me]`` (in elements), and every peer's out of its region
    at ``at[r]`` after ``mine`` (an out-of-place call's own copy); None
    without ``at``. Past one piece, where no block is larger than a half,
    each block lies at the start of its region: a direct call's fallback
    (2 ranks, huge pages, 4 MiB: 42-48 us, where the pool's direct path took
    70-72; MPICH 44-47)."""
    if at is None:
        return None
    before = [(block, slot(st, me, at[me] * item), counts[me] * item)] if counts[me] else []
    return before, mine + [(slot(st, r, at[r] * item), arr(0, starts[r] * item), counts[r] * item)
                           for r in range(len(counts)) if r != me and counts[r]]


@register("allgather", "shared_window", needs=("window",), prepare=_prepare, copies_in=True,
          description="each rank copies its block into the window once; everyone copies all out")
def allgather(ctx, buf: np.ndarray, counts: list[int], source: np.ndarray | None = None) -> None:
    """``source``: out of place, this rank's block (copied into ``buf`` once
    every rank agreed on the call)."""
    p, me = ctx.size, ctx.rank
    starts = displs(counts)
    if p == 1 or sum(counts) == 0:
        if source is not None and source.size:
            compiled.copy(buf[starts[me]:starts[me] + counts[me]], source)
        return
    key = ("allgather", buf.dtype, buf.size, tuple(counts))
    if source is None and run_prepared(ctx, _prepare, key, buf, counts):
        return
    if source is not None and run_prepared(ctx, _prepare_out_of_place, key + (1,), buf, source, counts):
        return
    window, st = state_of(ctx)
    item = buf.itemsize
    copy_in = None if source is None else (buf[starts[me]:starts[me] + counts[me]], source)
    readers = direct(ctx, window, st, buf, buf.nbytes, "allgather", copy_in)
    if readers is not None:
        for r in range(p):
            if r != me:
                readers.read(r, starts[r] * item, buf[starts[r]:starts[r] + counts[r]])
        window.fence(ctx.deadline)  # nobody touches its buffer while others still read it
        return
    step = max(1, budget(st) // (p * item))
    dt = buf.dtype
    tracer = ctx.tracer
    for parts, used in striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        start, n, off = parts[me]
        t0 = _now() if tracer is not None else 0.0
        piece = buf[start:start + n] if source is None else source[start - starts[me]:start - starts[me] + n]
        if n:
            compiled.copy(st.views(base + off * item, n * item, dt)[me], piece)
        if tracer is not None:  # a timeline's phase (tracing only)
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        if n and source is not None:  # once every rank agreed (the first fence is the call's arrival)
            compiled.copy(buf[start:start + n], piece)
        for r, (start, n, off) in enumerate(parts):
            if n and r != me:
                compiled.copy(buf[start:start + n], st.views(base + off * item, n * item, dt)[r])
        if tracer is not None:
            tracer.phase(COPYING, t0, _now())
