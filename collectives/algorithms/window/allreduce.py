"""allreduce through the shared window.

Small vectors take a single-fence path: every rank copies its vector into
its half, fences, and reduces all of them itself, in rank order, so every
rank gets the same bits (one compiled call where the window has them).
Where ranks share cores, and at 2 ranks, from 16 KiB up to a half, that
call takes two steps instead: each rank reduces 1/p in the same order,
then copies the others' reduced blocks (:func:`~.tuning.allreduce_two_steps`).
From its span in :data:`~.tuning.COMPILED_DIRECT` on (64 KiB with a core
each), one direct compiled call reduces each rank's 1/p straight from the
peers' buffers and writes it into theirs (:mod:`.direct_reduction`).
Larger ones go in pieces that fit a half: copy in, fence, each rank reduces
1/p of the piece straight from every region, fence, everyone copies the
reduced blocks out. From :data:`~.tuning.DIRECT_FROM` on, where every
rank's buffer can be reached directly (:mod:`.direct`), nothing is copied
in: each rank reduces its 1/p straight from the others' buffers and writes
the reduced pieces, still in the cache, into theirs.
"""

from __future__ import annotations

from time import monotonic as _now

import numpy as np

from ... import compiled
from ...ops import Op
from ...prepared import CopyIn
from ...registry import register
from ...tracing import COPYING
from .direct import SCRATCH_PEER_FIRST, direct, window_direct_from
from .pieces import blocks, displs, piece_elems, striped
from .compiled_calls import arr, first, first_two, compile_call, other_half, prepared_from, reduction, run_prepared, slot
from .direct_reduction import direct_call, takes_direct_call
from .reduction import LOW, reduce
from .state import DATA_OFFSET, PAGE, WindowState, single_fence, state_of, two_step_call, window_state
from .tuning import ALLREDUCE_PIECE, ALLREDUCE_PIECED_FROM, allreduce_two_steps

__all__ = ["allreduce"]


def _prepare(transport, buf: np.ndarray, op: Op, copy_in: CopyIn | None = None):
    """Prepared call of the one-fence path: one compiled call (copy in, fence,
    reduce every slot in rank order), or, without compiled calls, both
    halves' views made once, so a call is one copy in, one fence and p - 1
    ufunc calls. With ``copy_in`` (out of place: ``out`` first takes
    ``buf``), the compiled call on ``(out, buf)`` that copies ``buf`` into
    the window itself, or None."""
    p, rank = transport.size, transport.rank
    nbytes, dtype = buf.nbytes, buf.dtype
    window, st = window_state(transport.window, p)
    one_fence, two = single_fence(nbytes, p, st), two_step_call(window, st, buf, allreduce_two_steps)
    one_call = takes_direct_call("allreduce", window, st, buf, op)
    if p == 1 or nbytes == 0 or dtype in LOW or not (one_fence or two or one_call):
        return None
    if copy_in is not None and copy_in.at != 0:
        return None
    src = 0 if copy_in is None else 1  # the array the vector is read from
    peers = [r for r in range(p) if r != rank]
    if one_call:
        made = direct_call(window, st, rank, buf, op, src)
    elif two:
        made = _two_steps(window, st, rank, buf, op, peers, src)
    else:
        reduced = reduction(arr(0), [slot(st, r) for r in range(p)], buf.size, dtype, op)
        made = compile_call(window, src + 1, [(arr(src), slot(st, rank), nbytes)], [], reduced, peers,
                            ALLREDUCE_PIECED_FROM, ALLREDUCE_PIECE) if reduced else None
    if made is not None or not one_fence or copy_in is not None:
        return prepared_from(made, first if copy_in is None else first_two)
    halves = []
    for off in (DATA_OFFSET, DATA_OFFSET + st.half):
        views = st.views(off, nbytes, dtype)
        halves.append((views[rank], views[0], views[1], tuple(views[2:])))
    fence, ufunc, copyto = window.fence, op.ufunc, compiled.copy

    def run(ctx, buf: np.ndarray, op: Op) -> None:
        mine, v0, v1, rest = halves[(window.step(ctx.deadline) - 1) & 1]
        copyto(mine, buf)
        fence(ctx.deadline)
        ufunc(v0, v1, out=buf)
        for v in rest:
            ufunc(buf, v, out=buf)

    return run


def _two_steps(window, st: WindowState, rank: int, buf: np.ndarray, op: Op, peers: list[int], src: int = 0):
    """The one-fence path's compiled call in two steps (see
    :func:`~.tuning.two_steps`): copy in the peers' blocks (from the call's
    array ``src``), post; reduce this rank's block (1/p), in rank order, from
    its own array and every peer's region into the half of the second step;
    post it; copy every rank's reduced block out. Every element is reduced
    as the one-step call reduces it, so the bits are the same. No rank
    copies its own block in or its reduced block back into the window:
    2 ranks on 2 cores, 0.83-0.88 of the time at 64 and 256 KiB, 0.87-0.91
    at 1 and 2 MiB (3 pairs); 4 ranks 0.82-0.93 (2 pairs); out of place
    0.84-0.99. The second step's half is free to write once every rank
    posted the first."""
    item, p = buf.itemsize, len(peers) + 1
    counts = blocks(buf.size, p)
    starts = [s * item for s in displs(counts)]
    mine = starts[rank]
    srcs = [arr(src, mine) if r == rank else slot(st, r, mine) for r in range(p)]
    reduced = reduction(other_half(st, rank), srcs, counts[rank], buf.dtype, op)
    if reduced is None:
        return None
    before = [(arr(src, starts[r]), slot(st, rank, starts[r]), counts[r] * item) for r in peers]
    then = ([], [(slot(st, r), arr(0, starts[r]), counts[r] * item) for r in range(p)])
    return compile_call(window, src + 1, before, [], reduced, peers, then=then)


@register("allreduce", "shared_window", needs=("window",), prepare=_prepare, copies_in=True,
          description="single-copy reduction through the shared window (1/p per rank)")
def allreduce(ctx, buf: np.ndarray, op: Op, source: np.ndarray | None = None) -> None:
    """``source``: out of place, the values (``buf`` takes the result only);
    read where ``buf`` would be, so a call that fails at its arrival
    leaves ``buf`` unchanged."""
    p = ctx.size
    if p == 1 or buf.size == 0:
        if source is not None and buf.size:
            compiled.copy(buf, source)
        return
    window, st = state_of(ctx)
    key = ("allreduce", buf.dtype, buf.size, op.name)
    case = (_prepare, key, buf, op) if source is None else (_prepare_out_of_place, key + (1,), buf, source, op)
    if takes_direct_call("allreduce", window, st, buf, op) and run_prepared(ctx, *case):
        return
    src = buf if source is None else source
    if single_fence(buf.nbytes, p, st):
        if not run_prepared(ctx, *case):
            _small(ctx, window, st, buf, op, src)
        return
    if two_step_call(window, st, buf, allreduce_two_steps) and run_prepared(ctx, *case):
        return
    copy_in = None if source is None else (buf, source)
    if buf.nbytes < window_direct_from("allreduce", window, p) or not _direct(ctx, window, st, buf, op, copy_in):
        _pieces(ctx, window, st, buf, op, src)


def _prepare_out_of_place(transport, buf: np.ndarray, source: np.ndarray, op: Op):
    """:func:`_prepare` of an out-of-place call: its arrays ``(buf, source)``."""
    return _prepare(transport, buf, op, CopyIn(0))


def _small(ctx, window, st: WindowState, buf: np.ndarray, op: Op, src: np.ndarray) -> None:
    """The one-fence path in Python: copy ``src`` in, fence, reduce every
    region into ``buf``."""
    off = st.next_half(ctx.deadline)
    views = st.views(off, buf.nbytes, buf.dtype)
    tracer = ctx.tracer
    t0 = _now() if tracer is not None else 0.0
    compiled.copy(views[ctx.rank], src)
    if tracer is not None:  # a timeline's phases (tracing only)
        tracer.phase(COPYING, t0, _now())
    window.fence(ctx.deadline)
    if buf.dtype in LOW:
        reduce(ctx, op, buf, views)
        return
    t0 = _now() if tracer is not None else 0.0
    ufunc = op.ufunc  # the common case without reduce_many's checks
    ufunc(views[0], views[1], out=buf)
    for v in views[2:]:
        ufunc(buf, v, out=buf)
    if tracer is not None:
        tracer.phase("reducing", t0, _now())


def _pieces(ctx, window, st: WindowState, buf: np.ndarray, op: Op, src: np.ndarray) -> None:
    """Pieces through the window: copy in the blocks of ``src`` others
    reduce, fence, reduce this rank's block from ``src`` and every region
    into its region, fence, copy every reduced block out into ``buf``."""
    p, me = ctx.size, ctx.rank
    step = piece_elems(st.half, p, buf.itemsize)
    item = buf.itemsize
    peers = [r for r in range(p) if r != me]
    tracer = ctx.tracer
    for parts, used in striped(blocks(buf.size, p), step):
        base = st.next_half(ctx.deadline)
        mine = st.regions[me]
        t0 = _now() if tracer is not None else 0.0
        for r in peers:
            start, n, off = parts[r]
            if n:
                compiled.copy(mine[base + off * item:base + (off + n) * item].view(buf.dtype),
                            src[start:start + n])
        if tracer is not None:  # a timeline's phase (tracing only)
            tracer.phase(COPYING, t0, _now())
        window.fence(ctx.deadline)
        start_me, n_me, off_me = parts[me]
        if n_me:
            srcs = st.views(base + off_me * item, n_me * item, buf.dtype)
            reduce(ctx, op, srcs[me], [src[start_me:start_me + n_me]] + [srcs[r] for r in peers])
        window.fence(ctx.deadline)
        t0 = _now() if tracer is not None else 0.0
        for r, (start, n, off) in enumerate(parts):
            if n:
                compiled.copy(buf[start:start + n],
                            st.regions[r][base + off * item:base + (off + n) * item].view(buf.dtype))
        if tracer is not None:
            tracer.phase(COPYING, t0, _now())


def _direct(ctx, window, st: WindowState, buf: np.ndarray, op: Op,
            copy_in: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
    """Single-copy path straight from the other ranks' buffers (:func:`~.direct.direct`).
    Each rank reduces its 1/p piece by piece and writes each reduced piece
    into every other buffer as it is made (in the shared pool) or while it
    is still in the cache (through direct access): no rank reads or writes
    another's 1/p, so one closing fence suffices. Before each piece it writes
    it looks whether a peer gave up on the call (and may use its buffer
    again). Returns False (every rank alike) when some buffer cannot be
    reached. ``copy_in``: an out-of-place call's (see :func:`~.direct.publish`)."""
    peers = direct(ctx, window, st, buf, buf.nbytes, "allreduce", copy_in)
    if peers is None:
        return False
    item = buf.itemsize
    seg = ctx.segment_bytes if ctx.size <= 4 else ctx.segment_bytes // 4
    longest = min(max(1, seg // item), -(-buf.size // ctx.size))  # no piece is longer
    mine = displs(blocks(buf.size, ctx.size))[ctx.rank] * item
    scratch = {r: _placed_scratch(ctx, longest * item, SCRATCH_PEER_FIRST + i, peers.address(r) + mine)
               .view(buf.dtype) for i, r in enumerate(r for r in range(ctx.size) if r != ctx.rank)}
    for a, b, others in _own_pieces(ctx, buf, seg, peers.pool_bounds(item)):
        for r in others:
            peers.inside(r, a * item, b * item)
        pooled = {r: peers.pooled(r, a * item, b * item) for r in others}
        srcs = [buf[a:b]]
        for r, v in pooled.items():
            if v is None:
                peers.read(r, a * item, scratch[r][:b - a])
            srcs.append(scratch[r][:b - a] if v is None else v.view(buf.dtype))
        window.check_aborted()  # the reduction writes into the peers' pools, a peer that gave up may reuse its buffer
        reduce(ctx, op, buf[a:b], srcs, [v.view(buf.dtype) for v in pooled.values() if v is not None])
        for r, v in pooled.items():
            if v is None:
                peers.write(r, a * item, buf[a:b])
    window.fence(ctx.deadline)  # every buffer complete; nobody touches one while others use it
    return True


def _placed_scratch(ctx, nbytes: int, scratch_slot: int, address: int) -> np.ndarray:
    """``nbytes`` of scratch that start at ``address``'s place in a page: the
    kernel copies from there at full speed (see ``transports.shm.cma.skewed``)."""
    raw = ctx.scratch(nbytes + PAGE, np.uint8, slot=scratch_slot)
    skip = (address - raw.ctypes.data) % PAGE
    return raw[skip:skip + nbytes]


def _own_pieces(ctx, buf: np.ndarray, piece_bytes: int, cuts: tuple[int, ...] = ()):
    """(start, stop, other ranks) of each piece of at most ``piece_bytes`` of
    this rank's 1/p of ``buf`` (in elements), also cut at ``cuts``."""
    counts = blocks(buf.size, ctx.size)
    lo = displs(counts)[ctx.rank]
    hi = lo + counts[ctx.rank]
    others = [r for r in range(ctx.size) if r != ctx.rank]
    step = max(1, piece_bytes // buf.itemsize)
    ends = sorted({c for c in cuts if lo < c < hi} | set(range(lo + step, hi, step)) | {hi})
    for a, b in zip([lo] + ends, ends):
        yield a, b, others
