"""The shared window of the shared-memory transport (:class:`ShmWindow`).

Implements :class:`~collectives.window_contract.SharedWindow` over every
rank's segment: the regions are the segments' window parts, the pools their
pool parts; the synchronisation uses per-rank counters in the control pages
(``Q_EPOCH`` for fences, ``Q_POST`` for posts, ``Q_DONE`` for the steps a
compiled call is done with), each written only by its owner, and the call
records beside ``Q_POST`` (:mod:`.records`). With the C extension
(every rank must have it, or none uses it), fences, steps, arrivals and
plans run in C with a bounded spin or yield, and the rest of a wait (the
block, timeouts, lost peers) here.

The window keeps a reference to its transport and uses, of it: ``rank``,
``size``, ``cores``, ``cma``, ``cma_from``, ``_layout``, ``_segs``, ``_records``,
``_pool``, ``_pool_block``, ``_spin``, ``_sleep_words``,
``_counter_words``, ``_inbox_word``, ``_wake``, ``_wake_all``,
``_wait_counter``, ``_aborted_in`` and ``_aborted_error``.
"""

from __future__ import annotations

import logging
import sys
import time

from typing import Any

import numpy as np

from collectives import compiled, tracing
from collectives.errors import BadArgument, MismatchedCollective
from collectives.signature import checks_enabled as signature_checks
from collectives.window_contract import (ADOPTION, DIRECT_ACCESS, HUGE_PAGES, COMPILED_CALLS, POOL, SharedWindow,
                                         CompiledCall)

from .cma import CrossMemory
from .layout import Q_DONE, Q_EPOCH, Q_COMPILED, Q_INBOX, Q_PID, Q_POST, Q_SLEEP
from .pages import Adoptions, huge_pages, populate
from .waking import compiled_wait_ns

log = logging.getLogger("collectives.shm")

__all__ = ["ShmWindow"]


class ShmWindow(SharedWindow):
    """The shared window of a :class:`~.transport.SharedMemoryTransport`.

    ``region(r)`` is rank r's window region (``capacity`` bytes);
    ``allocation(r)`` is rank r's shared allocation pool, in which
    :meth:`locate` finds arrays from :meth:`~.transport.SharedMemoryTransport.alloc`.
    Features: ``"pool"`` and ``"huge_pages"`` always; ``"compiled_calls"``
    where every rank runs the C extension; ``"direct_access"`` where
    every rank may reach every other's private memory (cross-memory
    attach); ``"adoption"`` unless ``shm_adopt=0``.
    """

    def __init__(self, transport, adopt: bool = True) -> None:
        t = self._t = transport
        lay = t._layout
        self.capacity = lay.window
        self.cores = t.cores  # shared by the ranks (algorithms scale thresholds with ranks per core)
        self.cma_from = t.cma_from  # bytes from which one cross-memory read beats two copies (see .copy_race)
        self.size = t.size
        self._regions = [np.frombuffer(s.mm, np.uint8, lay.window, lay.window_off) for s in t._segs]
        self._pools = [np.frombuffer(s.mm, np.uint8, lay.pool, lay.pool_off) for s in t._segs]
        self._pool_base = self._pools[t.rank].ctypes.data
        self._adoptions = (Adoptions(self._pools[t.rank], t._pool_block, t._pool.give, t._segs[t.rank].fd)
                           if adopt else None)
        self._mapped_in: set[tuple[int, int, int]] = set()
        self._epoch = 0
        self._peer_q = [s.q for s in t._segs]
        self._peers = [r for r in range(t.size) if r != t.rank]
        self._cross = CrossMemory(t.rank, [int(s.q[Q_PID]) for s in t._segs])
        self._turn = 0
        self._armed: int | None = None  # a call whose first synchronisation is still to come
        self._armed_turn = 0
        self._records = t._records
        self._compiled = None
        self.kept: dict = {}
        ext = compiled.enabled()
        if ext is not None and all(s.q[Q_COMPILED] == 1 for s in t._segs):
            # the same fence in C, with a bounded spin or yield; and plans
            self._compiled = ext.Window(*t._counter_words, t._sleep_words, t.rank, *compiled_wait_ns(t._spin),
                                      t._inbox_word, signature_checks())
        self.features = frozenset({POOL, HUGE_PAGES} | ({COMPILED_CALLS} if self._compiled is not None else set())
                                  | ({DIRECT_ACCESS} if t.cma else set()) | ({ADOPTION} if adopt else set()))

    # ----------------------------------------------------------- direct access

    def huge_pages(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in huge pages, for :meth:`read` and :meth:`write`
        from other ranks to run at full speed (see :func:`~.pages.huge_pages`;
        True where the kernel cannot tell)."""
        return huge_pages(buf.__array_interface__["data"][0], buf.nbytes) is not False

    def read(self, rank: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in ``rank``'s private memory into ``out``.

        Raises:
            PeerLost: the read failed (the peer exited, or its memory is gone).
        """
        self._cross.read(rank, address, out)

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``address`` in ``rank``'s private memory.

        Raises:
            PeerLost: the write failed (the peer exited, or its memory is gone).
        """
        self._cross.write(rank, address, src)

    # -------------------------------------------------------- regions and pools

    @property
    def epoch(self) -> int:
        """Number of fences this rank has passed (the same on every rank between calls)."""
        return self._compiled.epoch if self._compiled is not None else self._epoch

    def region(self, rank: int) -> np.ndarray:
        """A uint8 array over ``rank``'s window region."""
        return self._regions[rank]

    def allocation(self, rank: int) -> np.ndarray:
        """A uint8 array over ``rank``'s shared allocation pool."""
        return self._pools[rank]

    def locate(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(this rank, offset in its pool) if ``arr`` lives in its pool, else None."""
        addr = arr.__array_interface__["data"][0]
        off = addr - self._pool_base
        if 0 <= off and off + arr.nbytes <= self._t._layout.pool:
            return self._t.rank, off
        return None

    def shared_part(self, arr: np.ndarray, adopt: bool = False) -> tuple[int, int, int] | None:
        """Where ``arr``'s bytes are in this rank's pool: (offset of its byte 0,
        first byte, end byte of the part that lies in the pool), or None.
        Arrays from :meth:`~.transport.SharedMemoryTransport.alloc` lie there
        whole; with ``adopt``, a private buffer seen again is moved there in
        place, all but its first and last partial pages (see :class:`~.pages.Adoptions`)."""
        where = self.locate(arr)
        if where is not None:
            return where[1], 0, arr.nbytes
        if self._adoptions is None or not self._peer_q:
            return None
        return self._adoptions.find(arr.__array_interface__["data"][0], arr.nbytes, adopt)

    def _adopted_part(self, address: int, nbytes: int) -> tuple[int, int, int] | None:
        """A direct compiled call's question (see ``collectives._compiled``):
        :meth:`shared_part` of the private ``nbytes`` at ``address``, which
        the pool may adopt now. A lookup that fails answers None: the call
        then moves the buffer across (the pool only saves a copy; a buffer
        half adopted keeps its bytes either way)."""
        if self._adoptions is None or not self._peer_q:
            return None
        try:
            return self._adoptions.find(address, nbytes, True)
        except Exception as exc:  # the call goes on without the pool
            log.debug("rank %d: the pool's lookup of %d bytes at %#x failed (%s: %s); moved across",
                      self._t.rank, nbytes, address, type(exc).__name__, exc)
            return None

    def check_aborted(self) -> None:
        """Raise the error of a peer that aborted without completing this
        rank's call in progress (its latest record), if one did; one word
        read (this rank's abort inbox) while none aborted."""
        if not self._t._segs[self._t.rank].q[Q_INBOX]:
            return
        now = self._records.current()
        aborted = self._t._aborted_in(now[0] if now is not None else None)
        if aborted is not None:
            raise self._t._aborted_error(aborted)

    def map_in(self, rank: int, offset: int, nbytes: int) -> None:
        """Map the bytes [offset, offset + nbytes) of ``rank``'s pool into this
        process now, in one call, the first time (a buffer a peer adopted or
        allocated there), rather than a page fault per page in the collective."""
        key = (rank, offset, nbytes)
        if key not in self._mapped_in and 0 <= offset and offset + nbytes <= len(self._pools[rank]):
            if len(self._mapped_in) > 4096:
                self._mapped_in.clear()
            self._mapped_in.add(key)
            populate(self._pools[rank].ctypes.data + offset, nbytes)

    # ----------------------------------------------------------- synchronisation

    def arm(self, seq: int) -> None:
        """Call ``seq`` started (its record is written): its first :meth:`fence`
        is its arrival (:meth:`arrive`)."""
        self._armed, self._armed_turn = seq, self.turn

    @property
    def turn(self) -> int:
        """Steps taken through the halves."""
        return self._compiled.turn if self._compiled is not None else self._turn

    def arrive(self, seq: int, deadline: float) -> None:
        """The first synchronisation of call ``seq``: post this step (taking one
        first if the call has not), wait until every rank posted it, and check
        every rank's signature record before anything of a peer is read.

        Raises:
            MismatchedCollective: the records disagree (every rank raises alike).
            BadArgument: a rank refused the call.
            PeerLost, CollectiveTimeout, or a peer's abort.
        """
        self._armed = None
        if self.turn == self._armed_turn:
            self.step(deadline)
        if self._compiled is not None:
            while True:
                late = self._compiled.arrive(seq)
                if late is None:
                    return
                self._wait_for(late, deadline, seq)
        k = self._turn
        own = self._peer_q[self._t.rank]
        own[Q_POST] = k
        self._t._wake_all()
        for r in self._peers:
            if self._peer_q[r][Q_POST] < k:
                self._t._wait_counter(self._peer_q[r], Q_POST, k, r, deadline, "shared window")
        if self._records.verify(seq) >= 0:
            raise self._records.verdict(seq)
        aborted = self._t._aborted_in(seq)
        if aborted is not None:
            raise self._t._aborted_error(aborted)

    def fence(self, deadline: float) -> None:
        """Barrier: every rank's writes before its fence are visible after it
        (the first fence of a call is its arrival: :meth:`arrive`)."""
        tracer = tracing.active()
        if tracer is None:
            self._fence(deadline)
            return
        t0 = time.monotonic()  # a timeline's "waiting" phase
        try:
            self._fence(deadline)
        finally:
            tracer.phase("waiting", t0, time.monotonic())

    def _fence(self, deadline: float) -> None:
        qs = self._peer_q
        if not qs:
            raise BadArgument("the shared-memory transport is closed")
        if self._armed is not None:
            self.arrive(self._armed, deadline)
            return
        if self._compiled is not None:
            if not self._compiled.fence():
                e = self._compiled.epoch
                for r in self._peers:
                    self._wait_for((r, compiled.ext.K_EPOCH, e), deadline)
            return
        e = self._epoch = self._epoch + 1
        qs[self._t.rank][Q_EPOCH] = e
        late = None
        for r in self._peers:  # a peer already at this fence may sleep, waiting for this rank
            q = qs[r]
            if q[Q_EPOCH] < e:
                late = [r] if late is None else late + [r]
            elif q[Q_SLEEP]:
                self._t._wake(r)
        if late:
            for r in late:
                if qs[r][Q_EPOCH] < e:
                    self._t._wait_counter(qs[r], Q_EPOCH, e, r, deadline, "window fence")

    _KINDS = (Q_EPOCH, Q_POST, Q_DONE)

    def _wait_for(self, late: tuple[int, int, int], deadline: float, seq: int | None = None) -> None:
        """Block until rank's counter of kind (epoch, post, done) reaches value:
        the rest of a compiled wait whose bounded spin ran out; raise when the
        compiled code stopped for good (kind K_VERDICT or K_ABORTED)."""
        rank, kind, value = late
        if kind < 0:
            self._stopped(rank, kind, seq, value)
        q = self._peer_q[rank]
        if q[self._KINDS[kind]] < value:
            self._t._wait_counter(q, self._KINDS[kind], value, rank, deadline, "shared window", block_now=True)

    def _stopped(self, rank: int, kind: int, seq: int | None, value: int = 0) -> None:
        """Raise why a compiled run stopped: the records' verdict, a peer's
        abort, or a direct read or write refused (outside the peer's array, or by the kernel)."""
        ext = compiled.ext
        if kind == ext.K_ABORTED:
            raise self._t._aborted_error(rank)
        if kind in (ext.K_OUTSIDE, ext.K_WRITE_OUTSIDE):
            raise MismatchedCollective(
                f"rank {self._t.rank}: would {'read' if kind == ext.K_OUTSIDE else 'write'} outside rank {rank}'s "
                f"buffer, which holds {value} bytes (ranks disagree about the call)")
        if kind == ext.K_LOST:  # the kernel refused: most often the peer is gone, which names it best
            lost = self._t._lost_peer({rank})
            if lost is not None:
                raise lost
            self._cross.refused(rank, value)
        if seq is None:
            now = self._records.current()
            seq = now[0] if now is not None else 0
        raise self._records.verdict(seq)

    def step(self, deadline: float) -> int:
        """Take the next step through the halves (for an algorithm that writes
        its half, then fences); returns its number k >= 1, whose half
        ``(k - 1) % 2`` may be written now."""
        if self._compiled is None:
            self._turn += 1
            return self._turn
        late = self._compiled.step()
        if late is not None:  # the first peer still below; then every other one, in turn
            _, kind, value = late
            for r in self._peers:
                self._wait_for((r, kind, value), deadline)
        return self._compiled.turn

    # ------------------------------------------------------------- compiled calls

    def compile(self, narrays: int, before: list, after: list, reduce: tuple | None,
                sources: list[int], piece: int = 0, then: tuple | None = None,
                direct: tuple | None = None) -> CompiledCall:
        """A collective's small case in one compiled call (see
        :meth:`~collectives.window_contract.SharedWindow.compile` and
        ``collectives._compiled``); a direct call publishes in each region's
        metadata block and reads peers by cross-memory attach."""
        if self._compiled is None:
            raise NotImplementedError("the compiled window is off (COLLECTIVES_COMPILED=0, or a rank without it)")
        if direct is not None:
            if DIRECT_ACCESS not in self.features:
                raise NotImplementedError("the window cannot reach peers' memory (no cross-memory attach)")
            readers, shared, copies_in, pool_first, reduction = (tuple(direct) + (None,) * 3)[:5]
            described = (self._cross.pids, [reg.ctypes.data for reg in self._regions], readers, shared, copies_in)
            if pool_first is not None:  # read arrays that lie in their rank's pool out of it
                described += ([(pool.ctypes.data, pool.nbytes) for pool in self._pools], self._adopted_part,
                              Adoptions.MIN_BYTES, pool_first)
            elif reduction is not None:
                described += (None, None, 0, sys.maxsize)
            if reduction is not None:  # (ralts, copies_out, piece)
                described += tuple(reduction)
            return self._compiled.compile(narrays, before, after, reduce, sources, 0, None, None, described)
        if then is not None:
            return self._compiled.compile(narrays, before, after, reduce, sources, 0, None, then)
        if piece <= 0:
            return self._compiled.compile(narrays, before, after, reduce, sources)
        spans = [(reg.ctypes.data, reg.nbytes) for reg in self._regions]
        return self._compiled.compile(narrays, before, after, reduce, sources, piece, spans)

    def record_calls(self, ring: np.ndarray | None) -> None:
        """Have every compiled call run record itself in row ``seq & (n - 1)``
        of ``ring`` (n rows of 8 float64, a power of two of them: a flight
        recorder's): its start and end times (seconds of the monotonic clock)
        as elements 0 and 1, its signature (word 0 with the call number) as
        elements 2 to 4, seen as uint64; None stops it."""
        if self._compiled is not None:
            self._compiled.record_calls(ring)

    def settle(self, call: CompiledCall, arrays: tuple, late: Any, deadline: float) -> None:
        """Finish a compiled call's run that had to wait or stopped: block, resume,
        until done; raise the verdict of a run that stopped for good."""
        try:
            while late is not None:
                self._wait_for(late, deadline)
                late = call.resume(arrays)
        except BaseException:
            call.abandon()
            raise

    def release(self) -> None:
        """Drop everything that refers to the mapped memory (the algorithms' state first)."""
        self.kept.clear()
        if self._adoptions is not None:
            self._adoptions.close()
            self._adoptions = None
        self._regions = self._pools = self._peer_q = []
        self._compiled = None
        self.features = self.features - {COMPILED_CALLS}
