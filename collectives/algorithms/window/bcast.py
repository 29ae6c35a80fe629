"""bcast through the shared window: the root copies into its region, fence,
the others copy out; from :data:`~.tuning.DIRECT_FROM` on, the others read
the root's buffer straight (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .compiled_calls import (arr, on_window, pool_path, first, compile_call, compile_direct, direct_mode, peer,
                             prepared_from, run_prepared, slot)
from .state import budget, state_of, window_state

__all__ = ["bcast"]

#: Pieces of a bcast through the window are whole multiples of this many bytes.
_ALIGN = 64


def _prepare(transport, buf: np.ndarray, root: int):
    """One compiled call for the one-piece case through the window: the root
    copies in, fence, the others copy out."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    n = buf.nbytes
    if p == 1 or n == 0:
        return None
    through = None  # the window call's copies
    if n <= budget(st):
        through = ([(arr(0), slot(st, root), n)], []) if me == root else ([], [(slot(st, root), arr(0), n)])
    mode = direct_mode(window, "bcast", n, through)
    if mode is not None:
        fall = on_window(mode, through)
        if me == root:
            made = compile_direct(window, 1, [], [], [r for r in range(p) if r != root], [0],
                                  mode, through)
        else:
            made = compile_direct(window, 1, [], [(peer(root, 0), arr(0), n) + ((slot(st, root),) if fall else ())],
                                  [], [], mode, through)
        if made is not None:
            return prepared_from(made, first)
    if through is None or pool_path(window, "bcast", n):
        return None  # the pool's direct path, or pieces (the algorithm's body)
    return prepared_from(compile_call(window, 1, *through, None, [] if me == root else [root]), first)


@register("bcast", "shared_window", needs=("window",), prepare=_prepare,
          description="the root copies into its window region; the others copy out")
def bcast(ctx, buf: np.ndarray, root: int) -> None:
    if ctx.size == 1 or buf.size == 0:
        return
    if run_prepared(ctx, _prepare, ("bcast", buf.dtype, buf.size, root), buf, root):
        return
    window, st = state_of(ctx)
    readers = direct(ctx, window, st, buf, buf.nbytes, "bcast")
    if readers is not None:
        if ctx.rank != root:
            readers.read(root, 0, buf)
        window.fence(ctx.deadline)  # the root keeps its buffer until everyone has it
        return
    data = buf.view(np.uint8)
    step = max(_ALIGN, budget(st))
    u8 = data.dtype
    tracer = ctx.tracer
    for a in range(0, data.size, step):
        b = min(a + step, data.size)
        src = st.views(st.next_half(ctx.deadline), b - a, u8)[root]
        if ctx.rank == root:
            t0 = _now() if tracer is not None else 0.0
            compiled.copy(src, data[a:b])
            if tracer is not None:  # a timeline's phase (tracing only)
                tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        if ctx.rank != root:
            t0 = _now() if tracer is not None else 0.0
            compiled.copy(data[a:b], src)
            if tracer is not None:
                tracer.phase(COPYING, t0, _now())
