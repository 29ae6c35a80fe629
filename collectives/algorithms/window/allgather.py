"""allgather through the shared window: each rank copies its block into its
region, fence, each copies the others' out; from
:data:`~.tuning.DIRECT_FROM` on, each reads the others' blocks straight
from their buffers (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .pieces import displs, one_piece, striped_cached
from .compiled_calls import (arr, on_window, pool_path, first, compile_call, compile_direct, direct_mode, peer,
                             prepared_from, run_prepared, slot)
from .state import budget, state_of, window_state

__all__ = ["allgather"]


def _prepare(transport, buf: np.ndarray, counts: list[int]):
    """One compiled call for the one-piece case through the window: copy this
    rank's block in, fence, copy the others' out."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item = buf.itemsize
    if p == 1 or not sum(counts):
        return None
    parts = one_piece(st, counts, max(1, budget(st) // (p * item)))
    through = None  # the window call's copies
    if parts is not None:
        start, n, off = parts[me]
        through = ([(arr(0, start * item), slot(st, me, off * item), n * item)] if n else [],
                   [(slot(st, r, off * item), arr(0, start * item), n * item)
                    for r, (start, n, off) in enumerate(parts) if r != me and n])
    starts = displs(counts)
    # a direct call's fallback: the window call's copies, or past them each block at the start of its region
    at = [parts[r][2] for r in range(p)] if parts is not None else [0] * p
    fallback = through if parts is not None else _blocks_at_the_start(st, counts, starts, me, item)
    mode = direct_mode(window, "allgather", buf.nbytes, fallback)
    if mode is not None:
        fall = on_window(mode, fallback)  # (where each peer's copy in puts its block)
        after = [(peer(r, 0, starts[r] * item), arr(0, starts[r] * item), counts[r] * item)
                 + ((slot(st, r, at[r] * item),) if fall else ()) for r in range(p) if r != me and counts[r]]
        readers = [r for r in range(p) if r != me and counts[me]]
        made = compile_direct(window, 1, [], after, readers, [0], mode, fallback)
        if made is not None:
            return prepared_from(made, first)
    if through is None or pool_path(window, "allgather", buf.nbytes):
        return None  # the pool's direct path, or pieces (the algorithm's body)
    sources = [r for r, (_, n, _) in enumerate(parts) if r != me and n]
    return prepared_from(compile_call(window, 1, *through, None, sources), first)


def _blocks_at_the_start(st, counts: list[int], starts: list[int], me: int, item: int) -> tuple | None:
    """A direct call's copies through the window where the window call's do
    not fit one piece: each rank's block at the start of its region, read
    from there (``(before, after)`` as a window call's), or None where a
    block is larger than a half (past that: :data:`~.tuning.POOLED_ACROSS`).
    2 ranks, huge pages, 4 MiB: 42-48 us, where the pool's direct path took
    70-72 (MPICH 44-47)."""
    if max(counts) * item > st.half:
        return None
    return ([(arr(0, starts[me] * item), slot(st, me), counts[me] * item)] if counts[me] else [],
            [(slot(st, r), arr(0, starts[r] * item), counts[r] * item) for r in range(len(counts))
             if r != me and counts[r]])


@register("allgather", "shared_window", needs=("window",), prepare=_prepare,
          description="each rank copies its block into the window once; everyone copies all out")
def allgather(ctx, buf: np.ndarray, counts: list[int]) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1 or sum(counts) == 0:
        return
    if run_prepared(ctx, _prepare, ("allgather", buf.dtype, buf.size, tuple(counts)), buf, counts):
        return
    window, st = state_of(ctx)
    item = buf.itemsize
    readers = direct(ctx, window, st, buf, buf.nbytes, "allgather")
    if readers is not None:
        starts = displs(counts)
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
        if n:
            compiled.copy(st.views(base + off * item, n * item, dt)[me], buf[start:start + n])
        if tracer is not None:  # a timeline's phase (tracing only)
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        for r, (start, n, off) in enumerate(parts):
            if n and r != me:
                compiled.copy(buf[start:start + n], st.views(base + off * item, n * item, dt)[r])
        if tracer is not None:
            tracer.phase(COPYING, t0, _now())
