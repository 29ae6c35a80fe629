"""scatter through the shared window: the root copies every block into its
region, fence, each rank copies its own out; from
:data:`~.tuning.DIRECT_FROM` on, each reads its block straight from the
root's buffer (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

from typing import Sequence

import numpy as np

from ... import compiled
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .pieces import displs, one_piece, striped_cached
from .compiled_calls import (arr, on_window, pool_path, first_two, compile_call, compile_direct, direct_mode, peer,
                             prepared_from, run_prepared, slot)
from .state import budget, region, state_of, window_state

__all__ = ["scatter"]


def _prepare(transport, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int, counts: list[int]):
    """One compiled call when every block fits one piece through the window."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item = recvbuf.itemsize
    if p == 1 or not sum(counts):
        return None
    total = sum(counts) * item
    parts = one_piece(st, list(counts), max(1, budget(st) // (p * item)))
    through = None  # the window call's copies
    if parts is not None and me == root:
        own, n, _ = parts[me]  # its own block once the others' are posted, while they copy them out
        through = ([(arr(0, start * item), slot(st, me, off * item), m * item)
                    for r, (start, m, off) in enumerate(parts) if r != me and m],
                   [(arr(0, own * item), arr(1), n * item)] if n else [])
    elif parts is not None:
        start, n, off = parts[me]
        through = [], [(slot(st, root, off * item), arr(1), n * item)] if n else []
    mode = direct_mode(window, "scatter", total, through)
    if mode is not None:
        fall = on_window(mode, through)  # (where the root's copy in puts block me: one piece, whole blocks)
        start, n = displs(counts)[me], counts[me]
        if me == root:
            made = compile_direct(window, 2, [], [(arr(0, start * item), arr(1), n * item)] if n else [],
                                  [r for r in range(p) if r != me and counts[r]], [0],
                                  mode, through)
        else:
            alt = (slot(st, root, parts[me][2] * item),) if fall else ()
            made = compile_direct(window, 2, [], [(peer(root, 0, start * item), arr(1), n * item) + alt] if n else [],
                                  [], [], mode, through)
        if made is not None:
            return prepared_from(made, first_two)
    if through is None or pool_path(window, "scatter", total):
        return None  # the pool's direct path, or pieces (the algorithm's body)
    sources = [root] if me != root and parts[me][1] else []
    return prepared_from(compile_call(window, 2, *through, None, sources), first_two)


@register("scatter", "shared_window", needs=("window",), prepare=_prepare,
          description="the root copies every block into its window region; each rank copies its own out")
def scatter(ctx, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int, counts: Sequence[int]) -> None:
    p, me = ctx.size, ctx.rank
    counts = list(counts)
    key = ("scatter", recvbuf.dtype, tuple(counts), root)
    if p > 1 and run_prepared(ctx, _prepare, key, sendbuf, recvbuf, root, counts):
        return
    starts = displs(counts)
    if p == 1 or sum(counts) == 0:
        if me == root:
            compiled.copy(recvbuf, sendbuf[starts[me]:starts[me] + counts[me]])
        return
    window, st = state_of(ctx)
    dt, item = recvbuf.dtype, recvbuf.itemsize
    readers = direct(ctx, window, st, sendbuf if me == root else recvbuf, sum(counts) * item, "scatter")
    own = (recvbuf, sendbuf[starts[me]:starts[me] + counts[me]]) if me == root else None
    if readers is not None:  # (past its publishing fence: every rank agreed)
        if own is not None:  # its own block while the others read theirs
            compiled.copy(*own)
        else:
            readers.read(root, starts[me] * item, recvbuf)
        window.fence(ctx.deadline)  # the root keeps its buffer until everyone has its block
        return
    step = max(1, budget(st) // (p * item))
    tracer = ctx.tracer
    for parts, _ in striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        if me == root:
            t0 = _now() if tracer is not None else 0.0
            for r, (start, n, off) in enumerate(parts):
                if r != me and n:
                    compiled.copy(region(st, me, base + off * item, n, dt), sendbuf[start:start + n])
            if tracer is not None:  # a timeline's phase (tracing only)
                tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        if own is not None:  # its own block once every rank agreed (the first fence is the call's arrival)
            compiled.copy(*own)
            own = None
        start, n, off = parts[me]
        if me != root and n:
            lo = start - starts[me]
            t0 = _now() if tracer is not None else 0.0
            compiled.copy(recvbuf[lo:lo + n], region(st, root, base + off * item, n, dt))
            if tracer is not None:
                tracer.phase(COPYING, t0, _now())
