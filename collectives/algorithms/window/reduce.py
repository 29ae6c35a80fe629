"""reduce through the shared window: small vectors as allreduce's one-fence
path, the root alone reducing; larger ones in pieces: each rank reduces 1/p
of the piece from every region (the root into its buffer), then the root
copies the others' reduced blocks out. Where ranks share cores, from 64 KiB
up to a half, that is one compiled call of two steps (:func:`_two_steps`),
and from 1 MiB (2 MiB where ranks have a core each) one direct call at any
size: each rank reduces its block from the peers' buffers and writes it
into the root's (:mod:`.direct_reduction`). Other ranks' buffers stay
unchanged."""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...ops import Op
from ...registry import register
from ...tracing import COPYING
from .pieces import blocks, displs, striped_cached
from .compiled_calls import arr, first, compile_call, other_half, prepared_from, reduction, run_prepared, slot
from .direct_reduction import direct_call, takes_direct_call
from .reduction import LOW, reduce as reduce_blocks
from .state import budget, region, single_fence, state_of, two_step_call, window_state
from .tuning import reduce_one_fence_limit, reduce_two_steps

__all__ = ["reduce"]


def _prepare(transport, buf: np.ndarray, root: int, op: Op):
    """One compiled call for the one-fence case: copy in, fence, the root
    reduces; or, where ranks share cores, of two steps (:func:`_two_steps`),
    or the direct call in its span."""
    p, me = transport.size, transport.rank
    window, st = window_state(transport.window, p)
    if p > 1 and buf.size and takes_direct_call("reduce", window, st, buf, op):
        return prepared_from(direct_call(window, st, me, buf, op, root=root), first)
    two = two_step_call(window, st, buf, reduce_two_steps)
    if p == 1 or buf.size == 0 or buf.dtype in LOW or not (two or _one_fence(buf.nbytes, p, window, st)):
        return None
    if reduction(arr(0), [], 0, buf.dtype, op) is None:  # every rank declines alike, not the root alone
        return None
    if two:
        return prepared_from(_two_steps(window, st, me, buf, root, op), first)
    if me == root:
        peers = [r for r in range(p) if r != root]
        reduced = reduction(arr(0), [arr(0)] + [slot(st, r) for r in peers], buf.size, buf.dtype, op)
        return prepared_from(compile_call(window, 1, [], [], reduced, peers), first)
    return prepared_from(compile_call(window, 1, [(arr(0), slot(st, me), buf.nbytes)], [], None, []), first)


def _two_steps(window, st, me: int, buf: np.ndarray, root: int, op: Op):
    """The compiled call of two steps, as the path in pieces in one piece:
    each rank copies in the blocks others reduce, posts; reduces its own
    block (its buffer's first, then every other region's, in rank order),
    the root into its buffer, the others into their region; the others
    post their block in the other half, and the root copies them out."""
    p, item = window.size, buf.itemsize
    counts = blocks(buf.size, p)
    starts = [s * item for s in displs(counts)]
    peers = [r for r in range(p) if r != me]
    before = [(arr(0, starts[r]), slot(st, me, starts[r]), counts[r] * item) for r in peers]
    mine, n = starts[me], counts[me] * item
    dst = arr(0, mine) if me == root else slot(st, me, mine)
    reduced = reduction(dst, [arr(0, mine)] + [slot(st, r, mine) for r in peers], counts[me], buf.dtype, op)
    if me == root:
        then = ([], [(slot(st, r), arr(0, starts[r]), counts[r] * item) for r in peers])
    else:
        then = ([(other_half(st, me, mine), slot(st, me), n)], [], False)
    return compile_call(window, 1, before, [], reduced, peers, then=then)


def _one_fence(nbytes: int, p: int, window, st) -> bool:
    """Whether ``nbytes`` take the one-fence path (see :func:`~.tuning.reduce_one_fence_limit`)."""
    return single_fence(nbytes, p, st, reduce_one_fence_limit(p, window.cores))


@register("reduce", "shared_window", needs=("window",), prepare=_prepare,
          description="small: one fence, the root reduces every region; large: 1/p per rank, the root copies out")
def reduce(ctx, buf: np.ndarray, root: int, op: Op) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1 or buf.size == 0:
        return
    if run_prepared(ctx, _prepare, ("reduce", buf.dtype, buf.size, root, op.name), buf, root, op):
        return
    window, st = state_of(ctx)
    dt, item = buf.dtype, buf.itemsize
    tracer = ctx.tracer
    if _one_fence(buf.nbytes, p, window, st):
        base = st.next_half(ctx.deadline)
        if me != root:
            t0 = _now() if tracer is not None else 0.0
            compiled.copy(st.views(base, buf.nbytes, dt)[me], buf)
            if tracer is not None:  # a timeline's phase (tracing only)
                tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        if me == root:
            views = st.views(base, buf.nbytes, dt)
            reduce_blocks(ctx, op, buf, [buf] + [views[r] for r in range(p) if r != root])
        return
    step = max(1, budget(st) // (p * item))
    peers = [r for r in range(p) if r != me]
    for parts, _ in striped_cached(st, blocks(buf.size, p), step):
        base = st.next_half(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        for r in peers:  # the pieces of the blocks the others reduce
            start, n, off = parts[r]
            if n:
                compiled.copy(region(st, me, base + off * item, n, dt), buf[start:start + n])
        if tracer is not None:
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        start, n, off = parts[me]
        if n:  # the root reduces its block straight into its buffer
            srcs = [region(st, r, base + off * item, n, dt) for r in range(p)]
            mine = buf[start:start + n]
            reduce_blocks(ctx, op, mine if me == root else srcs[me], [mine] + [srcs[r] for r in peers])
        window.fence(ctx.deadline)
        if me == root:
            t0 = _now() if tracer is not None else 0.0
            for r, (start, n, off) in enumerate(parts):
                if n and r != root:
                    compiled.copy(buf[start:start + n], region(st, r, base + off * item, n, dt))
            if tracer is not None:
                tracer.phase(COPYING, t0, _now())
