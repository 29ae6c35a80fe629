"""Describing a collective's one-step case as a compiled call, and the
prepared calls of repeated calls.

A window with the feature ``"compiled_calls"`` runs a collective's small case
as data (:meth:`~collectives.window_contract.SharedWindow.compile`): copies
before the post, copies and one reduction after every rank posted. The
helpers here name the places those copies use: :func:`arr` in the call's
arrays, :func:`slot` in a rank's region (at the same offset in both halves),
:func:`other_half` there in the half a second step does not use.
Every rank runs a case alike, compiled or not (a compiled call and a
fence do not wait for each other), so a window's compiled calls are on for every
rank or for none.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ... import compiled
from ...ops import Op
from ...window_contract import ADOPTION, COMPILED_CALLS, DIRECT_ACCESS, HUGE_PAGES, POOL
from .state import DATA_OFFSET, WindowState, state_of
from .tuning import (DIRECT_FROM, PIECE, PIECED_FROM, POOL_FIRST_BYTES, POOLED_ACROSS, POOLED_CALLS,
                     compiled_direct, compiled_piece, direct_from, direct_where_huge)

__all__ = [
    "arr", "slot", "peer", "other_half", "compile_call", "compile_direct", "compile_reduction", "direct_mode",
    "DIRECT", "FALLBACK", "POOLED", "on_window", "pool_path", "reduction", "first", "first_two", "no_arrays",
    "prepared_from", "run_prepared", "with_view",
]


def arr(index: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in the call's array ``index``."""
    return (index, byte_offset, 0)


def slot(st: WindowState, rank: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in ``rank``'s window region at ``byte_offset`` of the half in use."""
    base = st.regions[rank].ctypes.data + DATA_OFFSET + byte_offset
    return (-1, base, base + st.half)


def peer(rank: int, index: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in ``rank``'s array ``index`` as it published it (a direct call's source)."""
    return (-2 - index, rank, byte_offset)


def other_half(st: WindowState, rank: int, byte_offset: int = 0) -> tuple[int, int, int]:
    """A place in ``rank``'s region at ``byte_offset`` of the half not in use
    (in a call's second step: where its first step wrote)."""
    base = st.regions[rank].ctypes.data + DATA_OFFSET + byte_offset
    return (-1, base + st.half, base)


def compile_call(window, narrays: int, before: list, after: list, reduce: tuple | None, sources: list[int],
                 pieced_from: int = PIECED_FROM, piece: int = PIECE, then: tuple | None = None):
    """``(run, settle)`` of the window's compiled call, or None where it has none:
    ``run(arrays, seq, sig)`` takes the next step of call ``seq`` (signature
    ``sig``) as the algorithm would, and returns None, or what to wait for
    (or why it stopped): then ``settle(arrays, late, deadline)``.
    ``sources``: the ranks whose regions ``after`` and ``reduce`` read;
    ``pieced_from`` and ``piece``: when it runs in pieces (see
    :func:`~.tuning.compiled_piece`); ``then``: a second step's copies
    ``(before, after)`` (such a call runs whole)."""
    if COMPILED_CALLS not in window.features:
        return None
    through = [n for src, dst, n in before if dst[0] < 0] + [n for src, dst, n in after if src[0] < 0]
    if reduce is not None:
        through.append(reduce[2] * compiled.kernel_itemsize(reduce[3]))
    if then is not None:
        made = window.compile(narrays, before, after, reduce, sources, 0, then)
    else:
        size = compiled_piece(max(through, default=0), window.size, window.cores, pieced_from, piece)
        made = window.compile(narrays, before, after, reduce, sources, size)
    settle = window.settle
    return made.run, lambda arrays, late, deadline: settle(made, arrays, late, deadline)


def compile_direct(window, narrays: int, before: list, after: list, readers: list[int], shared: list[int],
                   mode: str = "direct", through: tuple | None = None):
    """``(run, settle)`` of a direct compiled call (see
    :meth:`~collectives.window_contract.SharedWindow.compile`): each rank
    publishes its arrays ``shared``; ``after`` reads peers' arrays
    (:func:`peer`) once every record agrees; the run ends once the ranks
    ``readers`` are done reading this rank's. ``mode`` (see
    :func:`direct_mode`): :data:`DIRECT` reads every peer's straight;
    :data:`FALLBACK` too where they lie in huge pages, and takes the rest
    through the window as the window call ``through`` (``(before,
    after)``) would: a rank whose arrays lie elsewhere makes that call's
    copies into its region instead, and every copy of ``after`` that reads
    a peer names its place in the window fourth (:func:`on_window`);
    :data:`POOLED` reads a peer's array out of its shared pool where it
    lies there, and the rest as a fallback would (with ``through``) or
    straight (without). None where the window has no compiled calls or
    cannot reach peers' memory (the same on every rank)."""
    if not {COMPILED_CALLS, DIRECT_ACCESS} <= window.features:
        return None
    copies_in = [c for c in through[0] if c[1][0] < 0] if on_window(mode, through) else None  # into the window
    if mode == POOLED:
        described = (readers, shared, copies_in, POOL_FIRST_BYTES)
    elif copies_in is not None:
        described = (readers, shared, copies_in)
    else:
        described = (readers, shared)
    made = window.compile(narrays, before, after, None, [], direct=described)
    settle = window.settle
    return made.run, lambda arrays, late, deadline: settle(made, arrays, late, deadline)


def compile_reduction(window, narrays: int, writes: list, reduce: tuple, peers: list[int], shared: list[int],
                      copies_in: list | None, ralts: list, copies_out: list, piece: int, huge_from: int = 0,
                      one: bool = False):
    """``(run, settle)`` of a direct compiled call that reduces (see
    :meth:`~collectives.window_contract.SharedWindow.compile`): each rank
    reduces its block ``reduce`` straight from its peers' published arrays
    (out of their pools in place where they lie there, across where they
    lie in huge pages, else from the copies ``copies_in`` each such peer
    makes into its region, ``ralts``), ``piece`` bytes at a time, and
    ``writes`` the result into theirs (``after`` copies, each naming that
    peer's region as its fallback: a peer taking its array through the
    window copies its blocks out, ``copies_out``; without ``copies_in``,
    no fallback: such arrays are read across). None where the window
    has no compiled calls or cannot reach peers' memory (the same on every
    rank). An array of fewer than ``huge_from`` bytes goes through the window
    even where it lies in huge pages. With ``one``, every piece is reduced
    into the first piece of the reduction's destination (a place in the
    window that holds one piece) and written from there."""
    if not {COMPILED_CALLS, DIRECT_ACCESS} <= window.features:
        return None
    pool_first = 0 if POOL in window.features else None  # a pooled block is reduced in place, never read
    made = window.compile(narrays, [], writes, reduce, [],
                          direct=(peers, shared, copies_in, pool_first, (ralts, copies_out, piece, huge_from, one)))
    settle = window.settle
    return made.run, lambda arrays, late, deadline: settle(made, arrays, late, deadline)


def on_window(mode: str | None, through: tuple | None) -> bool:
    """Whether a direct call of ``mode`` takes what it does not read from a
    peer's array through the window, as the window call ``through`` would
    (see :func:`compile_direct`)."""
    return mode in (FALLBACK, POOLED) and through is not None


#: :func:`direct_mode`'s answers.
DIRECT, FALLBACK, POOLED = "direct", "fallback", "pooled"


def direct_mode(window, collective: str, nbytes: int, through: tuple | None) -> str | None:
    """How ``collective`` of ``nbytes`` takes its direct compiled call, the
    same on every rank: :data:`DIRECT` (:func:`~.tuning.compiled_direct`);
    below :data:`~.tuning.DIRECT_FROM`, :data:`FALLBACK` where it reads
    only arrays in huge pages and takes the rest through the window as its
    window call would (its copies ``through``, ``(before, after)``, which
    must exist; :func:`~.tuning.direct_where_huge`); from ``DIRECT_FROM``
    on, in the pool's direct path's span (:func:`pool_path`,
    :data:`~.tuning.POOLED_CALLS`), :data:`POOLED`, which reads what that
    path reads directly: arrays in huge pages or in their rank's pool, and
    the rest through the window where a fallback would serve below; the
    collectives that read any buffer there (``DIRECT_FROM``'s huge false)
    read the rest straight. Those of :data:`~.tuning.POOLED_ACROSS` take
    it in their whole span, on any cores: the rest through the window
    where their fallback ``through`` is given, else straight. None
    otherwise. A fallback's copies are whole where the
    table runs the window call in pieces (1 MiB copies and more where ranks
    have a core each): 2 ranks, 2 MiB, the same time for allgather,
    alltoall, gather and scatter (bcast, whose pieces halve it, has no span
    with a fallback: ``test_compiled_direct.py``).

    Below ``DIRECT_FROM`` no call reads a peer's pool: where a rank writes
    its buffer again before the next call (as a training step does), a
    read of it straight leaves its lines in the reader's cache and makes
    that write slower, on this host by more than the window's second copy
    costs (2 ranks, 4 KiB pages, 1 MiB, ``collectives bench --rewrite``:
    alltoall 53-59 us through the window against 102-113 read from the
    pool; docs/shared-memory.md, "Reads out of the pool")."""
    p, cores, cma_from = window.size, window.cores, window.cma_from
    if compiled_direct(collective, nbytes, p, cores, cma_from):
        return DIRECT
    hybrid = through is not None and HUGE_PAGES in window.features and direct_where_huge(collective, nbytes, p,
                                                                                          cores, cma_from)
    if not pool_path(window, collective, nbytes):
        return FALLBACK if hybrid else None
    if collective not in POOLED_CALLS or not {POOL, ADOPTION} <= window.features:
        return None
    return POOLED if hybrid or collective in POOLED_ACROSS or not DIRECT_FROM[collective][2] else None


def pool_path(window, collective: str, nbytes: int) -> bool:
    """Whether ``collective`` of ``nbytes`` leaves a window call to the pool's
    direct path (:mod:`.direct`, the algorithm's body): from
    :data:`~.tuning.DIRECT_FROM` on, unless a :data:`POOLED` call takes
    it over (:func:`direct_mode`)."""
    return nbytes >= direct_from(collective, window.size, window.cores)


def reduction(dst: tuple, srcs: list, count: int, dtype: np.dtype, op: Op) -> tuple | None:
    """The compiled call's reduction ``dst = srcs[0] op srcs[1] ...``, or None without a compiled kernel."""
    codes = compiled.kernel_codes(dtype, op.name, op.ufunc)
    return None if codes is None else (dst, srcs, count) + codes


def first(buf, *rest) -> tuple:
    """The compiled call's arrays of a call whose first argument is its only array."""
    return (buf,)


def first_two(a, b, *rest) -> tuple:
    """The compiled call's arrays of a call whose first two arguments are its arrays."""
    return (a, b)


def no_arrays(*args) -> tuple:
    """The compiled call's arrays of a call without arrays."""
    return ()


def prepared_from(made: tuple | None, arrays_of: Callable):
    """The prepared call (see :class:`~collectives.registry.Algorithm`) of
    a compiled call ``made`` (or None): a function with the algorithm's
    signature, whose ``arrays_of(*args)`` are the compiled call's arrays;
    ``on_arrays`` is ``made``."""
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


def with_view(made: tuple, lo: int, hi: int, itemsize: int) -> tuple:
    """A direct compiled call ``made`` on ``(buf, buf[lo:hi])`` made a call
    on ``(buf,)`` alone: the compiled call takes its second array as that
    part of its first (``set_view``), in C, on every run (an in-place call
    whose direct call publishes its block as a second array)."""
    made[0].__self__.set_view(lo * itemsize, (hi - lo) * itemsize)
    return made


_MISSING = object()


def run_prepared(ctx, prepare: Callable, key: tuple, *args) -> bool:
    """Run this call's case as its prepared call, made by ``prepare`` once
    per ``key`` (the call's signature), if it has one; True when it ran.
    Every rank runs a case alike, compiled or not: a compiled call
    and a fence do not wait for each other."""
    _, st = state_of(ctx)
    run = st.cache.get(key, _MISSING)
    if run is _MISSING:
        run = st.remember(key, prepare(ctx.transport, *args))
    if run is None:
        return False
    run(ctx, *args)
    return True
