"""alltoall through the shared window: each rank copies its p blocks into its
region, fence, each copies block ``rank`` of every region out; from
:data:`~.tuning.DIRECT_FROM` on, each reads its blocks straight from every
rank's buffer (:mod:`.direct`)."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...registry import register
from ...tracing import COPYING
from .direct import direct
from .compiled_calls import (arr, on_window, pool_path, first_two, compile_call, compile_direct, direct_mode, peer,
                             prepared_from, run_prepared, slot)
from .state import budget, region, state_of, window_state

__all__ = ["alltoall"]


def _prepare(transport, sendbuf: np.ndarray, recvbuf: np.ndarray):
    """One compiled call when the blocks fit one piece through the window."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    item = sendbuf.itemsize
    b = sendbuf.size // p * item  # bytes per block
    if p == 1 or not b:
        return None
    through = None  # the window call's copies
    if b <= budget(st) // p:  # its own block copied once every signature agreed (after the post)
        before = [(arr(0, d * b), slot(st, me, d * b), b) for d in range(p) if d != me]
        through = before, [(arr(0, me * b), arr(1, me * b), b)] + [(slot(st, r, me * b), arr(1, r * b), b)
                                                                   for r in range(p) if r != me]
    mode = direct_mode(window, "alltoall", sendbuf.nbytes, through)
    if mode is not None:
        fall = on_window(mode, through)  # (where each peer's copy in puts block me)
        after = [(arr(0, me * b), arr(1, me * b), b)] + [
            (peer(r, 0, me * b), arr(1, r * b), b) + ((slot(st, r, me * b),) if fall else ()) for r in range(p) if r != me]
        made = compile_direct(window, 2, [], after, [r for r in range(p) if r != me], [0],
                              mode, through)
        if made is not None:
            return prepared_from(made, first_two)
    if through is None or pool_path(window, "alltoall", sendbuf.nbytes):
        return None  # the pool's direct path, or pieces (the algorithm's body)
    return prepared_from(compile_call(window, 2, *through, None, [r for r in range(p) if r != me]), first_two)


@register("alltoall", "shared_window", needs=("window",), prepare=_prepare,
          description="each rank copies its blocks into its window region; each copies its own from every region")
def alltoall(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    p, me = ctx.size, ctx.rank
    if p > 1 and run_prepared(ctx, _prepare, ("alltoall", sendbuf.dtype, sendbuf.size), sendbuf, recvbuf):
        return
    b = sendbuf.size // p
    own = (recvbuf[me * b:(me + 1) * b], sendbuf[me * b:(me + 1) * b])  # copied once every signature agreed
    if p == 1 or b == 0:
        compiled.copy(*own)
        return
    window, st = state_of(ctx)
    dt, item = sendbuf.dtype, sendbuf.itemsize
    readers = direct(ctx, window, st, sendbuf, sendbuf.nbytes, "alltoall")
    if readers is not None:
        compiled.copy(*own)
        for r in range(p):
            if r != me:
                readers.read(r, me * b * item, recvbuf[r * b:(r + 1) * b])
        window.fence(ctx.deadline)  # nobody touches its buffer while others still read it
        return
    step = max(1, budget(st) // (p * item))
    tracer = ctx.tracer
    for a in range(0, b, step):
        m = min(step, b - a)
        base = st.next_half(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        for d in range(p):
            if d != me:
                compiled.copy(region(st, me, base + d * m * item, m, dt), sendbuf[d * b + a:d * b + a + m])
        if tracer is not None:  # a timeline's phase (tracing only)
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        if a == 0:
            compiled.copy(*own)
        for r in range(p):
            if r != me:
                compiled.copy(recvbuf[r * b + a:r * b + a + m], region(st, r, base + me * m * item, m, dt))
        if tracer is not None:
            tracer.phase(COPYING, t0, _now())
