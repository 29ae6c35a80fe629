"""Shared-memory transport: the default when every rank runs on one host.

Each rank creates one segment in ``/dev/shm`` named after the job and its
rank, maps every other rank's segment, and unlinks its name as soon as every
rank has mapped it, so nothing is left behind even if a process is killed
later. A segment holds, in order:

* a control page: magic, pid, abort flag and reason, closed flag, the fence
  epoch (each counter written only by its owner);
* the control lines of the rings this rank *receives* on (one per sender:
  the sender's head counter and this rank's tail counter, a cache line each);
* the ring data, one single-producer single-consumer byte ring per sender;
* the shared window region (``capacity`` bytes, see :class:`ShmWindow`);
* the shared allocation pool (sparse: pages cost memory only once touched)
  from which :meth:`SharedMemoryTransport.alloc` carves user buffers.

Messages are a 48-byte header (tag, length, the call's signature) followed
by the payload, padded to 16 bytes, streamed through the ring as space frees up, so large messages
pipeline: the sender copies in while the receiver copies out. Counters are
monotonically increasing 64-bit integers, each written by one process only
(aligned 8-byte stores; x86 keeps stores in order, so no atomics are needed).

A message that arrives before its receive is posted is drained into an
unexpected-message queue, so different tags never block each other and two
ranks that both send before receiving never deadlock. Every wait makes
progress on all pending sends and receives, backs off, has a deadline, and
checks peers every few milliseconds: a peer that died (pidfd readable) or
aborted raises :class:`~collectives.errors.PeerLost`.

Backing off: when every rank has a core of its own, a wait spins for
``SPIN_SECONDS``; when ranks share cores, it yields at once (a spin would
only delay the rank it waits for) for ``YIELD_SECONDS``. Then it blocks on
a futex over its own ``Q_SLEEP`` word, which a peer rings after writing
anything the sleeper may wait for (a ring's head or tail, the fence epoch,
the closed and abort flags). Timed sleeps would cost 50 to 100 us each
(timer slack, the hypervisor's timer) and wake late; a rung block wakes
when the answer is there.

Sizes come from ``options`` or the environment (all ranks must agree):
``shm_ring_bytes`` / ``COLLECTIVES_SHM_RING_BYTES`` (per sender; default
1 MiB for up to 4 ranks, less above), ``shm_window_bytes`` /
``COLLECTIVES_SHM_WINDOW_BYTES`` (default 4 MiB of data per rank, plus
:data:`WINDOW_HEADER_BYTES`),
``shm_alloc_bytes`` / ``COLLECTIVES_SHM_ALLOC_BYTES`` (sparse pool, default
1 GiB of address space per rank), ``shm_cma`` / ``COLLECTIVES_SHM_CMA`` (0
turns off reading and writing peers' private memory with process_vm_readv
and process_vm_writev; they are used only when every rank may reach every
other), ``shm_adopt`` / ``COLLECTIVES_SHM_ADOPT`` (0 keeps the pages of
buffers used again and again private: see :mod:`.pages`).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import mmap
import os
import re
import select
import struct
import sys
import threading
import time
import weakref
from typing import Any, Sequence

import numpy as np

from collectives import signature
from collectives.signature import checks_enabled as signature_checks
from collectives.errors import (BadArgument, CollectiveTimeout, MismatchedCollective, PeerLost,
                                TransportUnavailable, from_abort)
from collectives.signature import NO_SIG, Sig
from collectives.transport import COMPLETED, Request, Transport
from collectives import native
from collectives.waiting import Backoff, futex_wait, futex_wake
from collectives.transports.pages import HUGE_PAGE, PAGE, Adoptions, huge_pages, libc_function, populate
from collectives.transports.shm_records import Q_INBOX, WAIT_MESSAGE, WAIT_WINDOW, CallRecords

__all__ = ["SharedMemoryTransport", "ShmWindow"]

SHM_DIR = "/dev/shm"
MAGIC = 0x636F6C6C5F73686D  # "coll_shm"
LINE = 64
HEADER = struct.Struct("<qqQQQq")  # tag, payload length, the call's signature (3 words), padding
HEADER_BYTES = HEADER.size
MiB = 1 << 20

# Control page: indices of 8-byte counters (each in its own cache line where hot).
Q_MAGIC, Q_PID, Q_SIZE, Q_RING, Q_WINDOW, Q_ALLOC, Q_SECRET = 0, 1, 2, 3, 4, 5, 6
Q_ATTACHED = 8           # line 1: set once this rank has mapped every peer
Q_ABORT, Q_REASON_LEN, Q_ABORT_SEQ = 16, 17, 18  # line 2; the first call the aborter did not complete
Q_CLOSED = 24            # line 3
Q_PROBE, Q_CMA = 25, 26  # cross-memory attach probe address; 1 ok, 2 not permitted
Q_NATIVE = 27            # 1 when this rank runs the window natively (all ranks must, or none)
Q_EPOCH = 32             # line 4: fence epoch
Q_SLEEP = 48             # line 6 (apart from the epoch's 128 bytes): 1 while this rank
                         # blocks on it (a futex), until a peer rings it
Q_POST, Q_DONE = 64, 80  # lines 8 and 10: the last window step whose data this rank
                         # posted, and the last it is done reading (native plans)
Q_CPUS, CPU_WORDS = 96, 16  # lines 12 and 13: the cores this rank may run on (a bit each)
REASON_OFFSET, REASON_MAX = 1024, 1536  # then the refusal reason (shm_records)

PEER_CHECK_SECONDS = 0.002
#: Spin this long before yielding when every rank has a core of its own.
SPIN_SECONDS = 50e-6
#: When ranks share cores, yield this long before blocking.
YIELD_SECONDS = 200e-6
#: A blocked wait sleeps until a peer rings it, but at most this long at first,
#: growing to BLOCK_MAX: the bound on a lost wake-up, and how often a blocked
#: rank looks whether its peers are still alive.
BLOCK_FIRST, BLOCK_MAX = 20e-6, 1e-3


def _affinity() -> set[int]:
    """The cores this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _env_int(options: dict[str, Any], key: str, default: int) -> int:
    value = options.get(key)
    if value is None:
        value = os.environ.get("COLLECTIVES_" + key.upper())
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        raise BadArgument(f"{key} must be an integer number of bytes, got {value!r}") from None


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm (tmpfs pages are taken only when touched)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _pow2_floor(n: int) -> int:
    return 1 << max(n.bit_length() - 1, 0)


def default_ring_bytes(size: int) -> int:
    """Ring bytes per sender: 1 MiB up to 4 ranks, shrinking so that
    ``size**2`` rings stay near 16 MiB in all, never below 64 KiB."""
    budget = (16 * MiB) // max(size * size, 1)
    ring = 1 << max(budget.bit_length() - 1, 0)
    return max(64 * 1024, min(MiB, ring))


#: Room ahead of a window's data for the algorithms' bookkeeping, so that a
#: window of ``shm_window_bytes`` holds two halves of at least half that
#: (a 2 MiB message then fits one half of the default window: with halves a
#: page short of it, 2 MiB took two steps, the second of one page, and a
#: 2-rank bcast of 2 MiB 1.3 to 1.9 times as long).
WINDOW_HEADER_BYTES = 16 * 1024


class _Layout:
    """Byte offsets inside one rank's segment (the same for every rank)."""

    def __init__(self, size: int, ring: int, window: int, pool: int) -> None:
        self.size, self.ring, self.window, self.pool = size, ring, window, pool
        self.ring_ctrl = PAGE
        self.ring_data = _align(PAGE + size * 2 * LINE, PAGE)
        self.window_off = _align(self.ring_data + size * ring, PAGE)
        self.pool_off = _align(self.window_off + window, PAGE)
        self.total = _align(self.pool_off + pool, PAGE)
        self.ctrl_bytes = self.ring_data  # the part cast to 8-byte counters

    def head_index(self, sender: int) -> int:
        return (self.ring_ctrl + sender * 2 * LINE) // 8

    def tail_index(self, sender: int) -> int:
        return (self.ring_ctrl + sender * 2 * LINE + LINE) // 8

    def ring_slice(self, sender: int) -> slice:
        start = self.ring_data + sender * self.ring
        return slice(start, start + self.ring)


class _Segment:
    """One rank's mapped segment."""

    def __init__(self, path: str, mm: mmap.mmap, layout: _Layout) -> None:
        self.path = path
        self.mm = mm
        self.mv = memoryview(mm)
        self.q = self.mv[:layout.ctrl_bytes].cast("Q")

    def release(self) -> None:
        for view in (self.q, self.mv):
            try:
                view.release()
            except (BufferError, ValueError):
                pass
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # user arrays still point into it; freed when they go


# --------------------------------------------------------------------------- requests


class _ShmRequest(Request):
    __slots__ = ("transport", "peer", "tag", "mv", "nbytes", "done", "error", "sig")

    kind = "request"

    def __init__(self, transport: "SharedMemoryTransport", peer: int, tag: int, mv: memoryview,
                 sig: signature.Sig = NO_SIG) -> None:
        self.transport = transport
        self.peer = peer
        self.tag = tag
        self.mv = mv
        self.nbytes = len(mv)
        self.done = False
        self.error: BaseException | None = None
        self.sig = sig

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self.transport._wait((self,), timeout)
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self.done:
            self.transport._progress_locked()
        if self.error is not None:
            raise self.error
        return self.done

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} of {self.nbytes} B {way} rank {self.peer}"


class _SendRequest(_ShmRequest):
    __slots__ = ("sent", "wire")
    kind = "send"

    def __init__(self, transport, peer, tag, mv, sig) -> None:
        super().__init__(transport, peer, tag, mv, sig)
        self.sent = 0  # wire bytes pushed: header, payload, padding
        self.wire = HEADER_BYTES + _align(self.nbytes, 16)


class _RecvRequest(_ShmRequest):
    __slots__ = ()
    kind = "receive"


class _Unexpected:
    """A message that arrived before its receive was posted."""

    __slots__ = ("data", "done", "sig")

    def __init__(self, nbytes: int, sig: signature.Sig) -> None:
        self.data = bytearray(nbytes)
        self.done = False
        self.sig = sig


class _Incoming:
    """The message being copied out of one sender's ring."""

    __slots__ = ("tag", "nbytes", "wire", "got", "dest", "target")

    def __init__(self, tag: int, nbytes: int, dest: memoryview | None, target) -> None:
        self.tag = tag
        self.nbytes = nbytes
        self.wire = _align(nbytes, 16)
        self.got = 0  # wire bytes consumed after the header
        self.dest = dest  # None: discard (a receive that failed)
        self.target = target  # _RecvRequest, _Unexpected or None


def _bytes_view(buf: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat 'B' memoryview (zero-copy)."""
    if buf.ndim != 1:
        buf = buf.reshape(-1)
    return memoryview(buf.view(np.uint8))


# --------------------------------------------------------------------------- cross-memory attach


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_vm(name: str):
    """libc's ``process_vm_readv`` or ``process_vm_writev``, or None."""
    return libc_function(name, ctypes.c_ssize_t, [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong])


_readv = _load_vm("process_vm_readv")
_writev = _load_vm("process_vm_writev")


def _cma(fn, pid: int, address: int, local: np.ndarray) -> bool:
    """Move ``local.nbytes`` bytes between ``local`` and ``address`` in process
    ``pid`` with ``fn`` (:data:`_readv`: into ``local``; :data:`_writev`: out
    of it). Returns False when the kernel refuses (no permission, no support)."""
    if fn is None:
        return False
    want = local.nbytes
    done = 0
    base = local.ctypes.data
    while done < want:
        mine = _IoVec(base + done, want - done)
        theirs = _IoVec(address + done, want - done)
        n = fn(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if n <= 0:
            return False
        done += n
    return True


#: The kernel's copy for cross-memory attach runs about 4.4 times slower when
#: the destination starts 1 to 31 bytes past the source's place in a 4 KiB
#: page (measured here: 1 MiB in 440 us against 100 us; 32 bytes and more,
#: or any place before the source's, run at full speed). Heap buffers land
#: at any 16-byte place, so two ranks' buffers meet that way often.
SKEW_SLOW_BYTES = 32
#: Such copies go through a bounce buffer placed like the source, this many
#: bytes at a time (the extra copy is in user space, which handles the skew).
BOUNCE_BYTES = 256 << 10


def skewed(src: int, dst: int) -> bool:
    """True when a kernel copy from address ``src`` to ``dst`` would be slow (see :data:`SKEW_SLOW_BYTES`)."""
    return 0 < (dst - src) % PAGE < SKEW_SLOW_BYTES


def _cma_read(pid: int, address: int, out: np.ndarray) -> bool:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out``."""
    return _cma(_readv, pid, address, out)


def _cma_write(pid: int, address: int, src: np.ndarray) -> bool:
    """Copy ``src`` to ``address`` in process ``pid``."""
    return _cma(_writev, pid, address, src)


# --------------------------------------------------------------------------- window


class ShmWindow:
    """The shared window of a :class:`SharedMemoryTransport`.

    ``region(r)`` is rank r's window region (``capacity`` bytes);
    ``allocation(r)`` is rank r's shared allocation pool, in which
    :meth:`locate` finds arrays from :meth:`SharedMemoryTransport.alloc`.
    ``fence`` is a barrier on per-rank epoch counters, each written only by
    its owner.
    """

    def __init__(self, transport: "SharedMemoryTransport", adopt: bool = True) -> None:
        t = self._t = transport
        lay = t._layout
        self.capacity = lay.window
        self.cores = t.cores  # shared by the ranks (algorithms scale thresholds with ranks per core)
        self._regions = [np.frombuffer(s.mm, np.uint8, lay.window, lay.window_off) for s in t._segs]
        self._pools = [np.frombuffer(s.mm, np.uint8, lay.pool, lay.pool_off) for s in t._segs]
        self._pool_base = self._pools[t.rank].ctypes.data
        self._adoptions = Adoptions(self._pools[t.rank], t._pool_block, t._pool.give) if adopt else None
        self._mapped_in: set[tuple[int, int, int]] = set()
        self._epoch = 0
        self._peer_q = [s.q for s in t._segs]
        self._peers = [r for r in range(t.size) if r != t.rank]
        self._pids = [int(s.q[Q_PID]) for s in t._segs]
        self._turn = 0
        self._armed: int | None = None  # a call whose first synchronisation is still to come
        self._armed_turn = 0
        self._records = t._records
        self._bounce: np.ndarray | None = None
        self._native = None
        ext = native.enabled()
        if ext is not None and all(s.q[Q_NATIVE] == 1 for s in t._segs):
            # the same fence in C, with a bounded spin or yield; and plans
            spin, yields = (SPIN_SECONDS, 20e-6) if t._spin else (0.0, YIELD_SECONDS)
            self._native = ext.Window(*t._counter_words, t._sleep_words, t.rank,
                                      int(spin * 1e9), int(yields * 1e9), t._inbox_word,
                                      signature_checks())

    @property
    def cma(self) -> bool:
        """True when every rank may read and write every other rank's private
        memory (:meth:`read`, :meth:`write`), so algorithms can copy straight
        between user buffers."""
        return self._t.cma

    def huge_pages(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in huge pages, for :meth:`read` and :meth:`write`
        from other ranks to run at full speed (see :func:`huge_pages`; True
        where the kernel cannot tell)."""
        return huge_pages(buf.__array_interface__["data"][0], buf.nbytes) is not False

    def read(self, rank: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in ``rank``'s private memory into ``out``.

        Raises:
            PeerLost: the read failed (the peer exited, or its memory is gone).
        """
        if not out.nbytes:
            return
        if skewed(address, out.ctypes.data):
            self._bounced(True, rank, address, out)
        elif not _cma_read(self._pids[rank], address, out):
            self._lost("read", out.nbytes, "from", rank)

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        """Copy ``src`` to ``address`` in ``rank``'s private memory.

        Raises:
            PeerLost: the write failed (the peer exited, or its memory is gone).
        """
        if not src.nbytes:
            return
        if skewed(src.ctypes.data, address):
            self._bounced(False, rank, address, src)
        elif not _cma_write(self._pids[rank], address, src):
            self._lost("write", src.nbytes, "to", rank)

    def _bounced(self, reading: bool, rank: int, address: int, local: np.ndarray) -> None:
        """:meth:`read` (``reading``) or :meth:`write` through a bounce buffer
        placed in its pages where ``address`` is, so the kernel copies unskewed."""
        if self._bounce is None:
            self._bounce = np.empty(BOUNCE_BYTES + PAGE, np.uint8)
        skip = (address - self._bounce.ctypes.data) % PAGE
        bounce = self._bounce[skip:skip + BOUNCE_BYTES]
        data = local.reshape(-1).view(np.uint8)
        pid = self._pids[rank]
        for start in range(0, data.nbytes, BOUNCE_BYTES):
            part = data[start:start + BOUNCE_BYTES]
            via = bounce[:part.nbytes]
            if reading:
                moved = _cma_read(pid, address + start, via)
                if moved:
                    native.copy(part, via)
            else:
                native.copy(via, part)
                moved = _cma_write(pid, address + start, via)
            if not moved:
                self._lost(*(("read", part.nbytes, "from") if reading else ("write", part.nbytes, "to")), rank)

    def _lost(self, what: str, nbytes: int, way: str, rank: int) -> None:
        err = ctypes.get_errno()
        raise PeerLost(f"rank {self._t.rank}: cannot {what} {nbytes} B {way} rank {rank}'s "
                       f"memory ({os.strerror(err)})", rank)

    @property
    def epoch(self) -> int:
        """Number of fences this rank has passed (the same on every rank between calls)."""
        return self._native.epoch if self._native is not None else self._epoch

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
        Arrays from :meth:`SharedMemoryTransport.alloc` lie there whole; with
        ``adopt``, a private buffer seen again is moved there in place, all
        but its first and last partial pages (see :class:`~.pages.Adoptions`)."""
        where = self.locate(arr)
        if where is not None:
            return where[1], 0, arr.nbytes
        if self._adoptions is None or not self._peer_q:
            return None
        return self._adoptions.find(arr.__array_interface__["data"][0], arr.nbytes, adopt)

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

    def arm(self, seq: int) -> None:
        """Call ``seq`` started (its record is written): its first :meth:`fence`
        is its arrival (:meth:`arrive`)."""
        self._armed, self._armed_turn = seq, self.turn

    @property
    def turn(self) -> int:
        """Steps taken through the halves."""
        return self._native.turn if self._native is not None else self._turn

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
        if self._native is not None:
            while True:
                late = self._native.arrive(seq)
                if late is None:
                    return
                self._wait_for(late, deadline, seq)
        k = self._turn
        own = self._peer_q[self._t.rank]
        own[Q_POST] = k
        self._t._ring_all()
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
        qs = self._peer_q
        if not qs:
            raise BadArgument("the shared-memory transport is closed")
        if self._armed is not None:
            self.arrive(self._armed, deadline)
            return
        if self._native is not None:
            if not self._native.fence():
                e = self._native.epoch
                for r in self._peers:
                    self._wait_for((r, native.native.K_EPOCH, e), deadline)
            return
        e = self._epoch = self._epoch + 1
        qs[self._t.rank][Q_EPOCH] = e
        late = None
        for r in self._peers:  # a peer already at this fence may sleep, waiting for this rank
            q = qs[r]
            if q[Q_EPOCH] < e:
                late = [r] if late is None else late + [r]
            elif q[Q_SLEEP]:
                self._t._ring(r)
        if late:
            for r in late:
                if qs[r][Q_EPOCH] < e:
                    self._t._wait_counter(qs[r], Q_EPOCH, e, r, deadline, "window fence")

    _KINDS = (Q_EPOCH, Q_POST, Q_DONE)

    def _wait_for(self, late: tuple[int, int, int], deadline: float, seq: int | None = None) -> None:
        """Block until rank's counter of kind (epoch, post, done) reaches value:
        the rest of a native wait whose bounded spin ran out; raise when the
        native code stopped for good (kind K_VERDICT or K_ABORTED)."""
        rank, kind, value = late
        if kind < 0:
            self._stopped(rank, kind, seq)
        q = self._peer_q[rank]
        if q[self._KINDS[kind]] < value:
            self._t._wait_counter(q, self._KINDS[kind], value, rank, deadline, "shared window", block_now=True)

    def _stopped(self, rank: int, kind: int, seq: int | None) -> None:
        """Raise why a native run stopped: the records' verdict, or a peer's abort."""
        if kind == native.native.K_ABORTED:
            raise self._t._aborted_error(rank)
        if seq is None:
            now = self._records.current()
            seq = now[0] if now is not None else 0
        raise self._records.verdict(seq)

    def step(self, deadline: float) -> int:
        """Take the next step through the halves (for an algorithm that writes
        its half, then fences); returns its number k >= 1, whose half
        ``(k - 1) % 2`` may be written now."""
        if self._native is None:
            self._turn += 1
            return self._turn
        late = self._native.step()
        if late is not None:  # the first peer still below; then every other one, in turn
            _, kind, value = late
            for r in self._peers:
                self._wait_for((r, kind, value), deadline)
        return self._native.turn

    def plan(self, narrays: int, before: list, after: list, reduce: tuple | None, sources: list[int]) -> Any:
        """A collective's small case in one native call (see
        ``collectives._native``), or None without the native extension.
        ``before``/``after``: copies ``(src, dst, nbytes)`` before posting
        and after the ``sources`` (ranks whose regions it reads) posted;
        ``reduce``: ``(dst, srcs, count, dtype code, op code)`` after the
        copies, or None; places are ``(array index, byte offset, 0)`` in the
        call's arrays or ``(-1, address in half 0, address in half 1)`` in
        the window.

        Returns:
            The plan: ``plan.run(arrays)`` takes the next step; when it
            returns something to wait for, call :meth:`settle`.
        """
        if self._native is None:
            return None
        return self._native.plan(narrays, before, after, reduce, sources)

    def settle(self, plan: Any, arrays: tuple, late: tuple, deadline: float) -> None:
        """Finish a plan's run that had to wait or stopped: block, resume,
        until done; raise the verdict of a run that stopped for good."""
        try:
            while late is not None:
                self._wait_for(late, deadline)
                late = plan.resume(arrays)
        except BaseException:
            plan.abandon()
            raise

    def release(self) -> None:
        if self._adoptions is not None:
            self._adoptions.close()
            self._adoptions = None
        self._regions = self._pools = self._peer_q = []
        self._native = None


# --------------------------------------------------------------------------- allocator


class _Pool:
    """First-fit allocator over this rank's shared pool; blocks come back when
    the returned array (and every view of it) is garbage collected."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int | None:
        size = _align(max(nbytes, 1), PAGE if nbytes >= 64 * 1024 else self.ALIGN)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, length - size)
                    return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        size = _align(max(nbytes, 1), PAGE if nbytes >= 64 * 1024 else self.ALIGN)
        with self._lock:
            blocks = sorted(self._free + [(off, size)])
            merged: list[tuple[int, int]] = []
            for o, n in blocks:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged


# --------------------------------------------------------------------------- transport


def _job_tag(job: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "", job)
    if clean != job or len(clean) > 40:
        clean = hashlib.sha1(job.encode()).hexdigest()[:16]
    return clean


def segment_path(job: str, rank: int) -> str:
    """The name under /dev/shm of ``rank``'s segment in ``job``."""
    return f"{SHM_DIR}/coll-{_job_tag(job)}-{rank}"


#: Call numbers wrap around here (the communicator's tag space).
_CALLS = 1 << 27


def _completed(first_failed: int, seq: int) -> bool:
    """Whether a rank whose first incomplete call is ``first_failed`` completed call ``seq``."""
    ahead = (first_failed - seq) & signature.SEQ_MASK
    return 0 < ahead < 1 << (signature.SEQ_BITS - 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _PeerWatch:
    """Tells whether peer processes are still alive (pidfds where available)."""

    def __init__(self, pids: dict[int, int]) -> None:
        self._fds: dict[int, int] = {}
        self._pids = pids
        self._poll = select.poll() if hasattr(select, "poll") else None
        for rank, pid in pids.items():
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                continue
            self._fds[fd] = rank
            self._poll.register(fd, select.POLLIN)

    def dead(self) -> set[int]:
        """Ranks whose process has exited."""
        gone: set[int] = set()
        if self._fds:
            gone.update(self._fds[fd] for fd, _ in self._poll.poll(0))
        for rank, pid in self._pids.items():
            if rank in gone or rank in self._fds.values():
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.add(rank)
            except PermissionError:
                pass
        return gone

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}


class SharedMemoryTransport(Transport):
    """Point-to-point through per-pair byte rings in shared memory, plus a shared window.

    Open it with :meth:`open`; see the module docstring for the layout.
    """

    name = "shm"
    capabilities = frozenset({"window"})
    released_on_delivery = True  # see Transport

    # ------------------------------------------------------------------ setup

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if not sys.platform.startswith("linux"):
            return False, "shared-memory transport needs Linux (/dev/shm)"
        if not os.access(SHM_DIR, os.W_OK):
            return False, f"{SHM_DIR} is not writable"
        return True, ""

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float,
             options: dict[str, Any]) -> "SharedMemoryTransport":
        """Create this rank's segment, map every peer's, then unlink the names.

        Args:
            rank, size: this rank and the number of ranks (all on this host).
            job: an id shared by the ranks of one job; names derive from it.
            timeout: default timeout of waits and of the rendezvous, seconds.
            options: ``shm_ring_bytes``, ``shm_window_bytes``,
                ``shm_alloc_bytes``, ``secret`` (all optional).

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
        free = shm_free_bytes()  # small /dev/shm (containers): smaller defaults
        ring_default = max(64 * 1024, min(default_ring_bytes(size), _pow2_floor(free // (8 * size * size))))
        window_default = max(256 * 1024, min(4 * MiB, _pow2_floor(free // (8 * size))))
        ring = _align(_env_int(options, "shm_ring_bytes", ring_default), PAGE)
        window = _align(_env_int(options, "shm_window_bytes", window_default), PAGE)
        pool = _align(_env_int(options, "shm_alloc_bytes", 1 << 30), PAGE)
        if ring < PAGE or window < 64 * 1024 or pool < 0:
            raise BadArgument(f"shared-memory sizes too small: ring {ring} B (at least {PAGE}), "
                              f"window {window} B (at least 64 KiB), pool {pool} B")
        cma = _env_int(options, "shm_cma", 1) != 0
        adopt = _env_int(options, "shm_adopt", 1) != 0
        secret = int.from_bytes(hashlib.sha1(str(options.get("secret", job)).encode()).digest()[:8], "little")
        layout = _Layout(size, ring, window + WINDOW_HEADER_BYTES, pool)
        return cls(rank, size, job, float(timeout), layout, secret, cma, adopt)

    def __init__(self, rank: int, size: int, job: str, timeout: float, layout: _Layout, secret: int,
                 cma: bool = True, adopt: bool = True) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._layout = layout
        self._job = job
        self._secret = secret & 0x7FFFFFFFFFFFFFFF
        self._closed = False
        self._lock = threading.RLock()
        self._segs: list[_Segment] = []
        self._sleep_words: list[int] = []  # addresses of every rank's Q_SLEEP word
        self._counter_words: list[list[int]] = []  # and of its Q_EPOCH, Q_POST and Q_DONE counters
        self._watch: _PeerWatch | None = None
        self._window: ShmWindow | None = None
        self._records: CallRecords | None = None
        self._inbox_word = 0
        self._next_check = 0.0
        self.cma = False
        self._cma_wanted = cma
        self.cores = len(_affinity())  # until the rendezvous tells every rank's
        self._spin = SPIN_SECONDS if size <= self.cores else 0.0
        deadline = time.monotonic() + timeout
        try:
            self._rendezvous(deadline)
        except BaseException:
            self._cleanup_names()
            self._release()
            raise
        self._setup_rings()
        self._pool = _Pool(layout.pool)
        self._window = ShmWindow(self, adopt)

    def _create_own(self) -> _Segment:
        path = segment_path(self._job, self.rank)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:  # left over by a crashed job with the same id
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, self._layout.total)
            mm = mmap.mmap(fd, self._layout.total)
        finally:
            os.close(fd)
        seg = _Segment(path, mm, self._layout)
        q, lay = seg.q, self._layout
        q[Q_PID], q[Q_SIZE], q[Q_RING] = os.getpid(), self.size, lay.ring
        q[Q_WINDOW], q[Q_ALLOC], q[Q_SECRET] = lay.window, lay.pool, self._secret
        self._probe = np.array([MAGIC], np.uint64)
        q[Q_PROBE] = self._probe.ctypes.data
        q[Q_NATIVE] = 1 if native.enabled() is not None else 0
        for cpu in _affinity():
            if cpu < 64 * CPU_WORDS:
                q[Q_CPUS + cpu // 64] |= 1 << (cpu % 64)
        q[Q_MAGIC] = MAGIC  # last: the segment is ready
        return seg

    def _try_attach(self, rank: int) -> _Segment | None:
        path = segment_path(self._job, rank)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != self._layout.total:
                return None  # still being created, or another configuration
            mm = mmap.mmap(fd, self._layout.total)
        finally:
            os.close(fd)
        seg = _Segment(path, mm, self._layout)
        q = seg.q
        if q[Q_MAGIC] != MAGIC or q[Q_SECRET] != self._secret or not _alive(int(q[Q_PID])):
            seg.release()  # not ready, another job's, or left by a dead process
            return None
        return seg

    def _rendezvous(self, deadline: float) -> None:
        own = self._create_own()
        segs: list[_Segment | None] = [None] * self.size
        segs[self.rank] = own
        self._segs = segs  # type: ignore[assignment]
        missing = [r for r in range(self.size) if r != self.rank]
        backoff = Backoff(deadline, f"rank {self.rank}: shared-memory rendezvous of job {self._job!r}",
                          max_sleep=5e-3)
        while missing:
            for r in list(missing):
                seg = self._try_attach(r)
                if seg is not None:
                    segs[r] = seg
                    missing.remove(r)
            if missing:
                try:
                    backoff.pause()
                except CollectiveTimeout:
                    raise CollectiveTimeout(
                        f"rank {self.rank}: ranks {missing} did not create their shared-memory "
                        f"segments of job {self._job!r} in time") from None
        self._watch = _PeerWatch({r: int(s.q[Q_PID]) for r, s in enumerate(segs) if r != self.rank})
        bases = [np.frombuffer(s.mm, np.uint8, 8).ctypes.data for s in segs]
        self._sleep_words = [b + Q_SLEEP * 8 for b in bases]
        self._counter_words = [[b + i * 8 for b in bases] for i in (Q_EPOCH, Q_POST, Q_DONE)]
        self._inbox_word = bases[self.rank] + Q_INBOX * 8
        self._records = CallRecords(self.rank, [s.q for s in segs], [s.mv for s in segs],
                                    [int(s.q[Q_PID]) for s in segs])
        own.q[Q_ATTACHED] = 1
        self._ring_all()
        for r in range(self.size):
            if r != self.rank and segs[r].q[Q_ATTACHED] != 1:
                self._wait_counter(segs[r].q, Q_ATTACHED, 1, r, deadline, "shared-memory rendezvous")
        os.unlink(own.path)
        self._probe_cma(deadline)
        self._count_cores()

    def _count_cores(self) -> None:
        """Cores the ranks share: those any rank may run on (a launcher that
        binds each rank to one core leaves each a single core of its own)."""
        words = [0] * CPU_WORDS
        for seg in self._segs:
            for i in range(CPU_WORDS):
                words[i] |= int(seg.q[Q_CPUS + i])
        self.cores = max(sum(bin(w).count("1") for w in words), 1)
        self._spin = SPIN_SECONDS if self.size <= self.cores else 0.0

    def _probe_cma(self, deadline: float) -> None:
        """Agree whether every rank may read and write every other's private
        memory (Linux cross-memory attach, process_vm_readv and _writev)."""
        verdicts = [self._cma_wanted]
        for r, seg in enumerate(self._segs):
            if r != self.rank and self._cma_wanted:
                pid, probe, got = int(seg.q[Q_PID]), int(seg.q[Q_PROBE]), np.zeros(1, np.uint64)
                # read the peer's probe word, then write the same value back
                verdicts.append(_cma_read(pid, probe, got) and got[0] == MAGIC and _cma_write(pid, probe, got))
        own = self._segs[self.rank].q
        own[Q_CMA] = 1 if all(verdicts) else 2
        self._ring_all()
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg.q[Q_CMA] == 0:
                self._wait_counter(seg.q, Q_CMA, 1, r, deadline, "shared-memory rendezvous")
        self.cma = all(seg.q[Q_CMA] == 1 for seg in self._segs)

    def _cleanup_names(self) -> None:
        """After a failed rendezvous: remove every name of this job still present."""
        for r in range(self.size):
            try:
                os.unlink(segment_path(self._job, r))
            except OSError:
                pass

    def _setup_rings(self) -> None:
        lay, me = self._layout, self._segs[self.rank]
        p = self.size
        self._ring_bytes = lay.ring
        # Sending to dst: ring (self.rank -> dst) lives in dst's segment.
        self._tx_q = [s.q for s in self._segs]
        self._tx_head_i = lay.head_index(self.rank)
        self._tx_tail_i = lay.tail_index(self.rank)
        self._tx_data = [s.mv[lay.ring_slice(self.rank)] for s in self._segs]
        self._tx_head = [0] * p
        self._tx_tail = [0] * p
        self._tx_queue: list[collections.deque] = [collections.deque() for _ in range(p)]
        self._tx_busy: set[int] = set()
        # Receiving from src: ring (src -> self.rank) lives in this segment.
        self._rx_q = me.q
        self._rx_head_i = [lay.head_index(s) for s in range(p)]
        self._rx_tail_i = [lay.tail_index(s) for s in range(p)]
        self._rx_data = [me.mv[lay.ring_slice(s)] for s in range(p)]
        self._rx_tail = [0] * p
        self._rx_cur: list[_Incoming | None] = [None] * p
        self._posted: list[dict[int, collections.deque]] = [{} for _ in range(p)]
        self._unexpected: list[dict[int, collections.deque]] = [{} for _ in range(p)]
        self._moved = 0
        self._ranks = range(p)

    # ------------------------------------------------------------- the rings

    def _push(self, dst: int) -> None:
        """Copy as much of the queued sends to ``dst`` into its ring as fits."""
        queue = self._tx_queue[dst]
        size = self._ring_bytes
        ring = self._tx_data[dst]
        head = self._tx_head[dst]
        tail = self._tx_tail[dst]
        start = head
        while queue:
            req = queue[0]
            free = size - (head - tail)
            if free < req.wire - req.sent:
                tail = self._tx_tail[dst] = self._tx_q[dst][self._tx_tail_i]
                free = size - (head - tail)
            if req.sent == 0:
                if free < HEADER_BYTES:
                    break
                HEADER.pack_into(ring, head % size, req.tag, req.nbytes, *req.sig, 0)
                head += HEADER_BYTES
                free -= HEADER_BYTES
                req.sent = HEADER_BYTES
            lo = req.sent - HEADER_BYTES
            n = min(req.nbytes - lo, free)
            if n > 0:
                pos = head % size
                first = min(n, size - pos)
                ring[pos:pos + first] = req.mv[lo:lo + first]
                if first < n:
                    ring[:n - first] = req.mv[lo + first:lo + n]
                head += n
                free -= n
                req.sent += n
            if req.sent - HEADER_BYTES >= req.nbytes:
                pad = min(req.wire - req.sent, free)
                head += pad
                req.sent += pad
            if req.sent < req.wire:
                break
            req.done = True
            queue.popleft()
        if head != start:
            self._tx_head[dst] = head
            q = self._tx_q[dst]
            q[self._tx_head_i] = head
            if q[Q_SLEEP]:
                self._ring(dst)
            self._moved += head - start
        if not queue:
            self._tx_busy.discard(dst)

    def _match(self, src: int, tag: int, nbytes: int, sig: signature.Sig) -> _Incoming:
        """Route a newly arrived message to its posted receive, or queue it as
        unexpected; a receive whose signature or size disagrees fails (the
        message is then read and dropped), and so does a collective receive
        from ``src`` for another call (see :func:`~collectives.signature.out_of_step`)."""
        posted = self._posted[src].get(tag)
        if posted:
            req = posted.popleft()
            if not posted:
                del self._posted[src][tag]
            err = self._disagreement(req, sig, nbytes)
            if err is not None:
                req.error, req.done = err, True
                return _Incoming(tag, nbytes, None, None)
            return _Incoming(tag, nbytes, req.mv, req)
        if tag & 1:
            self._fail_out_of_step(src, tag, sig)
        entry = _Unexpected(nbytes, sig)
        self._unexpected[src].setdefault(tag, collections.deque()).append(entry)
        return _Incoming(tag, nbytes, memoryview(entry.data), entry)

    def _disagreement(self, req: _RecvRequest, sig: signature.Sig, nbytes: int) -> Exception | None:
        """Why a message with ``sig`` and ``nbytes`` cannot complete ``req`` (None: it can)."""
        if sig != req.sig:
            err = signature.check_message(req.sig, sig, self.rank, req.peer)
            if err is not None:
                return err
        if req.nbytes != nbytes:
            return MismatchedCollective(
                f"rank {self.rank}: expected {req.nbytes} bytes from rank {req.peer}, got {nbytes} "
                f"(in {signature.describe(req.sig)}; ranks disagree about the collective or its size)")
        return None

    def _fail_out_of_step(self, src: int, tag: int, sig: signature.Sig) -> None:
        """A collective message from ``src`` for call ``tag`` arrived: fail every
        pending collective receive from ``src`` for another call."""
        for other, queue in list(self._posted[src].items()):
            if other & 1 and other != tag:
                for req in queue:
                    req.error, req.done = signature.out_of_step(self.rank, src, other, tag, sig), True
                del self._posted[src][other]

    def _pull(self, src: int) -> None:
        """Copy whatever has arrived from ``src`` to its receives."""
        q = self._rx_q
        tail = self._rx_tail[src]
        avail = q[self._rx_head_i[src]] - tail
        if not avail:
            return
        start = tail
        size = self._ring_bytes
        ring = self._rx_data[src]
        cur = self._rx_cur[src]
        while avail:
            if cur is None:
                tag, nbytes, w0, w1, w2, _ = HEADER.unpack_from(ring, tail % size)
                tail += HEADER_BYTES
                avail -= HEADER_BYTES
                cur = self._match(src, tag, nbytes, (w0, w1, w2))
            n = min(cur.nbytes - cur.got, avail)
            if n > 0:
                dest = cur.dest
                if dest is not None:
                    pos = tail % size
                    first = min(n, size - pos)
                    lo = cur.got
                    dest[lo:lo + first] = ring[pos:pos + first]
                    if first < n:
                        dest[lo + first:lo + n] = ring[:n - first]
                tail += n
                avail -= n
                cur.got += n
            if cur.got >= cur.nbytes:
                pad = min(cur.wire - cur.got, avail)
                tail += pad
                avail -= pad
                cur.got += pad
            if cur.got < cur.wire:
                break
            if cur.target is not None:
                cur.target.done = True
            cur = None
        self._rx_cur[src] = cur
        self._rx_tail[src] = tail
        q[self._rx_tail_i[src]] = tail
        if self._tx_q[src][Q_SLEEP]:
            self._ring(src)  # it may wait for room
        self._moved += tail - start

    def _progress(self) -> None:
        if self._tx_busy:
            for dst in tuple(self._tx_busy):
                self._push(dst)
        q, heads, tails = self._rx_q, self._rx_head_i, self._rx_tail
        for src in self._ranks:
            if q[heads[src]] != tails[src]:
                self._pull(src)

    def _progress_locked(self) -> None:
        with self._lock:
            self._check_usable()
            self._progress()

    def _check_usable(self) -> None:
        if self._closed:
            raise BadArgument("the shared-memory transport is closed")

    # --------------------------------------------------------- point to point

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start sending ``buf``'s bytes to ``peer``; completes once they are in the ring."""
        mv = _bytes_view(buf)
        with self._lock:
            self._check_usable()
            queue = self._tx_queue[peer]
            if not queue and self._send_whole(peer, tag, mv, sig):
                return COMPLETED
            req = _SendRequest(self, peer, tag, mv, sig)
            queue.append(req)
            self._tx_busy.add(peer)
            if len(queue) == 1:
                self._push(peer)
        return COMPLETED if req.done else req

    def _send_whole(self, dst: int, tag: int, mv: memoryview, sig: signature.Sig) -> bool:
        """Fast path: put a whole message into an idle ring if it fits now."""
        nbytes = len(mv)
        wire = HEADER_BYTES + ((nbytes + 15) & ~15)
        size = self._ring_bytes
        head = self._tx_head[dst]
        if size - (head - self._tx_tail[dst]) < wire:
            tail = self._tx_tail[dst] = self._tx_q[dst][self._tx_tail_i]
            if size - (head - tail) < wire:
                return False
        ring = self._tx_data[dst]
        pos = head % size
        HEADER.pack_into(ring, pos, tag, nbytes, *sig, 0)
        if nbytes:
            pos += HEADER_BYTES
            first = min(nbytes, size - pos)
            ring[pos:pos + first] = mv[:first] if first < nbytes else mv
            if first < nbytes:
                ring[:nbytes - first] = mv[first:]
        head += wire
        self._tx_head[dst] = head
        q = self._tx_q[dst]
        q[self._tx_head_i] = head
        if q[Q_SLEEP]:
            self._ring(dst)
        self._moved += wire
        return True

    def _ready_payload(self, src: int, tag: int, nbytes: int, sig: signature.Sig) -> int:
        """Ring offset of a whole message from ``src`` with ``tag`` and
        ``nbytes`` waiting at the head of its ring, with nothing ahead of it
        for this receive (no earlier posted receive, no early message, no
        message half copied); -1 otherwise. Call with the lock held."""
        if self._rx_cur[src] is not None or self._posted[src].get(tag) or self._unexpected[src].get(tag):
            return -1
        tail = self._rx_tail[src]
        if self._rx_q[self._rx_head_i[src]] - tail < HEADER_BYTES + _align(nbytes, 16):
            return -1  # not all there yet (its padding included: a sender may add that last)
        size = self._ring_bytes
        got_tag, got_bytes, w0, w1, w2, _ = HEADER.unpack_from(self._rx_data[src], tail % size)
        if got_tag != tag or got_bytes != nbytes or (w0, w1, w2) != sig:
            return -1
        return (tail + HEADER_BYTES) % size

    def _consume(self, src: int, nbytes: int) -> None:
        """Release the message just read at the head of ``src``'s ring."""
        tail = self._rx_tail[src] + HEADER_BYTES + _align(nbytes, 16)
        self._rx_tail[src] = tail
        self._rx_q[self._rx_tail_i[src]] = tail
        if self._tx_q[src][Q_SLEEP]:
            self._ring(src)  # it may wait for room
        self._moved += HEADER_BYTES + _align(nbytes, 16)

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        """Start receiving exactly ``buf.nbytes`` bytes from ``peer`` with ``tag``."""
        mv = _bytes_view(buf)
        with self._lock:
            self._check_usable()
            pos = self._ready_payload(peer, tag, len(mv), sig)
            if pos >= 0:  # the common case of small messages: it is already here, in one piece
                n, ring = len(mv), self._rx_data[peer]
                first = min(n, self._ring_bytes - pos)
                mv[:first] = ring[pos:pos + first]
                if first < n:
                    mv[first:] = ring[:n - first]
                self._consume(peer, n)
                return COMPLETED
            req = _RecvRequest(self, peer, tag, mv, sig)
            early = self._unexpected[peer].get(tag)
            if early:
                entry = early.popleft()
                if not early:
                    del self._unexpected[peer][tag]
                self._take_unexpected(req, entry)
            elif tag & 1 and self._other_call_queued(peer, tag, req):
                pass
            else:
                self._posted[peer].setdefault(tag, collections.deque()).append(req)
                if self._rx_q[self._rx_head_i[peer]] != self._rx_tail[peer]:
                    self._pull(peer)
        return req

    def _other_call_queued(self, peer: int, tag: int, req: _RecvRequest) -> bool:
        """Fail ``req`` (a collective receive) when a message of another call
        from ``peer`` waits unclaimed: ``peer`` moved past this call."""
        for other, queue in self._unexpected[peer].items():
            if other & 1 and other != tag and queue:
                req.error, req.done = signature.out_of_step(self.rank, peer, tag, other, queue[0].sig), True
                return True
        return False

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        """Reduce straight from the ring when the whole message is already there
        in one piece; otherwise receive into ``tmp`` and reduce on completion."""
        n = out.nbytes
        if n and out.flags.c_contiguous:
            with self._lock:
                self._check_usable()
                pos = self._ready_payload(peer, tag, n, sig)
                if 0 <= pos <= self._ring_bytes - n:
                    received = self._rx_data[peer][pos:pos + n]
                    op.reduce_into(out, mine, np.frombuffer(received, out.dtype).reshape(out.shape))
                    self._consume(peer, n)
                    return COMPLETED
        return super().irecv_reduce(out, mine, peer, tag, op, tmp, sig)

    def _take_unexpected(self, req: _RecvRequest, entry: _Unexpected) -> None:
        """Hand an early message to ``req``: copy it, or redirect the rest of it."""
        err = self._disagreement(req, entry.sig, len(entry.data))
        if err is not None:
            req.error, req.done = err, True
            if not entry.done:  # the rest of it is dropped as it arrives
                cur = self._rx_cur[req.peer]
                cur.dest, cur.target = None, None
            return
        if entry.done:
            req.mv[:] = entry.data
            req.done = True
            return
        cur = self._rx_cur[req.peer]  # the entry is still arriving: stream the rest straight in
        got = min(cur.got, cur.nbytes)
        req.mv[:got] = entry.data[:got]
        cur.dest, cur.target = req.mv, req

    def begin_call(self, seq: int, sig: signature.Sig, refusal: str | None = None) -> None:
        """Publish this rank's record of call ``seq`` (peers check it before
        they touch this rank's memory; see :mod:`.shm_records`), and make the
        call's first window fence its arrival."""
        if self._closed:
            return
        self._check_leftovers(seq)
        self._records.publish(seq, sig, refusal)
        if self._window is not None:
            self._window.arm(seq)

    def _check_leftovers(self, seq: int) -> None:
        """Raise when a message of an earlier call from some peer was never
        received: that peer and this rank made different calls then (both
        only sent, so neither noticed). Messages of this or later calls (a
        peer ahead) and point-to-point ones are left alone."""
        if not any(self._rx_q[self._rx_head_i[src]] != self._rx_tail[src] for src in self._ranks) \
                and not any(self._unexpected):
            return
        with self._lock:
            self._progress()
            for src, queues in enumerate(self._unexpected):
                for tag, queue in queues.items():
                    old = (seq - signature.seq_of_tag(tag)) % _CALLS
                    if tag & 1 and queue and 0 < old < _CALLS // 2:
                        raise MismatchedCollective(
                            f"rank {self.rank}: rank {src} sent a message of call #{signature.seq_of_tag(tag)} "
                            f"({signature.describe(queue[0].sig)}) that no receive of this rank took: the two "
                            "ranks made different calls then")

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for every request, progressing all of them together."""
        own = [r for r in requests if isinstance(r, _ShmRequest)]
        if own:
            self._wait(own, timeout)
            for r in own:
                if r.error is not None:
                    raise r.error
        for r in requests:
            r.wait(timeout)

    def _wait(self, reqs: Sequence[_ShmRequest], timeout: float | None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        backoff: Backoff | None = None
        block = None
        lock = self._lock
        while True:
            with lock:
                self._check_usable()
                moved = self._moved
                self._progress()
                if all(r.done for r in reqs) or any(r.error is not None for r in reqs):
                    if block is not None:
                        self._records.waiting(0, 0)
                    return  # a failed request ends the wait: its error is what counts
                moved = self._moved != moved
            if backoff is None:
                backoff = self._backoff(deadline)
            elif moved:
                backoff.reset()
            elif block is None and backoff.count >= backoff.yields:
                block = self._blocker(lambda: self._nothing_new(reqs))
                pending = [r for r in reqs if not r.done]
                if pending:
                    self._records.waiting(WAIT_MESSAGE, pending[0].peer)
            try:
                backoff.pause(block)
            except CollectiveTimeout:
                pending = [r for r in reqs if not r.done]
                self._records.waiting(0, 0)
                raise CollectiveTimeout(f"rank {self.rank}: {pending[0].describe()} not complete "
                                        f"({len(pending)} pending); {self._records.diagnose(pending[0].peer)}") from None
            if backoff.count > backoff.spins:
                self._maybe_check_peers({r.peer for r in reqs if not r.done}, reqs)

    def _backoff(self, deadline: float, block_now: bool = False) -> Backoff:
        """The wait policy: spin first when every rank has a core of its own;
        when ranks share cores, yield at once and for a while, then block
        (at once with ``block_now``)."""
        if block_now:
            return Backoff(deadline, "", spins=0, yields=0, first_sleep=BLOCK_FIRST, max_sleep=BLOCK_MAX)
        if self._spin:
            return Backoff(deadline, "", spin_time=self._spin, first_sleep=BLOCK_FIRST, max_sleep=BLOCK_MAX)
        return Backoff(deadline, "", spins=0, yield_time=YIELD_SECONDS, first_sleep=BLOCK_FIRST,
                       max_sleep=BLOCK_MAX)

    def _nothing_new(self, reqs: Sequence[_ShmRequest]) -> bool:
        """Progress once; True when nothing moved and some request is still pending."""
        with self._lock:
            if self._closed:
                return False
            moved = self._moved
            self._progress()
            return moved == self._moved and not all(r.done for r in reqs)

    # ------------------------------------------------------------- sleeping

    def _blocker(self, still_waiting) -> Any:
        """A ``block(seconds)`` for :meth:`Backoff.pause`: mark this rank asleep,
        check once more, then block on its sleep word until a peer rings it
        (:meth:`_ring`) or the time passes."""
        own = self._segs[self.rank].q
        word = self._sleep_words[self.rank]

        def block(seconds: float) -> None:
            own[Q_SLEEP] = 1
            try:
                if still_waiting():
                    futex_wait(word, 1, seconds)
            finally:
                own[Q_SLEEP] = 0
        return block

    def _ring(self, rank: int) -> None:
        """Wake ``rank`` if it sleeps (after this rank wrote something it may wait for)."""
        q = self._segs[rank].q
        if q[Q_SLEEP]:
            q[Q_SLEEP] = 0  # a sleeper that has not blocked yet then returns at once
            futex_wake(self._sleep_words[rank])

    def _ring_all(self) -> None:
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg is not None:
                self._ring(r)

    def _maybe_check_peers(self, relevant: set[int], reqs: Sequence[_ShmRequest] = ()) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + PEER_CHECK_SECONDS
        lost = self._lost_peer(relevant)
        if lost is None:
            lost = self._records.check_waiting(sorted(relevant), lambda peer: self._still_waiting(reqs, peer))
            if lost is not None:
                raise lost
            return
        with self._lock:  # what arrived before the peer left still counts
            self._progress()
            if reqs:
                pending = {r.peer for r in reqs if not r.done}
                if not pending:
                    return
                # A peer that closed after delivering everything it owed is not lost.
                lost = self._lost_peer(pending)
                if lost is None:
                    return
        raise lost

    def _still_waiting(self, reqs: Sequence[_ShmRequest], peer: int) -> bool:
        """Progress once; whether some request of a collective call (a receive
        from ``peer``, or a send to it: a peer that finished the call took
        every message it wanted) is still pending."""
        with self._lock:
            if not self._closed:
                self._progress()
        return any(not r.done and r.peer == peer and r.tag & 1 for r in reqs)

    def _aborted_error(self, rank: int) -> Exception:
        """The error of this rank when ``rank`` aborted the job (of the kind of
        ``rank``'s own error, see :func:`~collectives.errors.from_abort`)."""
        return from_abort(self._reason(self._segs[rank]), rank, self.rank)

    def _aborted_in(self, seq: int | None) -> int | None:
        """A peer that aborted without completing call ``seq`` (None: any
        peer that aborted), or None."""
        for r, seg in enumerate(self._segs):
            if r != self.rank and seg.q[Q_ABORT]:
                if seq is None or not _completed(int(seg.q[Q_ABORT_SEQ]), seq):
                    return r
        return None

    def _lost_peer(self, relevant: set[int]) -> Exception | None:
        """The error for an aborted peer, or a relevant peer that died or closed."""
        now = self._records.current() if self._records is not None else None
        aborted = self._aborted_in(now[0] if now is not None else None)
        if aborted is not None:
            return self._aborted_error(aborted)
        dead = self._watch.dead() if self._watch is not None else set()
        for r in sorted(dead):
            if not self._segs[r].q[Q_CLOSED]:
                return PeerLost(f"rank {self.rank}: rank {r} (pid {self._segs[r].q[Q_PID]}) died", r)
        for r in sorted(relevant):
            if r != self.rank and (r in dead or self._segs[r].q[Q_CLOSED]):
                return PeerLost(f"rank {self.rank}: rank {r} closed its transport while rank "
                                f"{self.rank} still waited on it", r)
        return None

    def _wait_counter(self, q: memoryview, index: int, target: int, peer: int, deadline: float,
                      what: str, block_now: bool = False) -> None:
        """Wait until ``q[index] >= target`` (a counter owned by ``peer``);
        ``block_now``: the caller has spun and yielded already."""
        backoff = self._backoff(deadline, block_now)
        block = None
        relevant = {peer}
        try:
            while q[index] < target:
                if block is None and backoff.count >= backoff.yields:
                    block = self._blocker(lambda: q[index] < target)
                    if self._records is not None:
                        self._records.waiting(WAIT_WINDOW, peer)
                try:
                    backoff.pause(block)
                except CollectiveTimeout:
                    where = f"; {self._records.diagnose(peer)}" if self._records is not None else ""
                    raise CollectiveTimeout(f"rank {self.rank}: {what}: waited for rank {peer} "
                                            f"(pid {self._segs[peer].q[Q_PID]}){where}") from None
                if backoff.count > backoff.spins and q[index] < target:
                    now = time.monotonic()
                    if now >= self._next_check:
                        self._next_check = now + PEER_CHECK_SECONDS
                        lost = self._lost_peer(relevant)
                        if lost is None and self._records is not None:
                            lost = self._records.check_waiting([peer], lambda _: q[index] < target)
                        if lost is not None and q[index] < target:
                            raise lost
        finally:
            if block is not None and self._records is not None:
                self._records.waiting(0, 0)

    @staticmethod
    def _reason(seg: _Segment) -> str:
        n = min(int(seg.q[Q_REASON_LEN]), REASON_MAX)
        return bytes(seg.mv[REASON_OFFSET:REASON_OFFSET + n]).decode("utf-8", "replace") or "unknown reason"

    # ------------------------------------------------------------- lifecycle

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Make every peer's pending and future waits raise the error
        ``reason`` encodes; a peer still finishing a call before ``seq`` (the
        first this rank did not complete) finishes it. The first reason
        stays: later aborts (echoes of the first failure) keep it."""
        try:
            seg = self._segs[self.rank]
            if seg.q[Q_ABORT]:
                return
            data = reason.encode("utf-8", "replace")[:REASON_MAX]
            seg.mv[REASON_OFFSET:REASON_OFFSET + len(data)] = data
            seg.q[Q_REASON_LEN] = len(data)
            if seq is None:  # the call it is in, or its last
                now = self._records.current() if self._records is not None else None
                seq = now[0] if now is not None else 0
            first = seq & signature.SEQ_MASK
            seg.q[Q_ABORT_SEQ] = first
            seg.q[Q_ABORT] = 1
            for r, peer in enumerate(self._segs):  # each peer looks at its own inbox first
                if r != self.rank and not peer.q[Q_INBOX]:
                    peer.q[Q_INBOX] = (first << 32) | (self.rank + 1)
            self._ring_all()
        except Exception:
            pass

    def close(self) -> None:
        """Release the mappings (idempotent). Peers waiting on this rank get PeerLost."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._segs[self.rank].q[Q_CLOSED] = 1
                self._ring_all()
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
