"""The flight recorder: every rank's last N collective calls, on by default.

Each communicator keeps a ring of its last ``COLLECTIVES_FLIGHT_RECORDER``
calls (default 2000, rounded up to a power of two; 0 turns it off): sequence number, collective,
algorithm, op, root, dtype, count, bytes, transport, ranks, peers, state
(scheduled, started, completed, failed), start and end times, timeout and
the error if any. Recording a call costs a few list stores and one clock
read: the signature of the call (see :mod:`collectives.signature`) already
holds what it was, and is turned into words only when the ring is read.

``peers`` are the ranks a call talks to: ``"all"`` for a collective over
every rank of the communicator (the usual case; nothing is stored per
call for it), else a list in the job's numbering: the communicator's
ranks where it was told them (:attr:`FlightRecorder.peers`: a shrunk
communicator, a host's group), or the ranks one call names
(:meth:`FlightRecorder.talks_to`). A queued nonblocking call
(``scheduled``) keeps the signature and timeout it was queued with
(:meth:`FlightRecorder.schedule`), so its record says what it is before it
starts.

The ring is written as JSON (:meth:`FlightRecorder.dump`) when a call fails
or times out, on SIGUSR1, and on demand (``comm.flight_record()``,
``comm.dump_flight_record(path)``), to ``COLLECTIVES_DEBUG_DIR`` (default
``$XDG_CACHE_HOME/collectives/flight`` or ``~/.cache/collectives/flight``),
one file per rank: ``<job>/rank<r>.json``. ``collectives trace analyze
DIR`` reads them all and names the rank at fault.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from . import config, signature

__all__ = ["FlightRecorder", "capacity", "debug_dir", "install_dump_on_signal", "STATES"]

STATES = ("scheduled", "started", "completed", "failed")
_MAX_FAILURES = 64


def capacity() -> int:
    """Calls each rank keeps (``COLLECTIVES_FLIGHT_RECORDER``; 0: off)."""
    return max(0, config.get("FLIGHT_RECORDER"))


def debug_dir() -> str:
    """Where dumps go (``COLLECTIVES_DEBUG_DIR``, else under the user's cache)."""
    where = config.get("DEBUG_DIR")
    if where:
        return where
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "collectives", "flight")


class FlightRecorder:
    """The ring of one communicator's calls.

    Args:
        capacity: calls kept (rounded up to a power of two).
        rank, size: the communicator's.
        transport: the transport's name.
        job: the job's id (names the dump's directory).
        last: ``last()`` is the latest call number (the communicator's).
        timeout: the communicator's default timeout.
        peers: the communicator's ranks in the job's numbering (None: not
            told; records then say ``"all"``, every rank of the communicator).

    Row ``seq & (capacity - 1)`` of ``ring`` (8 float64, one cache line)
    holds call ``seq``: its start and end (``start``, ``end``: seconds of the
    monotonic clock; an end before the start: still running, or failed, see
    ``failures``) and its signature record (``sigs``, three uint64 words,
    word 0 with the call number, so that a row of an older call is told
    apart). A shared window's
    compiled calls fill their calls' slots themselves (the repeated small
    calls: nothing is done for them in Python); other calls go through
    :meth:`begin` and :meth:`finish`.
    """

    def __init__(self, capacity: int, rank: int, size: int, transport: str, job: str, last,
                 timeout: float = 60.0, peers: Sequence[int] | None = None) -> None:
        self.capacity = 1 << max(0, capacity - 1).bit_length()
        self.rank, self.size, self.transport, self.job = rank, size, transport, job
        n = self.capacity
        raw = np.zeros(n * 8 + 8, np.float64)  # one 64-byte row per call, on cache-line bounds
        skip = (-raw.ctypes.data % 64) // 8
        self.ring = raw[skip:skip + n * 8].reshape(n, 8)
        self.start = self.ring[:, 0]
        self.end = self.ring[:, 1]
        self.sigs = self.ring.view(np.uint64)[:, 2:5]
        self.timeouts: dict[int, float] = {}  # calls whose timeout is not the default
        self.default_timeout = timeout
        self.scheduled: dict[int, tuple[float, signature.Sig | None, float | None]] = {}
        self.failures: dict[int, str] = {}
        #: The ranks of every call, in the job's numbering (None: all of them).
        self.peers: list[int] | None = None if peers is None else [int(r) for r in peers]
        self.call_peers: dict[int, list[int]] = {}  # calls that talk to other ranks than ``peers``
        self.last = last
        self.dumped: str | None = None

    # ------------------------------------------------------------ writing

    def begin(self, seq: int, sig: signature.Sig, start: float, timeout: float) -> None:
        """Call ``seq`` (signature ``sig`` without its number) starts."""
        i = seq & (self.capacity - 1)
        self.sigs[i] = signature.with_seq(sig, seq)
        self.start[i] = start
        if timeout != self.default_timeout:
            self.timed(seq, timeout)
        if self.scheduled:
            self.scheduled.pop(seq, None)

    def finish(self, seq: int, end: float) -> None:
        """Call ``seq`` completed."""
        self.end[seq & (self.capacity - 1)] = end

    def timed(self, seq: int, timeout: float) -> None:
        """Call ``seq`` has its own timeout."""
        if len(self.timeouts) >= self.capacity:
            self.timeouts.pop(next(iter(self.timeouts)))
        self.timeouts[seq] = timeout

    def schedule(self, seq: int, sig: signature.Sig | None = None, timeout: float | None = None) -> None:
        """Nonblocking call ``seq`` (signature ``sig`` without its number, and
        its timeout, where given) is queued, not started yet."""
        if len(self.scheduled) < 4 * self.capacity:
            self.scheduled[seq] = (time.monotonic(), sig, timeout)

    def talks_to(self, seq: int, ranks: Sequence[int]) -> None:
        """Call ``seq`` talks to ``ranks`` (job numbering), not to every rank of :attr:`peers`."""
        if len(self.call_peers) >= self.capacity:
            self.call_peers.pop(next(iter(self.call_peers)))
        self.call_peers[seq] = [int(r) for r in ranks]

    def fail(self, seq: int, error: BaseException) -> None:
        """Call ``seq`` failed with ``error``."""
        if len(self.failures) >= _MAX_FAILURES:
            self.failures.pop(next(iter(self.failures)))
        self.failures[seq] = f"{type(error).__name__}: {error}"

    # ------------------------------------------------------------ reading

    def records(self) -> list[dict]:
        """The calls kept, oldest first, as dicts (see the module docstring)."""
        out = []
        n, last = self.capacity, self.last()
        everyone: str | list[int] = "all" if self.peers is None else self.peers
        for seq in range(max(1, last - n + 1), last + 1):
            i = seq & (n - 1)
            sig = tuple(int(w) for w in self.sigs[i])
            if not sig[0] or ((sig[0] >> signature.SEQ_SHIFT) & signature.SEQ_MASK) != seq & signature.SEQ_MASK:
                continue  # no call, or an older one, in this slot
            start, end = float(self.start[i]), float(self.end[i])
            failed = self.failures.get(seq)
            state = "failed" if failed else ("completed" if end >= start else "started")
            out.append({**self._described(seq, sig), "state": state, "start": start,
                        "end": end if end >= start else None,
                        "timeout": self.timeouts.get(seq, self.default_timeout), "error": failed})
        for seq, (at, sig, timeout) in sorted(self.scheduled.items()):
            rec = {"seq": seq}
            if sig is not None:
                rec = self._described(seq, signature.with_seq(sig, seq))
            out.append({**rec, "transport": self.transport, "ranks": self.size,
                        "peers": self.call_peers.get(seq, everyone), "state": "scheduled", "scheduled": at,
                        "start": None, "end": None,
                        "timeout": self.timeouts.get(seq, self.default_timeout if timeout is None else timeout),
                        "error": None})
        return out

    def _described(self, seq: int, sig: signature.Sig) -> dict:
        """What call ``seq`` (signature ``sig``) is, in words."""
        f = signature.fields(sig)
        return {"seq": seq, "collective": f["collective"], "algorithm": f["algorithm"], "op": f["op"],
                "root": f["root"], "dtype": f["dtype"], "count": f["count"],
                "bytes": f["count"] * signature.itemsize_of(sig), "counts_digest": f["counts"] or None,
                "refused": f["refused"], "transport": self.transport, "ranks": self.size,
                "peers": self.call_peers.get(seq, "all" if self.peers is None else self.peers)}

    def snapshot(self, reason: str = "") -> dict:
        """The dump's content: who, when (both clocks, to align ranks) and the records."""
        return {"rank": self.rank, "size": self.size, "host": socket.gethostname(), "pid": os.getpid(),
                "job": self.job, "transport": self.transport, "peers": "all" if self.peers is None else self.peers,
                "reason": reason,
                "monotonic": time.monotonic(), "time": time.time(), "records": self.records()}

    def dump(self, path: str | None = None, reason: str = "") -> str:
        """Write the ring as JSON to ``path`` (default: this rank's file under
        :func:`debug_dir`); returns the path."""
        if path is None:
            path = os.path.join(debug_dir(), _safe(self.job), f"rank{self.rank}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(reason), f, indent=1)
        os.replace(tmp, path)
        self.dumped = path
        return path


def _safe(job: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job)[:80] or "job"


_recorders: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()
_installed = False
_lock = threading.Lock()


def install_dump_on_signal(recorder: FlightRecorder) -> None:
    """Dump every live recorder of this process on SIGUSR1 (where the
    signal is not taken already, and from the main thread only)."""
    global _installed
    _recorders.add(recorder)
    with _lock:
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
                return
            signal.signal(signal.SIGUSR1, _dump_all)
        except (ValueError, OSError, AttributeError):
            return
        _installed = True


def _dump_all(signum, frame) -> None:
    for rec in list(_recorders):
        try:
            rec.dump(reason="SIGUSR1")
        except OSError:
            pass
