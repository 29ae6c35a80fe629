"""Shared-window algorithms: ranks read each other's memory directly.

For transports that offer a :class:`~collectives.transport.SharedWindow`
(shared memory now; CUDA IPC and RDMA later). Each rank's window region is
split into a small metadata block and two halves used in turns, so that a
rank may fill one half for the next step while slower ranks still read the
other. The window counts the steps (:meth:`_WindowState.next_half`): a half
is rewritten only once every rank is done with its last use.

* ``allreduce``: small vectors take a single-fence path (every rank copies
  its vector into its half, fences, and reduces all of them itself, in rank
  order, so every rank gets the same bits). Larger ones go in pieces that
  fit a half: copy in, fence, each rank reduces 1/p of the piece straight
  from every region, fence, everyone copies the reduced blocks out. When
  every rank's buffer lives in the shared allocation pool
  (``comm.alloc``), or the window offers cross-memory attach, nothing is
  copied in: each rank reduces its 1/p straight from the others' buffers
  and writes the reduced pieces, still in the cache, into theirs.
* ``reduce_scatter``: copy in, fence, each rank reduces its block into recvbuf.
* ``allgather``: each rank copies its block in, fence, copies the others out.
* ``bcast``: the root copies in, fence, the others copy out.

Where the window offers native plans (``window.plan``), the one-piece cases
(here and in :mod:`.window_blocks`) run as one plan each, on every path,
every rank alike: copies in, a post, a wait for only the ranks whose
regions it reads (not a fence of all), copies out or a reduction. The
persistent plans (``prepare``) of repeated calls are the same plans.

From a size per collective (:data:`DIRECT_FROM`, which depends on the
ranks per core) on, when every rank's buffer can be read directly (it
lives in the shared pool, or the window offers cross-memory attach,
``window.cma``, ``window.read`` and ``window.write``), the collectives
publish their buffers' addresses (one fence) and copy straight between the
ranks' buffers: one copy instead of two, and a final fence so that no rank
changes its buffer while another still uses it.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from .. import native
from ..errors import MismatchedCollective
from ..ops import BFLOAT16, Op
from ..registry import register

__all__ = ["allreduce", "reduce_scatter", "allgather", "bcast", "SMALL_BYTES", "DIRECT_FROM", "direct_from"]

#: Vectors up to this size take allreduce's single-fence path.
SMALL_BYTES = 32 * 1024
#: Up to this many bytes times 1/p, every rank reduces the whole vector from
#: the window after one fence: p*n bytes read per rank, but no second fence
#: and no reads of private memory (measured: 2 ranks, 64 KiB to 512 KiB are
#: 2 to 4x faster this way than through cross-memory reads).
SMALL_TOTAL_BYTES = 1 << 20
#: Largest piece (bytes per region half) of the pipelined paths.
PIECE_BYTES = 2 << 20
META_BYTES = 4096
#: The halves start this far into the region and are whole pages long, so
#: that both sit half a page off the page grid. Memory copies out of a half
#: into a buffer that starts 1 to 31 bytes past the same place in a page run
#: about 8 times slower here (the string-copy instruction stalls on 4 KiB
#: aliasing), and that is where malloc puts large arrays: 16 bytes past a
#: page. Half a page off, no common alignment of user buffers comes near.
DATA_OFFSET = META_BYTES + 2048
_PAGE = 4096
#: Where each collective reads peers' buffers directly (one copy, but through
#: the kernel: a system call and page pinning per read, about 10 GB/s here
#: against 30 GB/s for a copy that stays in the cache) rather than going
#: through the window in pieces (two copies): from ``bytes`` times the ranks
#: per core to ``power``; with ``huge``, only when every buffer read or
#: written through cross-memory attach lies in huge pages (from 4 KiB pages
#: such copies run at half the speed, and lose to the pieces; buffers in the
#: shared pool need no pages pinned). Measured on 2 cores at 2 and 4 ranks,
#: the two paths in turns, in place, on buffers with huge pages and on
#: buffers with 4 KiB pages, back-to-back calls, the median of each call's
#: slowest rank. The window's copies run on every rank at once and stay in
#: the cache, so most collectives keep them long; a scatter's root alone
#: fills the window, which ranks that share its core must wait for.
DIRECT_FROM: dict[str, tuple[int, int, bool]] = {
    # huge pages: direct 0.62-0.78 of the pieces' time at 2-32 MiB (2 ranks),
    # 0.58-0.94 at 1-64 MiB (4 ranks); 4 KiB pages: 0.89-1.55
    "allreduce": (4 << 20, 0, True),
    # huge pages: direct 0.82-0.91 from 16 MiB (2 ranks), 1.12-1.24 at 4-64 MiB (4 ranks)
    "reduce_scatter": (16 << 20, 2, True),
    # huge pages: direct 0.42-0.81 from 2 MiB (2 ranks), 1.14-1.27 at 4-64 MiB (4 ranks)
    "allgather": (2 << 20, 6, True),
    # direct 0.90-1.8x the pieces' time at 1-64 MiB (2 and 4 ranks), either pages
    "bcast": (256 << 20, 0, False),
    # 2 ranks: pieces 1.1-2.4x faster up to 64 MiB; 4 ranks: direct 0.8-0.95 from 16 MiB
    "gather": (32 << 20, 0, False),
    # in turns: direct 0.58-0.96 from 2 MiB (2 ranks), 0.66-0.95 from 4 MiB (4 ranks),
    # either pages; but in the benchmark's sweep (2 ranks) 1.1-1.8x slower at 1-16 MiB
    "alltoall": (32 << 20, 0, False),
    # 2 ranks: pieces 1.1-2.1x faster up to 64 MiB; 4 ranks: direct 0.52-0.78 from 4 MiB
    "scatter": (32 << 20, -3, False),
}
#: Blocks from this size on are reduced by the native kernel when it is there.
NATIVE_REDUCE_BYTES = 16 * 1024
_ALIGN = 64

_state: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def direct_from(collective: str, p: int, cores: int) -> int:
    """Bytes from which ``collective`` at ``p`` ranks on ``cores`` cores (0:
    a core each) reads peers' buffers directly (see :data:`DIRECT_FROM`);
    ``COLLECTIVES_WINDOW_DIRECT_BYTES``, when set, replaces it for every
    collective (all ranks must agree)."""
    forced = os.environ.get("COLLECTIVES_WINDOW_DIRECT_BYTES")
    if forced:
        return int(forced)
    nbytes, power, _ = DIRECT_FROM[collective]
    per_core = -(-p // cores) if cores else 1
    return nbytes * per_core ** power if power >= 0 else nbytes // per_core ** -power


def _direct_from(collective: str, window, p: int) -> int:
    """:func:`direct_from` on the cores the window's ranks share (``window.cores``)."""
    return direct_from(collective, p, getattr(window, "cores", 0))


def _wants_huge_pages(collective: str) -> bool:
    """Whether ``collective`` reads private buffers directly only when they lie
    in huge pages (not when ``COLLECTIVES_WINDOW_DIRECT_BYTES`` forces the size)."""
    return DIRECT_FROM[collective][2] and not os.environ.get("COLLECTIVES_WINDOW_DIRECT_BYTES")


class _WindowState:
    """Per-window bookkeeping shared by the algorithms: the turn counter
    (which half is next) and views prepared once per buffer shape."""

    def __init__(self, window, size: int) -> None:
        cap = window.capacity
        self.half = max(((cap - DATA_OFFSET) // 2) // _PAGE * _PAGE, 0)
        self.window = window
        self.regions = [window.region(r) for r in range(size)]
        self.plans: dict[tuple, list[np.ndarray]] = {}

    def next_half(self, deadline: float) -> int:
        """Byte offset of the half to use for the next step (they alternate;
        the window counts the steps, its native plans' too, and makes sure
        the half is free)."""
        return DATA_OFFSET + ((self.window.step(deadline) - 1) & 1) * self.half

    def views(self, offset: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's region bytes [offset, offset + nbytes) as ``dtype`` (cached)."""
        key = (offset, nbytes, dtype)
        got = self.plans.get(key)
        if got is None:
            if len(self.plans) > 256:
                self.plans.clear()
            got = [reg[offset:offset + nbytes].view(dtype) for reg in self.regions]
            self.plans[key] = got
        return got


def _state_of(ctx) -> tuple[object, _WindowState]:
    return _window_state(ctx.transport.window, ctx.size)


def _window_state(window, size: int) -> tuple[object, _WindowState]:
    st = _state.get(window)
    if st is None:
        st = _state[window] = _WindowState(window, size)
    return window, st


_LOW = frozenset({np.dtype(np.float16)} | ({BFLOAT16} if BFLOAT16 is not None else set()))


def _low_precision(dtype: np.dtype) -> bool:
    return dtype in _LOW


def _reduce(ctx, op: Op, dst: np.ndarray, srcs: list[np.ndarray], copies: list[np.ndarray] = ()) -> None:
    """``dst = srcs[0] op srcs[1] ...`` (dst may be srcs[0]), then the result
    into each of ``copies`` too; float32 scratch for half floats; natively
    (one pass over the sources, the copies made as the result is) for large
    blocks."""
    if dst.nbytes >= NATIVE_REDUCE_BYTES and len(srcs) > 1 and native.enabled() is not None:
        codes = native.kernel_codes(dst.dtype, op.name, op.ufunc)
        if codes is not None and all(a.flags.c_contiguous for a in srcs) and dst.flags.c_contiguous:
            native.reduce_into(dst, srcs, codes, copies)
            return
    scratch = ctx.scratch(dst.size, np.float32, slot=7) if _low_precision(dst.dtype) else None
    op.reduce_many(dst, srcs, scratch)
    for c in copies:
        native.copy(c, dst)


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    return arr.view(np.uint8)


def _blocks(count: int, p: int) -> list[int]:
    """Split ``count`` elements into p nearly equal blocks."""
    base, extra = divmod(count, p)
    return [base + (1 if r < extra else 0) for r in range(p)]


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _piece_elems(half: int, p: int, itemsize: int) -> int:
    """Elements per block per piece so that p sub-blocks fit one half."""
    budget = min(half, PIECE_BYTES)
    return max(1, budget // (p * itemsize))


def _striped_cached(st: "_WindowState", counts: list[int], step: int) -> list:
    """:func:`_striped` as a list, computed once per (counts, step)."""
    key = ("striped", tuple(counts), step)
    got = st.plans.get(key)
    if got is None:
        if len(st.plans) > 256:
            st.plans.clear()
        got = st.plans[key] = list(_striped(counts, step))
    return got


def _striped(counts: list[int], step: int):
    """Pieces over p blocks at once: piece k holds elements [k*step, (k+1)*step)
    of every block. Yields, per piece, a list of (start in the vector, length,
    byte offset within the half) per rank."""
    displs = _displs(counts)
    npieces = max(-(-c // step) for c in counts) if counts else 0
    for k in range(npieces):
        parts, off = [], 0
        for c, d in zip(counts, displs):
            lo = min(k * step, c)
            n = min(step, c - lo)
            parts.append((d + lo, n, off))
            off += n
        yield parts, off


# ------------------------------------------------------------------ allreduce


def _single_fence(nbytes: int, p: int, st: _WindowState) -> bool:
    """Whether ``nbytes`` take the one-fence path (every rank's copy in the window)."""
    return nbytes <= min(max(SMALL_BYTES, SMALL_TOTAL_BYTES // p), st.half)


# ------------------------------------------------------ prepared one-fence cases
# A collective's one-fence case as data for the window's native plan (see
# ShmWindow.plan): copies before the fence, copies and a reduction after it.


def _arr(index: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in the call's array ``index``."""
    return (index, byte_offset, 0)


def _slot(st: _WindowState, rank: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in ``rank``'s window region at ``byte_offset`` of the half in use."""
    base = st.regions[rank].ctypes.data + DATA_OFFSET + byte_offset
    return (-1, base, base + st.half)


def _plan(window, narrays: int, before: list, after: list, reduce: tuple | None, sources: list[int]):
    """``(run, settle)`` of the window's native plan, or None without one:
    ``run(arrays, seq, sig)`` takes the next step of call ``seq`` (signature
    ``sig``) as the algorithm would, and returns None, or what to wait for
    (or why it stopped): then ``settle(arrays, late, deadline)``.
    ``sources``: the ranks whose regions ``after`` and ``reduce`` read."""
    make = getattr(window, "plan", None)
    plan = make(narrays, before, after, reduce, sources) if make is not None else None
    if plan is None:
        return None
    settle = window.settle
    return plan.run, lambda arrays, late, deadline: settle(plan, arrays, late, deadline)


def _reduction(dst: tuple, srcs: list, count: int, dtype: np.dtype, op: Op) -> tuple | None:
    """The plan's reduction ``dst = srcs[0] op srcs[1] ...``, or None without a native kernel."""
    codes = native.kernel_codes(dtype, op.name, op.ufunc)
    return None if codes is None else (dst, srcs, count) + codes


def _first(buf, *rest) -> tuple:
    return (buf,)


def _first_two(a, b, *rest) -> tuple:
    return (a, b)


def _planned(made: tuple | None, arrays_of):
    """The persistent plan (see registry.Algorithm) of a native plan ``made``
    (or None): a function with the algorithm's signature, whose
    ``arrays_of(*args)`` are the plan's arrays; ``on_arrays`` is ``made``."""
    if made is None:
        return None
    go, settle = made

    def run(ctx, *args) -> None:
        arrays = arrays_of(*args)
        late = go(arrays, ctx.tag >> 1, ctx.sig)
        if late is not None:
            settle(arrays, late, ctx.deadline)
    run.on_arrays = made
    return run


_MISSING = object()


def _run_planned(ctx, prepare, key: tuple, *args) -> bool:
    """Run this call's case as its persistent plan, made by ``prepare`` once
    per ``key`` (the call's signature), if it has one; True when it ran.
    Every rank runs a case alike, through the plan or not: a native plan
    and a fence do not wait for each other."""
    _, st = _state_of(ctx)
    run = st.plans.get(key, _MISSING)
    if run is _MISSING:
        if len(st.plans) > 256:
            st.plans.clear()
        run = st.plans[key] = prepare(ctx.transport, *args)
    if run is None:
        return False
    run(ctx, *args)
    return True


def _prepare_allreduce(transport, buf: np.ndarray, op: Op):
    """Persistent plan of the one-fence path: one native call (copy in, fence,
    reduce every slot in rank order), or, without the extension, both
    halves' views made once, so a call is one copy in, one fence and p - 1
    ufunc calls."""
    p, rank = transport.size, transport.rank
    nbytes, dtype = buf.nbytes, buf.dtype
    window, st = _window_state(transport.window, p)
    if p == 1 or nbytes == 0 or dtype in _LOW or not _single_fence(nbytes, p, st):
        return None
    reduction = _reduction(_arr(0), [_slot(st, r) for r in range(p)], buf.size, dtype, op)
    peers = [r for r in range(p) if r != rank]
    made = _plan(window, 1, [(_arr(0), _slot(st, rank), nbytes)], [], reduction, peers) if reduction else None
    if made is not None:
        return _planned(made, _first)
    halves = []
    for off in (DATA_OFFSET, DATA_OFFSET + st.half):
        views = st.views(off, nbytes, dtype)
        halves.append((views[rank], views[0], views[1], tuple(views[2:])))
    fence, ufunc, copyto = window.fence, op.ufunc, native.copy

    def run(ctx, buf: np.ndarray, op: Op) -> None:
        mine, first, second, rest = halves[(window.step(ctx.deadline) - 1) & 1]
        copyto(mine, buf)
        fence(ctx.deadline)
        ufunc(first, second, out=buf)
        for v in rest:
            ufunc(buf, v, out=buf)

    return run


@register("allreduce", "shared_window", needs=("window",), prepare=_prepare_allreduce,
          description="single-copy reduction through the shared window (1/p per rank)")
def allreduce(ctx, buf: np.ndarray, op: Op) -> None:
    p = ctx.size
    if p == 1 or buf.size == 0:
        return
    window, st = _state_of(ctx)
    if _single_fence(buf.nbytes, p, st):
        if not _run_planned(ctx, _prepare_allreduce, ("allreduce", buf.dtype, buf.size, op.name), buf, op):
            _allreduce_small(ctx, window, st, buf, op)
        return
    if buf.nbytes < _direct_from("allreduce", window, p) or not _allreduce_direct(ctx, window, st, buf, op):
        _allreduce_pieces(ctx, window, st, buf, op)


def _allreduce_small(ctx, window, st: _WindowState, buf: np.ndarray, op: Op) -> None:
    off = st.next_half(ctx.deadline)
    views = st.views(off, buf.nbytes, buf.dtype)
    native.copy(views[ctx.rank], buf)
    window.fence(ctx.deadline)
    if buf.dtype in _LOW:
        _reduce(ctx, op, buf, views)
        return
    ufunc = op.ufunc  # the common case without reduce_many's checks
    ufunc(views[0], views[1], out=buf)
    for v in views[2:]:
        ufunc(buf, v, out=buf)


#: Bytes per rank and half of the metadata block that :func:`_publish` writes.
_META_BYTES = 64


def _shared_part(window, buf: np.ndarray) -> tuple[int, int, int] | None:
    """(pool offset of ``buf``'s byte 0, first, end byte of the part in this
    rank's shared pool), or None; the window may move a buffer used again
    into its pool now (``window.shared_part``)."""
    if hasattr(window, "shared_part"):
        return window.shared_part(buf, adopt=True)
    where = window.locate(buf) if hasattr(window, "locate") else None
    return None if where is None else (where[1], 0, buf.nbytes)


def _publish(ctx, window, st: _WindowState, buf: np.ndarray, collective: str) -> list[np.ndarray]:
    """Tell every rank where ``buf`` is and learn the same of every rank; one
    fence. Each rank's description: [part in the shared pool (0/1), pool
    offset of byte 0, address, reachable, first and end byte in the pool,
    size]; reachable: ``collective`` may read and write the buffer through
    cross-memory attach (see :data:`DIRECT_FROM`)."""
    meta_off = ((window.step(ctx.deadline) - 1) & 1) * _META_BYTES
    part = _shared_part(window, buf)
    meta = st.regions[ctx.rank][meta_off:meta_off + _META_BYTES].view(np.int64)
    meta[0] = part is not None
    meta[1], meta[4], meta[5] = part if part is not None else (0, 0, 0)
    meta[2] = buf.__array_interface__["data"][0]
    meta[3] = (part is not None or not _wants_huge_pages(collective)
               or not hasattr(window, "huge_pages") or window.huge_pages(buf))
    meta[6] = buf.nbytes
    window.fence(ctx.deadline)
    return [st.regions[r][meta_off:meta_off + _META_BYTES].view(np.int64).copy() for r in range(ctx.size)]


def _allreduce_direct(ctx, window, st: _WindowState, buf: np.ndarray, op: Op) -> bool:
    """Single-copy path straight from the other ranks' buffers (:func:`_direct`).
    Each rank reduces its 1/p piece by piece and writes each reduced piece
    into every other buffer as it is made (in the shared pool) or while it
    is still in the cache (through cross-memory attach): no rank reads or writes
    another's 1/p, so one closing fence suffices. Returns False (every rank
    alike) when some buffer cannot be reached."""
    peers = _direct(ctx, window, st, buf, buf.nbytes, "allreduce")
    if peers is None:
        return False
    item = buf.itemsize
    seg = ctx.segment_bytes if ctx.size <= 4 else ctx.segment_bytes // 4
    longest = min(max(1, seg // item), -(-buf.size // ctx.size))  # no piece is longer
    mine = _displs(_blocks(buf.size, ctx.size))[ctx.rank] * item
    scratch = {r: _placed_scratch(ctx, longest * item, 8 + i, peers.address(r) + mine).view(buf.dtype)
               for i, r in enumerate(r for r in range(ctx.size) if r != ctx.rank)}
    for a, b, others in _own_pieces(ctx, buf, seg, peers.pool_bounds(item)):
        for r in others:
            peers._inside(r, a * item, b * item)
        pooled = {r: peers.pooled(r, a * item, b * item) for r in others}
        srcs = [buf[a:b]]
        for r, v in pooled.items():
            if v is None:
                peers.read(r, a * item, scratch[r][:b - a])
            srcs.append(scratch[r][:b - a] if v is None else v.view(buf.dtype))
        _reduce(ctx, op, buf[a:b], srcs, [v.view(buf.dtype) for v in pooled.values() if v is not None])
        for r, v in pooled.items():
            if v is None:
                peers.write(r, a * item, buf[a:b])
    window.fence(ctx.deadline)  # every buffer complete; nobody touches one while others use it
    return True


def _placed_scratch(ctx, nbytes: int, slot: int, address: int) -> np.ndarray:
    """``nbytes`` of scratch that start at ``address``'s place in a page: the
    kernel copies from there at full speed (see ``transports.shm.skewed``)."""
    raw = ctx.scratch(nbytes + _PAGE, np.uint8, slot=slot)
    skip = (address - raw.ctypes.data) % _PAGE
    return raw[skip:skip + nbytes]


def _own_pieces(ctx, buf: np.ndarray, piece_bytes: int, cuts: tuple[int, ...] = ()):
    """(start, stop, other ranks) of each piece of at most ``piece_bytes`` of
    this rank's 1/p of ``buf`` (in elements), also cut at ``cuts``."""
    counts = _blocks(buf.size, ctx.size)
    lo = _displs(counts)[ctx.rank]
    hi = lo + counts[ctx.rank]
    others = [r for r in range(ctx.size) if r != ctx.rank]
    step = max(1, piece_bytes // buf.itemsize)
    ends = sorted({c for c in cuts if lo < c < hi} | set(range(lo + step, hi, step)) | {hi})
    for a, b in zip([lo] + ends, ends):
        yield a, b, others


class _Readers:
    """Every rank's published buffer (:func:`_publish`), read and written
    straight in the shared pool where it lies there, else through
    cross-memory attach."""

    def __init__(self, window, metas: list[np.ndarray], rank: int) -> None:
        self.window = window
        self.window_rank = rank
        self.metas = metas
        self.pools = getattr(window, "allocation", None)

    def address(self, rank: int) -> int:
        """Where ``rank``'s buffer is in its own address space."""
        return int(self.metas[rank][2])

    def pool_bounds(self, itemsize: int) -> tuple[int, ...]:
        """Element indices where some rank's buffer enters or leaves its pool
        (pieces cut there are either wholly in a rank's pool or wholly out)."""
        return tuple(sorted({-(-int(m[4]) // itemsize) for m in self.metas if int(m[0])}
                            | {int(m[5]) // itemsize for m in self.metas if int(m[0])}))

    def pooled(self, rank: int, start: int, stop: int) -> np.ndarray | None:
        """Bytes [start, stop) of ``rank``'s buffer in its pool, if they all lie there."""
        m = self.metas[rank]
        if not int(m[0]) or self.pools is None or start < int(m[4]) or stop > int(m[5]):
            return None
        return self.pools(rank)[int(m[1]) + start:int(m[1]) + stop]

    def _split(self, rank: int, start: int, stop: int):
        """[start, stop) as (start, stop, pool bytes or None): the part in
        ``rank``'s pool and the parts before and after it."""
        m = self.metas[rank]
        lo, hi = (int(m[4]), int(m[5])) if int(m[0]) and self.pools is not None else (stop, stop)
        cuts = sorted({start, stop, min(max(lo, start), stop), min(max(hi, start), stop)})
        for a, b in zip(cuts, cuts[1:]):
            yield a, b, self.pooled(rank, a, b)

    def read(self, rank: int, byte_offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``byte_offset`` of ``rank``'s buffer into ``out``."""
        self._move(rank, byte_offset, out, True)

    def write(self, rank: int, byte_offset: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``byte_offset`` of ``rank``'s buffer."""
        self._move(rank, byte_offset, src, False)

    def _inside(self, rank: int, start: int, stop: int) -> None:
        """Refuse to touch bytes [start, stop) of ``rank``'s buffer unless they
        lie inside it, as ``rank`` published it (never outside a buffer, even
        if a disagreement slipped past the signatures)."""
        if start < 0 or stop > int(self.metas[rank][6]):
            raise MismatchedCollective(
                f"rank {self.window_rank}: would touch bytes [{start}, {stop}) of rank {rank}'s buffer, "
                f"which holds {int(self.metas[rank][6])} bytes (ranks disagree about the call)")

    def _move(self, rank: int, byte_offset: int, local: np.ndarray, reading: bool) -> None:
        """:meth:`read` into ``local`` or :meth:`write` it, part by part (:meth:`_split`)."""
        data = local.reshape(-1).view(np.uint8)
        self._inside(rank, byte_offset, byte_offset + data.nbytes)
        for a, b, pooled in self._split(rank, byte_offset, byte_offset + data.nbytes):
            part = data[a - byte_offset:b - byte_offset]
            if pooled is not None:
                native.copy(*((part, pooled) if reading else (pooled, part)))
            elif reading:
                self.window.read(rank, self.address(rank) + a, part)
            else:
                self.window.write(rank, self.address(rank) + a, part)

    def fetch(self, rank: int, byte_offset: int, scratch: np.ndarray) -> np.ndarray:
        """``scratch.nbytes`` bytes at ``byte_offset`` of ``rank``'s buffer as
        ``scratch``'s dtype: a view of its pool where they all lie there
        (nothing copied), else read into ``scratch``."""
        self._inside(rank, byte_offset, byte_offset + scratch.nbytes)
        pooled = self.pooled(rank, byte_offset, byte_offset + scratch.nbytes)
        if pooled is not None:
            return pooled.view(scratch.dtype)
        self.read(rank, byte_offset, scratch)
        return scratch


def _whole(m: np.ndarray) -> bool:
    """Whether a published buffer lies wholly in its rank's shared pool."""
    return bool(int(m[0])) and int(m[4]) == 0 and int(m[5]) >= int(m[6])


def _direct(ctx, window, st: _WindowState, buf: np.ndarray, nbytes: int, collective: str) -> _Readers | None:
    """Publish ``buf`` and return readers of every rank's buffer, or None (every
    rank alike) when some rank's buffer cannot be reached directly. Only for
    ``nbytes`` (the same on every rank) from ``collective``'s :func:`direct_from` on."""
    cma = bool(getattr(window, "cma", False))
    if nbytes < _direct_from(collective, window, ctx.size) or not (cma or hasattr(window, "allocation")):
        return None
    metas = _publish(ctx, window, st, buf, collective)
    if all(_whole(m) for m in metas) or (cma and all(int(m[3]) for m in metas)):
        if hasattr(window, "map_in"):
            for r, m in enumerate(metas):
                if int(m[0]) and r != ctx.rank:
                    window.map_in(r, int(m[1]) + int(m[4]), int(m[5]) - int(m[4]))
        return _Readers(window, metas, ctx.rank)
    return None


def _allreduce_pieces(ctx, window, st: _WindowState, buf: np.ndarray, op: Op) -> None:
    """Pieces through the window: copy in the blocks others reduce, fence, reduce
    this rank's block from its own buffer and every region into its region,
    fence, copy every reduced block out."""
    p, me = ctx.size, ctx.rank
    step = _piece_elems(st.half, p, buf.itemsize)
    item = buf.itemsize
    peers = [r for r in range(p) if r != me]
    for parts, used in _striped(_blocks(buf.size, p), step):
        base = st.next_half(ctx.deadline)
        mine = st.regions[me]
        for r in peers:
            start, n, off = parts[r]
            if n:
                native.copy(mine[base + off * item:base + (off + n) * item].view(buf.dtype),
                          buf[start:start + n])
        window.fence(ctx.deadline)
        start_me, n_me, off_me = parts[me]
        if n_me:
            srcs = st.views(base + off_me * item, n_me * item, buf.dtype)
            _reduce(ctx, op, srcs[me], [buf[start_me:start_me + n_me]] + [srcs[r] for r in peers])
        window.fence(ctx.deadline)
        for r, (start, n, off) in enumerate(parts):
            if n:
                native.copy(buf[start:start + n],
                          st.regions[r][base + off * item:base + (off + n) * item].view(buf.dtype))


# ------------------------------------------------------------- reduce_scatter


def _one_piece(st: _WindowState, counts: list[int], step: int) -> list | None:
    """The parts of the only piece when ``counts`` fit one piece of ``step``, else None."""
    pieces = _striped_cached(st, counts, step)
    return pieces[0][0] if len(pieces) == 1 else None


def _prepare_reduce_scatter(transport, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list[int], op: Op):
    """One native call for the one-piece case through the window: copy in the
    blocks the others reduce, fence, reduce this rank's block into recvbuf."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    item, dtype = sendbuf.itemsize, sendbuf.dtype
    if p == 1 or sendbuf.nbytes >= _direct_from("reduce_scatter", window, p) or dtype in _LOW or not sum(counts):
        return None
    parts = _one_piece(st, counts, _piece_elems(st.half, p, item))
    if parts is None:
        return None
    peers = [r for r in range(p) if r != me]
    before = [(_arr(0, start * item), _slot(st, me, off * item), n * item)
              for r, (start, n, off) in enumerate(parts) if r != me and n]
    start, n, off = parts[me]
    reduction = _reduction(_arr(1), [_arr(0, start * item)] + [_slot(st, r, off * item) for r in peers],
                           n, dtype, op)
    return _planned(_plan(window, 2, before, [], reduction, peers) if reduction else None, _first_two)


@register("reduce_scatter", "shared_window", needs=("window",), prepare=_prepare_reduce_scatter,
          description="each rank reduces its block straight from every rank's window region")
def reduce_scatter(ctx, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: list[int], op: Op) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1:
        native.copy(recvbuf, sendbuf[:counts[0]])
        return
    if sum(counts) == 0:
        return
    key = ("reduce_scatter", sendbuf.dtype, sendbuf.size, tuple(counts), op.name)
    if _run_planned(ctx, _prepare_reduce_scatter, key, sendbuf, recvbuf, counts, op):
        return
    window, st = _state_of(ctx)
    readers = _direct(ctx, window, st, sendbuf, sendbuf.nbytes, "reduce_scatter")
    if readers is not None:
        _reduce_scatter_direct(ctx, window, readers, sendbuf, recvbuf, counts, op)
        return
    item = sendbuf.itemsize
    step = _piece_elems(st.half, p, item)
    displs = _displs(counts)
    peers = [r for r in range(p) if r != me]
    dt = sendbuf.dtype
    for parts, used in _striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        for r in peers:
            start, n, off = parts[r]
            if n:
                native.copy(st.views(base + off * item, n * item, dt)[me], sendbuf[start:start + n])
        window.fence(ctx.deadline)
        start, n, off = parts[me]
        if n:
            srcs = st.views(base + off * item, n * item, sendbuf.dtype)
            lo = start - displs[me]
            _reduce(ctx, op, recvbuf[lo:lo + n], [sendbuf[start:start + n]] + [srcs[r] for r in peers])


def _reduce_scatter_direct(ctx, window, readers: _Readers, sendbuf: np.ndarray, recvbuf: np.ndarray,
                           counts: list[int], op: Op) -> None:
    p, me, item = ctx.size, ctx.rank, sendbuf.itemsize
    lo = _displs(counts)[me]
    peers = [r for r in range(p) if r != me]
    step = max(1, (ctx.segment_bytes if p <= 4 else ctx.segment_bytes // 4) // item)
    scratch = [ctx.scratch(min(step, counts[me]), sendbuf.dtype, slot=8 + i) for i in range(p - 1)]
    for a in range(0, counts[me], step):
        b = min(a + step, counts[me])
        parts = [readers.fetch(r, (lo + a) * item, s[:b - a]) for r, s in zip(peers, scratch)]
        _reduce(ctx, op, recvbuf[a:b], [sendbuf[lo + a:lo + b]] + parts)
    window.fence(ctx.deadline)  # every rank has read the others' sendbuf


# ------------------------------------------------------------------ allgather


def _prepare_allgather(transport, buf: np.ndarray, counts: list[int]):
    """One native call for the one-piece case through the window: copy this
    rank's block in, fence, copy the others' out."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    item = buf.itemsize
    if p == 1 or buf.nbytes >= _direct_from("allgather", window, p) or not sum(counts):
        return None
    parts = _one_piece(st, counts, max(1, min(st.half, PIECE_BYTES) // (p * item)))
    if parts is None:
        return None
    start, n, off = parts[me]
    before = [(_arr(0, start * item), _slot(st, me, off * item), n * item)] if n else []
    after = [(_slot(st, r, off * item), _arr(0, start * item), n * item)
             for r, (start, n, off) in enumerate(parts) if r != me and n]
    sources = [r for r, (_, n, _) in enumerate(parts) if r != me and n]
    return _planned(_plan(window, 1, before, after, None, sources), _first)


@register("allgather", "shared_window", needs=("window",), prepare=_prepare_allgather,
          description="each rank copies its block into the window once; everyone copies all out")
def allgather(ctx, buf: np.ndarray, counts: list[int]) -> None:
    p, me = ctx.size, ctx.rank
    if p == 1 or sum(counts) == 0:
        return
    if _run_planned(ctx, _prepare_allgather, ("allgather", buf.dtype, buf.size, tuple(counts)), buf, counts):
        return
    window, st = _state_of(ctx)
    item = buf.itemsize
    readers = _direct(ctx, window, st, buf, buf.nbytes, "allgather")
    if readers is not None:
        displs = _displs(counts)
        for r in range(p):
            if r != me:
                readers.read(r, displs[r] * item, buf[displs[r]:displs[r] + counts[r]])
        window.fence(ctx.deadline)  # nobody touches its buffer while others still read it
        return
    step = max(1, min(st.half, PIECE_BYTES) // (p * item))
    dt = buf.dtype
    for parts, used in _striped_cached(st, counts, step):
        base = st.next_half(ctx.deadline)
        start, n, off = parts[me]
        if n:
            native.copy(st.views(base + off * item, n * item, dt)[me], buf[start:start + n])
        window.fence(ctx.deadline)
        for r, (start, n, off) in enumerate(parts):
            if n and r != me:
                native.copy(buf[start:start + n], st.views(base + off * item, n * item, dt)[r])


# ---------------------------------------------------------------------- bcast


def _prepare_bcast(transport, buf: np.ndarray, root: int):
    """One native call for the one-piece case through the window: the root
    copies in, fence, the others copy out."""
    p, me = transport.size, transport.rank
    window, st = _window_state(transport.window, p)
    n = buf.nbytes
    if p == 1 or n == 0 or n >= _direct_from("bcast", window, p) or n > min(st.half, PIECE_BYTES):
        return None
    here = (_arr(0), _slot(st, root), n)
    there = (_slot(st, root), _arr(0), n)
    if me == root:
        return _planned(_plan(window, 1, [here], [], None, []), _first)
    return _planned(_plan(window, 1, [], [there], None, [root]), _first)


@register("bcast", "shared_window", needs=("window",), prepare=_prepare_bcast,
          description="the root copies into its window region; the others copy out")
def bcast(ctx, buf: np.ndarray, root: int) -> None:
    if ctx.size == 1 or buf.size == 0:
        return
    if _run_planned(ctx, _prepare_bcast, ("bcast", buf.dtype, buf.size, root), buf, root):
        return
    window, st = _state_of(ctx)
    readers = _direct(ctx, window, st, buf, buf.nbytes, "bcast")
    if readers is not None:
        if ctx.rank != root:
            readers.read(root, 0, buf)
        window.fence(ctx.deadline)  # the root keeps its buffer until everyone has it
        return
    data = _as_bytes(buf)
    step = max(_ALIGN, min(st.half, PIECE_BYTES))
    u8 = data.dtype
    for a in range(0, data.size, step):
        b = min(a + step, data.size)
        src = st.views(st.next_half(ctx.deadline), b - a, u8)[root]
        if ctx.rank == root:
            native.copy(src, data[a:b])
        window.fence(ctx.deadline)
        if ctx.rank != root:
            native.copy(data[a:b], src)
