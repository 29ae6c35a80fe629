"""Where everything lies in a rank's segment: the control page's words, the
rings, the window region and the pool; segment names; default sizes.

Every rank creates one segment in ``/dev/shm`` (named by
:func:`segment_path`); every rank's has the same layout (:class:`Layout`):

* a control page of 8-byte words, indices ``Q_*`` below, each written by
  its owner only unless said otherwise (the hot ones each in a cache line
  of their own), then the abort reason and the refusal reason as bytes;
* the control lines of the rings this rank *receives* on (one per sender:
  the sender's head counter and this rank's tail counter, a cache line each);
* the ring data, one single-producer single-consumer byte ring per sender;
* the shared window region (``window`` bytes, see :mod:`.window`);
* the shared allocation pool (sparse: pages cost memory only once touched).
"""

from __future__ import annotations

import hashlib
import glob
import mmap
import os
import re

from .pages import PAGE

__all__ = ["SHM_DIR", "MAGIC", "LINE", "MiB", "WINDOW_HEADER_BYTES", "Layout", "Segment", "segment_path",
           "job_paths", "default_ring_bytes", "align"]

SHM_DIR = "/dev/shm"
MAGIC = 0x636F6C6C5F73686D  # "coll_shm"
LINE = 64  # bytes in a cache line
MiB = 1 << 20

# ------------------------------------------------------------ the control page (word indices)

Q_MAGIC, Q_PID, Q_SIZE, Q_RING, Q_WINDOW, Q_ALLOC, Q_SECRET = 0, 1, 2, 3, 4, 5, 6
Q_ATTACHED = 8           # line 1: set once this rank has mapped every peer
# line 1, the rendezvous's copy race (:mod:`.copy_race`): rank 1's round, its fastest copy
# into the window (ns) and its private buffer's address; rank 0's rounds done, its state
# and its answer (bytes from which a cross-memory read wins)
Q_RACE_ROUND, Q_RACE_COPY_IN, Q_RACE_BUFFER, Q_RACE_DONE, Q_RACE_VERDICT, Q_RACE_FROM = 9, 10, 11, 12, 13, 14
Q_ABORT, Q_REASON_LEN, Q_ABORT_SEQ = 16, 17, 18  # line 2; the first call the aborter did not complete
Q_CLOSED = 24            # line 3
Q_PROBE, Q_CMA = 25, 26  # cross-memory attach probe address; 1 ok, 2 not permitted
Q_COMPILED = 27          # 1 when this rank runs the window's compiled path (all ranks must, or none)
Q_EPOCH = 32             # line 4: fence epoch
Q_SLEEP = 48             # line 6 (apart from the epoch's 128 bytes): 1 while this rank
                         # blocks on it (a futex), until a peer wakes it
Q_POST, Q_DONE = 64, 80  # lines 8 and 10: the last window step whose data this rank
                         # posted, and the last it is done reading (compiled calls)
#: Word index of the first call record slot (:mod:`.records`): right after
#: the window post counter, so both share one cache line.
Q_RECORD = 65
#: A compiled call in pieces: (step << 20) | the 64-byte lines of its region
#: this rank has filled in that step (the last word of the post's line; the
#: C extension's progress_of).
Q_PROGRESS = 71
#: Written by peers: (first call not completed) << 32 | rank + 1 of the first
#: peer that aborted this rank's job.
Q_INBOX = 72
#: While this rank blocks: what it waits for (kind << 32 | peer + 1), else 0.
Q_WAITING = 73
#: Length of this rank's refusal reason of a call in record slot 0, and
#: (the next word) in slot 1 (its bytes at ``REFUSAL_OFFSET``, a slot each).
Q_REFUSAL_LEN = 74
Q_CPUS, CPU_WORDS = 96, 16  # lines 12 and 13: the cores this rank may run on (a bit each)
# lines 14 and 15: the survivors' agreement (:mod:`.agreement`): its number, this rank's
# round << 1 | phase, its flag and its view of the failed ranks (a bitmask of VIEW_WORDS
# words); then the last agreement it decided, with its flag and view
VIEW_WORDS = 5
Q_AGREE, Q_AGREE_STATE, Q_AGREE_FLAG, Q_AGREE_VIEW = 112, 113, 114, 115
Q_AGREE_DECIDED, Q_AGREE_DECIDED_FLAG, Q_AGREE_DECIDED_VIEW = 120, 121, 122
REASON_OFFSET, REASON_MAX = 1024, 1536    # bytes of the abort reason
REFUSAL_OFFSET, REFUSAL_MAX = 2560, 768   # bytes of the refusal reason, per record slot (two)

#: Room ahead of a window's data for the algorithms' bookkeeping, so that a
#: window of ``shm_window_bytes`` holds two halves of at least half that
#: (a 2 MiB message then fits one half of the default window: with halves a
#: page short of it, 2 MiB took two steps, the second of one page, and a
#: 2-rank bcast of 2 MiB 1.3 to 1.9 times as long).
WINDOW_HEADER_BYTES = 16 * 1024


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def default_ring_bytes(size: int) -> int:
    """Ring bytes per sender: 1 MiB up to 4 ranks, shrinking so that
    ``size**2`` rings stay near 16 MiB in all, never below 64 KiB."""
    budget = (16 * MiB) // max(size * size, 1)
    ring = 1 << max(budget.bit_length() - 1, 0)
    return max(64 * 1024, min(MiB, ring))


def _job_tag(job: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "", job)
    if clean != job or len(clean) > 40:
        clean = hashlib.sha1(job.encode()).hexdigest()[:16]
    return clean


def segment_path(job: str, rank: int) -> str:
    """The name under /dev/shm of ``rank``'s segment in ``job``."""
    return f"{SHM_DIR}/coll-{_job_tag(job)}-{rank}"


def job_paths(job: str) -> list[str]:
    """The names under /dev/shm of every segment of ``job`` and of the jobs
    named ``job-...`` (communicators its ranks made with ``init(job=...)``)
    still present."""
    return glob.glob(f"{SHM_DIR}/coll-{glob.escape(_job_tag(job))}-*")


class Layout:
    """Byte offsets inside one rank's segment (the same for every rank)."""

    def __init__(self, size: int, ring: int, window: int, pool: int) -> None:
        self.size, self.ring, self.window, self.pool = size, ring, window, pool
        self.ring_ctrl = PAGE
        self.ring_data = align(PAGE + size * 2 * LINE, PAGE)
        self.window_off = align(self.ring_data + size * ring, PAGE)
        self.pool_off = align(self.window_off + window, PAGE)
        self.total = align(self.pool_off + pool, PAGE)
        self.ctrl_bytes = self.ring_data  # the part cast to 8-byte counters

    def head_index(self, sender: int) -> int:
        """Word index of the head counter of ``sender``'s ring (written by the sender)."""
        return (self.ring_ctrl + sender * 2 * LINE) // 8

    def tail_index(self, sender: int) -> int:
        """Word index of the tail counter of ``sender``'s ring (written by the receiver)."""
        return (self.ring_ctrl + sender * 2 * LINE + LINE) // 8

    def ring_slice(self, sender: int) -> slice:
        """The bytes of ``sender``'s ring data."""
        start = self.ring_data + sender * self.ring
        return slice(start, start + self.ring)


class Segment:
    """One rank's mapped segment: the mapping, its bytes (``mv``), its
    control words (``q``, 8-byte words over the control page and ring lines)
    and, for this rank's own segment, a descriptor of its file (``fd``, or -1),
    which adopted pages are made private with (see :mod:`.pages`)."""

    def __init__(self, path: str, mm: mmap.mmap, layout: Layout, fd: int = -1) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.mv = memoryview(mm)
        self.q = self.mv[:layout.ctrl_bytes].cast("Q")

    def reason(self) -> str:
        """The abort reason this rank wrote (see :meth:`~.liveness.Liveness.abort`)."""
        n = min(int(self.q[Q_REASON_LEN]), REASON_MAX)
        return bytes(self.mv[REASON_OFFSET:REASON_OFFSET + n]).decode("utf-8", "replace") or "unknown reason"

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
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
