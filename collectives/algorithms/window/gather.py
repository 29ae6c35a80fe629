"""gather through the shared window: each rank copies its block into its
region, fence, the root copies every block out; from
:data:`~.tuning.DIRECT_FROM` on, every sender writes its block straight
into the root's buffer, all at once (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

from typing import Sequence

import numpy as np

from ... import compiled
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .pieces import displs
from .compiled_calls import (POOLED, arr, on_window, pool_path, first_two, compile_call, compile_direct, direct_mode, peer,
                             prepared_from, run_prepared, slot)
from .state import budget, region, state_of, window_state

__all__ = ["gather"]


def _prepare(transport, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int, counts: list[int]):
    """One compiled call when every block fits one piece through the window,
    or a direct one (from :data:`~.tuning.DIRECT_FROM` on, every sender
    writing its block into the root's buffer)."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item = sendbuf.itemsize
    total = sum(counts) * item
    if p == 1 or not total:
        return None
    starts = displs(list(counts))
    through = None  # the window call's copies
    sources = [r for r in range(p) if r != me and counts[r]] if me == root else []
    if max(counts) * item <= budget(st):
        if me == root:  # its own block copied once every signature agreed (after the post)
            through = ([], ([(arr(0), arr(1, starts[me] * item), counts[me] * item)] if counts[me] else [])
                       + [(slot(st, r), arr(1, starts[r] * item), counts[r] * item) for r in sources])
        else:
            through = [(arr(0), slot(st, me), counts[me] * item)] if counts[me] else [], []
    mode = direct_mode(window, "gather", total, through)
    if mode == POOLED:  # as the pool's direct path: every sender writes its block into the root's buffer at once
        own = [(arr(0), arr(1, starts[me] * item), counts[me] * item)] if counts[me] else []
        made = (compile_direct(window, 2, [], own, sources, [1], mode) if me == root else
                compile_direct(window, 2, [], [(arr(0), peer(root, 1, starts[me] * item), counts[me] * item)]
                               if counts[me] else [], [], [], mode))
        return prepared_from(made, first_two)
    if mode is not None:
        fall = on_window(mode, through)  # (each peer's copy in puts its block at its region's start)
        if me == root:
            after = [(arr(0), arr(1, starts[me] * item), counts[me] * item)] if counts[me] else []
            after += [(peer(r, 0), arr(1, starts[r] * item), counts[r] * item) + ((slot(st, r),) if fall else ())
                      for r in sources]
            made = compile_direct(window, 2, [], after, [], [], mode, through)
        else:
            made = compile_direct(window, 2, [], [], [root] if counts[me] else [], [0],
                                  mode, through)
        if made is not None:
            return prepared_from(made, first_two)
    if through is None or pool_path(window, "gather", total):
        return None  # the pool's direct path (the algorithm's body)
    return prepared_from(compile_call(window, 2, *through, None, sources), first_two)


@register("gather", "shared_window", needs=("window",), prepare=_prepare,
          description="each rank copies its block into its window region; the root copies all out")
def gather(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int, counts: Sequence[int]) -> None:
    p, me = ctx.size, ctx.rank
    key = ("gather", sendbuf.dtype, tuple(counts), root)
    if p > 1 and run_prepared(ctx, _prepare, key, sendbuf, recvbuf, root, counts):
        return
    starts = displs(list(counts))
    if p == 1 or sum(counts) == 0:
        if me == root:
            compiled.copy(recvbuf[starts[me]:starts[me] + counts[me]], sendbuf)
        return
    window, st = state_of(ctx)
    dt, item = sendbuf.dtype, sendbuf.itemsize
    # the root publishes where the blocks go; every sender writes its own, all at once
    writers = direct(ctx, window, st, recvbuf if me == root else sendbuf, sum(counts) * item, "gather")
    if writers is not None:
        if me == root:  # its own block while the others write theirs (every signature agreed)
            compiled.copy(recvbuf[starts[me]:starts[me] + counts[me]], sendbuf)
        if me != root and counts[me]:
            writers.write(root, starts[me] * item, sendbuf)
        window.fence(ctx.deadline)  # every block is in the root's buffer before anyone returns
        return
    step = max(1, budget(st) // item)
    tracer = ctx.tracer
    for a in range(0, max(counts), step):
        base = st.next_half(ctx.deadline)
        n = min(step, counts[me] - a)
        if me != root and n > 0:
            t0 = _now() if tracer is not None else 0.0
            compiled.copy(region(st, me, base, n, dt), sendbuf[a:a + n])
            if tracer is not None:  # a timeline's phase (tracing only)
                tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        if me == root:
            t0 = _now() if tracer is not None else 0.0
            if a == 0:  # its own block, once every signature agreed (the first fence)
                compiled.copy(recvbuf[starts[me]:starts[me] + counts[me]], sendbuf)
            for r in range(p):
                m = min(step, counts[r] - a)
                if r != me and m > 0:
                    compiled.copy(recvbuf[starts[r] + a:starts[r] + a + m], region(st, r, base, m, dt))
            if tracer is not None:
                tracer.phase(COPYING, t0, _now())
