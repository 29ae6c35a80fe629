"""The shared-memory transport: the parts of this package put together.

:class:`SharedMemoryTransport` is the rings (:mod:`.rings`), the matching of
messages to receives (:mod:`.matching`), waiting for requests
(:mod:`.requests`), waking and waiting on counters (:mod:`.waking`), peer
liveness and aborts (:mod:`.liveness`) and the rendezvous
(:mod:`.segments`), mixed into one object that shares their state (each
mixin says which attributes it reads and writes); and, composed, the call
records (:mod:`.records`), the pool's allocator (:mod:`.pool`) and the
window (:mod:`.window`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from collectives import signature
from collectives.errors import BadArgument, TransportUnavailable
from collectives.transport import Transport
from collectives.window_contract import describe_cma_from

from .layout import Q_CLOSED, Q_PID, Layout
from .liveness import Liveness
from .matching import Matching
from .pool import Pool
from .requests import RequestWaits
from .rings import Rings
from . import agreement, segments
from .segments import SegmentSetup, affinity, shm_free_bytes
from .waking import Waking, spin_seconds, yield_seconds
from .window import ShmWindow

__all__ = ["SharedMemoryTransport"]

log = logging.getLogger("collectives.shm")


class SharedMemoryTransport(Matching, RequestWaits, Rings, Waking, Liveness, SegmentSetup, Transport):
    """Point-to-point through per-pair byte rings in shared memory, plus a shared window.

    Open it with :meth:`open`; see :mod:`collectives.transports.shm` for the design.

    Its own state: ``rank``, ``size``, ``timeout``, ``cores``, ``cma``
    (whether every rank may reach every other's private memory),
    ``_layout``, ``_job``, ``_secret``, ``_cma_wanted``, ``_closed``,
    ``_lock`` (held while the rings move), ``_pool`` (a :class:`~.pool.Pool`)
    and ``_window``.
    """

    name = "shm"
    capabilities = frozenset({"window", "agree"})
    released_on_delivery = True  # see Transport

    # ------------------------------------------------------------------ setup

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return segments.available()

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "SharedMemoryTransport":
        """Create this rank's segment, map every peer's, then unlink the names.

        Args:
            rank, size: this rank and the number of ranks (all on this host).
            job: an id shared by the ranks of one job; names derive from it.
            timeout: default timeout of waits and of the rendezvous, seconds.
            options: ``shm_ring_bytes``, ``shm_window_bytes``,
                ``shm_alloc_bytes``, ``shm_cma``, ``shm_cma_faster``, ``shm_adopt``, ``secret``
                (all optional; see :mod:`.segments`).

        Returns:
            The connected transport.

        Raises:
            CollectiveTimeout if some rank does not appear in time; PeerLost if
            one dies during the rendezvous; BadArgument on inconsistent sizes.
        """
        ok, why = cls.available()
        if not ok:
            raise TransportUnavailable(why)
        if size < 1 or not 0 <= rank < size:
            raise BadArgument(f"rank {rank} is not in a world of {size} ranks")
        s = segments.settings(size, job, options)
        return cls(rank, size, job, float(timeout), s.layout, s.secret, s.cma, s.adopt, options.get("rank_pids"),
                   s.cma_faster)

    def __init__(self, rank: int, size: int, job: str, timeout: float, layout: Layout, secret: int,
                 cma: bool = True, adopt: bool = True, rank_pids: list[int] | None = None,
                 cma_faster: bool | None = None) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._rank_pids = rank_pids  # known processes of the ranks (a shrink's): their death ends the rendezvous
        self._layout = layout
        self._job = job
        self._secret = secret & 0x7FFFFFFFFFFFFFFF
        self._closed = False
        self._lock = threading.RLock()
        self._segs = []
        self._sleep_words: list[int] = []  # addresses of every rank's Q_SLEEP word
        self._counter_words: list[list[int]] = []  # and of its Q_EPOCH, Q_POST and Q_DONE counters
        self._watch = None
        self._window: ShmWindow | None = None
        self._records = None
        self._inbox_word = 0
        self._next_check = 0.0
        self.cma = False
        self._cma_wanted = cma
        self._cma_faster_wanted = cma_faster
        self.cma_from = 0  # bytes from which a cross-memory read beats the window (copy_race)
        self.copy_race: dict[int, dict[str, int]] = {}  # rank 0's times by size, when it raced
        self.cores = len(affinity())  # until the rendezvous tells every rank's
        self._spin = spin_seconds(size, self.cores)
        self._yield = yield_seconds()
        deadline = time.monotonic() + timeout
        try:
            self._rendezvous(deadline)
        except BaseException:
            self._cleanup_names()
            self._release()
            raise
        self._setup_rings()
        self._pool = Pool(layout.pool)
        self._window = ShmWindow(self, adopt)
        log.info("rank %d: shared memory of job %s up: %d ranks on %d cores, rings of %d B, a window of %d B, "
                 "cross-memory attach %s, compiled calls %s", rank, job, size, self.cores, layout.ring, layout.window,
                 f"on ({describe_cma_from(self.cma_from)})" if self.cma else "off",
                 "on" if "compiled_calls" in self._window.features else "off")

    def begin_call(self, seq: int, sig: signature.Sig, refusal: str | None = None) -> None:
        """Publish this rank's record of call ``seq`` (peers check it before
        they touch this rank's memory; see :mod:`.records`), and make the
        call's first window fence its arrival."""
        if self._closed:
            return
        self._check_leftovers(seq)
        self._records.publish(seq, sig, refusal)
        if self._window is not None:
            self._window.arm(seq)

    # ------------------------------------------------------ surviving failures

    def failed_peers(self, closed_too: bool = True) -> set[int]:
        """Peers that will take no further part: their process exited, or (with
        ``closed_too``) they closed their transport."""
        if self._closed:
            return set()
        dead = self._watch.dead() if self._watch is not None else set()
        if not closed_too:
            return dead
        return dead | {r for r, seg in enumerate(self._segs) if r != self.rank and seg.q[Q_CLOSED]}

    def reopen_options(self, survivors: list[int]) -> dict[str, Any]:
        """Options for opening the survivors' transport: their processes, so
        that one that dies before it joins ends the rendezvous at once."""
        return {"rank_pids": [int(self._segs[r].q[Q_PID]) for r in survivors]}

    def agree(self, number: int, failed: set[int], flag: bool, deadline: float) -> tuple[set[int], bool]:
        """Agreement ``number`` among the survivors (see :mod:`.agreement`):
        the failed ranks and the AND of the survivors' flags, the same on
        every survivor."""
        if self._closed:
            raise BadArgument(f"rank {self.rank}: the shared-memory transport is closed")
        qs = [seg.q for seg in self._segs]
        return agreement.agree(self.rank, self.size, qs, number, set(failed) | self.failed_peers(), flag,
                               self.failed_peers, lambda: time.sleep(2e-4), deadline)

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Release the mappings (idempotent). Peers waiting on this rank get PeerLost."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._segs[self.rank].q[Q_CLOSED] = 1
                self._wake_all()
            except Exception:
                pass
            self._release()

    def _release(self) -> None:
        if self._window is not None:
            self._window.release()
        for name in ("_tx_data", "_rx_data"):
            for view in getattr(self, name, ()):
                view.release()
            setattr(self, name, [])
        self._tx_q = []
        self._rx_q = None
        for seg in self._segs:
            if seg is not None:
                seg.release()
        self._segs = []
        if self._watch is not None:
            self._watch.close()

    # -------------------------------------------------------- capabilities

    @property
    def window(self) -> ShmWindow | None:
        """The shared window (every rank's region and allocation pool)."""
        return self._window

    def _pool_block(self, nbytes: int) -> int | None:
        """Offset of a free block of ``nbytes`` in this rank's pool, while
        /dev/shm has room for it (for :meth:`alloc` and adopted buffers)."""
        if self._closed or nbytes > shm_free_bytes() // 2:
            return None
        return self._pool.take(nbytes)

    def alloc(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes from this rank's shared pool (private memory when the
        pool or /dev/shm is too full for them).

        Returns:
            A 64-byte aligned uint8 array; the block returns to the pool when
            the array and all its views are garbage collected.
        """
        off = self._pool_block(nbytes)
        if off is None:
            return super().alloc(nbytes)
        lay = self._layout
        arr = np.frombuffer(self._segs[self.rank].mm, np.uint8, nbytes, lay.pool_off + off)
        weakref.finalize(arr, self._pool.give, off, nbytes)
        return arr
