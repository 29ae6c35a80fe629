"""The direct-access protocol: ranks copy straight between each other's buffers.

From a size per collective on (:func:`~.tuning.direct_from`), where every
rank's buffer can be reached (it lies in the shared pool, feature
``"pool"``, or the window reads and writes private memory, feature
``"direct_access"``), each rank publishes where its buffer is
(:class:`Published`, in its region's metadata block) and fences once; then
each copies straight from and into the peers' buffers (:class:`Readers`),
and a closing fence (the algorithm's) keeps every buffer unchanged while
another rank still uses it. Whether the path is taken is decided from the
published descriptions, so every rank decides alike.
"""

from __future__ import annotations

from time import monotonic as _now
from typing import NamedTuple

import numpy as np

from ... import compiled
from ...errors import MismatchedCollective
from ...tracing import COPYING
from ...window_contract import DIRECT_ACCESS, HUGE_PAGES, POOL
from .state import WindowState
from .tuning import direct_from, wants_huge_pages

__all__ = ["Published", "Readers", "direct", "publish", "window_direct_from", "SCRATCH_PEER_FIRST"]

#: Bytes per rank and half of the metadata block that :func:`publish` writes.
PUBLISHED_BYTES = 64
#: The call's scratch slots (``ctx.scratch(..., slot=)``) of the direct
#: paths: this one for the first peer, the next for the next peer, ...
SCRATCH_PEER_FIRST = 8


class Published(NamedTuple):
    """Where one rank's buffer is, as it publishes it (int64 words, in this order)."""

    in_pool: int      # 1 when some part of the buffer lies in its rank's shared pool
    pool_offset: int  # the pool offset of the buffer's byte 0 (which may itself lie outside)
    address: int      # the buffer's address in its rank's own address space
    reachable: int    # 1 when the collective may read and write it through direct access
    pool_first: int   # the first byte of the buffer that lies in the pool
    pool_end: int     # the end byte of the part that lies in the pool
    nbytes: int       # the buffer's size
    copies: int       # 1 when its rank copies an out-of-place call's values in after publishing

    def write(self, words: np.ndarray) -> None:
        """Store into int64 ``words`` (a rank's metadata block)."""
        words[:len(self)] = self

    @classmethod
    def read(cls, words: np.ndarray) -> "Published":
        """Load from int64 ``words``."""
        return cls._make(words[:len(cls._fields)].tolist())

    def whole(self) -> bool:
        """Whether the buffer lies wholly in its rank's shared pool."""
        return bool(self.in_pool) and self.pool_first == 0 and self.pool_end >= self.nbytes


def window_direct_from(collective: str, window, p: int) -> int:
    """:func:`~.tuning.direct_from` on the cores the window's ranks share."""
    return direct_from(collective, p, window.cores)


def _shared_part(window, buf: np.ndarray) -> tuple[int, int, int] | None:
    """(pool offset of ``buf``'s byte 0, first, end byte of the part in this
    rank's shared pool), or None; the window may move a buffer used again
    into its pool now (feature ``"adoption"``)."""
    if POOL not in window.features:
        return None
    return window.shared_part(buf, adopt=True)


def _published_words(st: WindowState) -> list[list[np.ndarray]]:
    """Per half of the metadata block, every rank's int64 words there (made
    once per window)."""
    words = st.cache.get(_published_words)
    if words is None:
        words = st.remember(_published_words, [
            [reg[h * PUBLISHED_BYTES:(h + 1) * PUBLISHED_BYTES].view(np.int64) for reg in st.regions]
            for h in (0, 1)])
    return words


def publish(ctx, window, st: WindowState, buf: np.ndarray, collective: str,
            copy_in: tuple[np.ndarray, np.ndarray] | None = None) -> list[Published]:
    """Tell every rank where ``buf`` is and learn the same of every rank; one
    fence (the call's arrival, where every rank's signature is checked).
    ``reachable``: ``collective`` may read and write the buffer through
    direct access (see :func:`~.tuning.wants_huge_pages`). An out-of-place
    call's ``copy_in`` (``(place, source)``, ``place`` in ``buf``) is
    made after that fence, and where any rank makes one, every rank
    fences once more before any reads ``buf``."""
    words = _published_words(st)[(window.step(ctx.deadline) - 1) & 1]
    part = _shared_part(window, buf)
    offset, first, end = part if part is not None else (0, 0, 0)
    reachable = (part is not None or not wants_huge_pages(collective)
                 or HUGE_PAGES not in window.features or window.huge_pages(buf))
    Published(int(part is not None), offset, buf.ctypes.data, int(reachable), first, end,
              buf.nbytes, int(copy_in is not None)).write(words[ctx.rank])
    window.fence(ctx.deadline)
    metas = [Published.read(w) for w in words]
    if copy_in is not None:
        compiled.copy(*copy_in)
    if any(m.copies for m in metas):
        window.fence(ctx.deadline)
    return metas


def direct(ctx, window, st: WindowState, buf: np.ndarray, nbytes: int, collective: str,
           copy_in: tuple[np.ndarray, np.ndarray] | None = None) -> "Readers | None":
    """Publish ``buf`` and return readers of every rank's buffer, or None (every
    rank alike) when some rank's buffer cannot be reached directly. Only for
    ``nbytes`` (the same on every rank) from ``collective``'s
    :func:`window_direct_from` on. ``copy_in``: see :func:`publish`; it is
    made wherever this publishes (whatever it returns), else not."""
    features = window.features
    cma = DIRECT_ACCESS in features
    if nbytes < window_direct_from(collective, window, ctx.size) or not (cma or POOL in features):
        return None
    metas = publish(ctx, window, st, buf, collective, copy_in)
    if all(m.whole() for m in metas) or (cma and all(m.reachable for m in metas)):
        for r, m in enumerate(metas):
            if m.in_pool and r != ctx.rank:
                window.map_in(r, m.pool_offset + m.pool_first, m.pool_end - m.pool_first)
        return Readers(window, metas, ctx.rank, ctx.tracer)
    return None


class Readers:
    """Every rank's published buffer (:func:`publish`), read and written
    straight in the shared pool where it lies there, else through direct
    access; never outside the buffer as its rank published it. With the
    call's ``tracer`` (tracing only), each read and write is a timeline's
    ``copying`` phase."""

    def __init__(self, window, metas: list[Published], rank: int, tracer=None) -> None:
        self.window = window
        self.window_rank = rank
        self.metas = metas
        self.pools = window.allocation if POOL in window.features else None
        self.tracer = tracer

    def address(self, rank: int) -> int:
        """Where ``rank``'s buffer is in its own address space."""
        return self.metas[rank].address

    def pool_bounds(self, itemsize: int) -> tuple[int, ...]:
        """Element indices where some rank's buffer enters or leaves its pool
        (pieces cut there are either wholly in a rank's pool or wholly out)."""
        return tuple(sorted({-(-m.pool_first // itemsize) for m in self.metas if m.in_pool}
                            | {m.pool_end // itemsize for m in self.metas if m.in_pool}))

    def pooled(self, rank: int, start: int, stop: int) -> np.ndarray | None:
        """Bytes [start, stop) of ``rank``'s buffer in its pool, if they all lie there."""
        m = self.metas[rank]
        if not m.in_pool or self.pools is None or start < m.pool_first or stop > m.pool_end:
            return None
        return self.pools(rank)[m.pool_offset + start:m.pool_offset + stop]

    def _split(self, rank: int, start: int, stop: int):
        """[start, stop) as (start, stop, pool bytes or None): the part in
        ``rank``'s pool and the parts before and after it."""
        m = self.metas[rank]
        lo, hi = (m.pool_first, m.pool_end) if m.in_pool and self.pools is not None else (stop, stop)
        cuts = sorted({start, stop, min(max(lo, start), stop), min(max(hi, start), stop)})
        for a, b in zip(cuts, cuts[1:]):
            yield a, b, self.pooled(rank, a, b)

    def read(self, rank: int, byte_offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``byte_offset`` of ``rank``'s buffer into ``out``."""
        if self.tracer is None:
            self._move(rank, byte_offset, out, True)
        else:
            self._timed(rank, byte_offset, out, True)

    def write(self, rank: int, byte_offset: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``byte_offset`` of ``rank``'s buffer, unless a peer
        aborted the call (see :meth:`~collectives.window_contract.SharedWindow.check_aborted`)."""
        self.window.check_aborted()
        if self.tracer is None:
            self._move(rank, byte_offset, src, False)
        else:
            self._timed(rank, byte_offset, src, False)

    def _timed(self, rank: int, byte_offset: int, local: np.ndarray, reading: bool) -> None:
        """:meth:`_move`, timed as the call's ``copying`` phase (tracing only)."""
        t0 = _now()
        try:
            self._move(rank, byte_offset, local, reading)
        finally:
            self.tracer.phase(COPYING, t0, _now())

    def inside(self, rank: int, start: int, stop: int) -> None:
        """Refuse to touch bytes [start, stop) of ``rank``'s buffer unless they
        lie inside it, as ``rank`` published it (never outside a buffer, even
        if a disagreement slipped past the signatures).

        Raises:
            MismatchedCollective: they do not.
        """
        if start < 0 or stop > self.metas[rank].nbytes:
            raise MismatchedCollective(
                f"rank {self.window_rank}: would touch bytes [{start}, {stop}) of rank {rank}'s buffer, "
                f"which holds {self.metas[rank].nbytes} bytes (ranks disagree about the call)")

    def _move(self, rank: int, byte_offset: int, local: np.ndarray, reading: bool) -> None:
        """:meth:`read` into ``local`` or :meth:`write` it, part by part (:meth:`_split`)."""
        data = local.reshape(-1).view(np.uint8)
        self.inside(rank, byte_offset, byte_offset + data.nbytes)
        for a, b, pooled in self._split(rank, byte_offset, byte_offset + data.nbytes):
            part = data[a - byte_offset:b - byte_offset]
            if pooled is not None:
                compiled.copy(*((part, pooled) if reading else (pooled, part)))
            elif reading:
                self.window.read(rank, self.address(rank) + a, part)
            else:
                self.window.write(rank, self.address(rank) + a, part)

    def fetch(self, rank: int, byte_offset: int, scratch: np.ndarray) -> np.ndarray:
        """``scratch.nbytes`` bytes at ``byte_offset`` of ``rank``'s buffer as
        ``scratch``'s dtype: a view of its pool where they all lie there
        (nothing copied), else read into ``scratch``."""
        self.inside(rank, byte_offset, byte_offset + scratch.nbytes)
        pooled = self.pooled(rank, byte_offset, byte_offset + scratch.nbytes)
        if pooled is not None:
            return pooled.view(scratch.dtype)
        self.read(rank, byte_offset, scratch)
        return scratch
