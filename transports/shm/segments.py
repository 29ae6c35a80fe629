"""Setting up and cleaning up: the sizes every rank must agree on, creating
this rank's segment, attaching the peers', unlinking the names, the
cross-memory-attach probe and counting the cores the ranks share.

Each rank creates its segment, maps every other rank's, and unlinks its
name as soon as every rank has mapped it, so nothing is left behind even if
a process is killed later (a failed rendezvous removes every name of the
job it finds). Sizes come from ``options`` or the environment (all ranks
must agree): ``shm_ring_bytes`` / ``COLLECTIVES_SHM_RING_BYTES`` (per
sender; default 1 MiB for up to 4 ranks, less above), ``shm_window_bytes``
/ ``COLLECTIVES_SHM_WINDOW_BYTES`` (default 4 MiB of data per rank, plus
:data:`~.layout.WINDOW_HEADER_BYTES`), ``shm_alloc_bytes`` /
``COLLECTIVES_SHM_ALLOC_BYTES`` (sparse pool, default 1 GiB of address
space per rank), ``shm_cma`` / ``COLLECTIVES_SHM_CMA`` (0 turns off
reading and writing peers' private memory, see :mod:`.cma`; it is used
only when every rank may reach every other), ``shm_cma_faster`` /
``COLLECTIVES_SHM_CMA_FASTER`` (1 or 0: whether such a read beats the
window's two copies; default: raced at startup, see :mod:`.copy_race`),
``shm_adopt`` /
``COLLECTIVES_SHM_ADOPT`` (0 keeps the pages of buffers used again and
again private: see :mod:`.pages`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
import sys
from typing import Any, NamedTuple

import numpy as np

from collectives import compiled, config
from collectives.arithmetic import pow2_floor
from collectives.errors import BadArgument, CollectiveTimeout, PeerLost
from collectives.waiting import Backoff

from . import cma, copy_race
from .layout import (CPU_WORDS, MAGIC, MiB, Q_ALLOC, Q_ATTACHED, Q_CMA, Q_CPUS, Q_DONE, Q_EPOCH, Q_INBOX,
                     Q_MAGIC, Q_COMPILED, Q_PID, Q_POST, Q_PROBE, Q_RING, Q_SECRET, Q_SIZE, Q_SLEEP, Q_WINDOW, SHM_DIR,
                     WINDOW_HEADER_BYTES, Layout, Segment, align, default_ring_bytes, job_paths, segment_path)
from .liveness import PeerWatch, exited
from .pages import PAGE
from .records import CallRecords
from .waking import spin_seconds, yield_seconds

__all__ = ["Settings", "SegmentSetup", "available", "settings", "shm_free_bytes", "affinity", "unlink_job"]


def available() -> tuple[bool, str]:
    """(True, "") where shared-memory segments can be made here, else (False, why)."""
    if not sys.platform.startswith("linux"):
        return False, "shared-memory transport needs Linux (/dev/shm)"
    if not os.access(SHM_DIR, os.W_OK):
        return False, f"{SHM_DIR} is not writable"
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False, (f"the shared-memory transport relies on x86's store order, and this is "
                       f"{platform.machine()}: use zmq or mpi")
    return True, ""


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm (tmpfs pages are taken only when touched)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def affinity() -> set[int]:
    """The cores this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _env_int(options: dict[str, Any], key: str, default: int) -> int:
    """``options[key]``, else the setting ``COLLECTIVES_<KEY>`` (:mod:`collectives.config`), else ``default``."""
    value = options.get(key)
    if value is None:
        value = config.get(key.upper())
        return default if value is None else int(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadArgument(f"{key} must be an integer, got {value!r}") from None


class Settings(NamedTuple):
    """What every rank of a job must agree on, and this rank's switches."""

    layout: Layout
    secret: int   # identifies the job's segments (from ``options["secret"]``, else the job id)
    cma: bool     # whether to try cross-memory attach
    adopt: bool   # whether to move buffers used again and again into the pool
    cma_faster: bool | None  # rank 0's: whether a cross-memory read beats the window's copies (None: race them)


def settings(size: int, job: str, options: dict[str, Any]) -> Settings:
    """The settings from ``options`` and the environment (see the module docstring).

    Raises:
        BadArgument: a size is not a number or too small.
    """
    free = shm_free_bytes()  # small /dev/shm (containers): smaller defaults
    ring_default = max(64 * 1024, min(default_ring_bytes(size), pow2_floor(free // (8 * size * size))))
    window_default = max(256 * 1024, min(4 * MiB, pow2_floor(free // (8 * size))))
    ring = align(_env_int(options, "shm_ring_bytes", ring_default), PAGE)
    window = align(_env_int(options, "shm_window_bytes", window_default), PAGE)
    pool = align(_env_int(options, "shm_alloc_bytes", 1 << 30), PAGE)
    if ring < PAGE or window < 64 * 1024 or pool < 0:
        raise BadArgument(f"shared-memory sizes too small: ring {ring} B (at least {PAGE}), "
                          f"window {window} B (at least 64 KiB), pool {pool} B")
    cma_on = _env_int(options, "shm_cma", 1) != 0
    adopt = _env_int(options, "shm_adopt", 1) != 0
    faster = _env_int(options, "shm_cma_faster", -1)
    secret = int.from_bytes(hashlib.sha1(str(options.get("secret", job)).encode()).digest()[:8], "little")
    return Settings(Layout(size, ring, window + WINDOW_HEADER_BYTES, pool), secret, cma_on, adopt,
                    None if faster < 0 else faster != 0)


def _create(job: str, rank: int, size: int, layout: Layout, secret: int, probe_address: int) -> Segment:
    """Create and fill in ``rank``'s segment (replacing one a crashed job left)."""
    path = segment_path(job, rank)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:  # left over by a crashed job with the same id
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, layout.total)
        mm = mmap.mmap(fd, layout.total)
        keep = os.dup(fd)  # adopted pages are made private with it (see .pages)
    finally:
        os.close(fd)
    seg = Segment(path, mm, layout, keep)
    q = seg.q
    q[Q_PID], q[Q_SIZE], q[Q_RING] = os.getpid(), size, layout.ring
    q[Q_WINDOW], q[Q_ALLOC], q[Q_SECRET] = layout.window, layout.pool, secret
    q[Q_PROBE] = probe_address
    q[Q_COMPILED] = 1 if compiled.enabled() is not None else 0
    for cpu in affinity():
        if cpu < 64 * CPU_WORDS:
            q[Q_CPUS + cpu // 64] |= 1 << (cpu % 64)
    q[Q_MAGIC] = MAGIC  # last: the segment is ready
    return seg


def _attach(job: str, rank: int, layout: Layout, secret: int) -> Segment | None:
    """``rank``'s segment, mapped, once it is ready; None before (or when the
    name is another job's, or was left by a dead process)."""
    path = segment_path(job, rank)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != layout.total:
            return None  # still being created, or another configuration
        mm = mmap.mmap(fd, layout.total)
    finally:
        os.close(fd)
    seg = Segment(path, mm, layout)
    q = seg.q
    if q[Q_MAGIC] != MAGIC or q[Q_SECRET] != secret or exited(int(q[Q_PID])):
        seg.release()  # not ready, another job's, or left by a dead process
        return None
    return seg


def unlink_all(job: str, size: int) -> None:
    """Remove every segment name of ``job`` still present."""
    _unlink([segment_path(job, r) for r in range(size)])


def unlink_job(job: str) -> None:
    """Remove every segment name of ``job`` and of its ``job-...`` jobs still
    present, once every rank of it has ended (a launcher's: a rank stopped
    while it waited in a rendezvous leaves its name, see :func:`~.layout.job_paths`)."""
    _unlink(job_paths(job))


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


class SegmentSetup:
    """The rendezvous; mixed into :class:`~.transport.SharedMemoryTransport`.

    Reads ``rank``, ``size``, ``_job``, ``_layout``, ``_secret``,
    ``_cma_wanted`` and ``_cma_faster_wanted``; sets ``_segs`` (every rank's :class:`~.layout.Segment`),
    ``_probe`` (the word peers probe), ``_watch``, ``_bases`` (every
    segment's address), ``_sleep_words``,
    ``_counter_words`` (addresses of every rank's ``Q_EPOCH``, ``Q_POST``
    and ``Q_DONE``), ``_inbox_word``, ``_records``, ``cma``, ``cores``,
    ``cma_from`` (:mod:`.copy_race`) and ``_spin``. Waits with :meth:`~.waking.Waking._wait_counter`.
    """

    def _rendezvous(self, deadline: float) -> None:
        """Create this rank's segment, map every peer's, wait until every rank
        mapped every other, unlink this rank's name, agree on cross-memory
        attach, count the cores and race a cross-memory read against the
        window's copies."""
        self._probe = np.array([MAGIC], np.uint64)
        own = _create(self._job, self.rank, self.size, self._layout, self._secret, self._probe.ctypes.data)
        segs: list[Segment | None] = [None] * self.size
        segs[self.rank] = own
        self._segs = segs  # type: ignore[assignment]
        self._attach_peers(segs, deadline)
        self._watch = PeerWatch({r: int(s.q[Q_PID]) for r, s in enumerate(segs) if r != self.rank})
        self._bases = bases = [np.frombuffer(s.mm, np.uint8, 8).ctypes.data for s in segs]
        self._sleep_words = [b + Q_SLEEP * 8 for b in bases]
        self._counter_words = [[b + i * 8 for b in bases] for i in (Q_EPOCH, Q_POST, Q_DONE)]
        self._inbox_word = bases[self.rank] + Q_INBOX * 8
        self._records = CallRecords(self.rank, [s.q for s in segs], [s.mv for s in segs],
                                    [int(s.q[Q_PID]) for s in segs])
        own.q[Q_ATTACHED] = 1
        self._wake_all()
        try:
            for r in range(self.size):
                if r != self.rank and segs[r].q[Q_ATTACHED] != 1:
                    self._wait_counter(segs[r].q, Q_ATTACHED, 1, r, deadline, "shared-memory rendezvous")
            os.unlink(own.path)
            self._probe_cma(deadline)
            self._count_cores()
            self.cma_from = copy_race.race(self, deadline, self._cma_faster_wanted)
        except PeerLost as exc:  # a peer's death found while waiting on it: say where
            raise PeerLost(f"{exc}, in the shared-memory rendezvous of job {self._job!r}", exc.peer) from None

    def _attach_peers(self, segs: list, deadline: float) -> None:
        """Map every peer's segment into ``segs`` as it appears."""
        missing = [r for r in range(self.size) if r != self.rank]
        backoff = Backoff(deadline, f"rank {self.rank}: shared-memory rendezvous of job {self._job!r}",
                          max_sleep=5e-3)
        pids = getattr(self, "_rank_pids", None) or []
        # The ranks whose process is known (a shrink's survivors): one that died (a zombie
        # too: the launcher's --on-failure continue leaves dead ranks unreaped) ends it.
        known = PeerWatch({r: pid for r, pid in enumerate(pids) if pid and r != self.rank})
        try:
            while missing:
                for r in list(missing):
                    seg = _attach(self._job, r, self._layout, self._secret)
                    if seg is not None:
                        segs[r] = seg
                        missing.remove(r)
                dead = known.dead() if missing else set()
                for r in missing:
                    if r in dead:
                        raise PeerLost(f"rank {self.rank}: rank {r} (pid {pids[r]}) died before it joined job "
                                       f"{self._job!r}", r)
                if missing:
                    try:
                        backoff.pause()
                    except CollectiveTimeout:
                        raise CollectiveTimeout(
                            f"rank {self.rank}: ranks {missing} did not create their shared-memory "
                            f"segments of job {self._job!r} in time") from None
        finally:
            known.close()

    def _count_cores(self) -> None:
        """Cores the ranks share: those any rank may run on (a launcher that
        binds each rank to one core leaves each a single core of its own)."""
        words = [0] * CPU_WORDS
        for seg in self._segs:
            for i in range(CPU_WORDS):
                words[i] |= int(seg.q[Q_CPUS + i])
        self.cores = max(sum(bin(w).count("1") for w in words), 1)
        self._spin = spin_seconds(self.size, self.cores)
        self._yield = yield_seconds()

    def _probe_cma(self, deadline: float) -> None:
        """Agree whether every rank may read and write every other's private
        memory (Linux cross-memory attach, process_vm_readv and _writev)."""
        verdicts = [self._cma_wanted]
        for r, seg in enumerate(self._segs):
            if r != self.rank and self._cma_wanted:
                # read the peer's probe word, then write the same value back
                verdicts.append(cma.probe(int(seg.q[Q_PID]), int(seg.q[Q_PROBE]), MAGIC))
        own = self._segs[self.rank].q
        own[Q_CMA] = 1 if all(verdicts) else 2
        self._wake_all()
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg.q[Q_CMA] == 0:
                self._wait_counter(seg.q, Q_CMA, 1, r, deadline, "shared-memory rendezvous")
        self.cma = all(seg.q[Q_CMA] == 1 for seg in self._segs)

    def _cleanup_names(self) -> None:
        """After a failed rendezvous: remove every name of this job still present."""
        unlink_all(self._job, self.size)
