"""The window's direct path in Python writes into peers' buffers (allreduce
from its DIRECT_FROM on writes the reduced pieces into every buffer): a
rank stopped before it writes, and resumed once a peer gave up on the call
(a timeout) and returned to its caller, raises without writing into that
peer's buffer, which the caller may already use again."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from collectives.bench.pages import empty
from harness import attempt, mark_done, resume_when_done, run_ranks, wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux")

BOUND = 5.0  # seconds past the call's timeout


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc/pid/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def writer_stopped(comm, limit: float, marker: str) -> dict:
    """Allreduce of 8 MiB in huge pages, the direct path (rank 1 stops itself
    in its third call, once it has read rank 0's piece and before it
    writes); rank 0 times out, fills its buffer and resumes rank 1, which
    must raise without writing; rank 0's buffer keeps what it filled in."""
    n = 1 << 20  # float64: 8 MiB
    x = empty(n, np.float64, "huge")
    window = comm.transport.window
    if not window.huge_pages(x):
        return {"skip": "the kernel gave no huge pages"}
    for _ in range(2):
        x[:] = 1.0
        comm.allreduce(x)
    if comm.rank == 1:
        from collectives.algorithms.window import direct

        armed = [True]
        inside = direct.Readers.inside

        def stop_first(self, *args):  # the first check of a piece's bounds, before its writes
            if armed[0]:
                armed[0] = False
                os.kill(os.getpid(), signal.SIGSTOP)
            return inside(self, *args)

        direct.Readers.inside = stop_first
        x[:] = 1.0
        try:
            got = attempt(lambda: comm.allreduce(x))
        finally:
            direct.Readers.inside = inside
        mark_done(marker)
        return dict(got, stopped=not armed[0])
    from collectives.transports.shm.layout import Q_PID
    pid = int(comm.transport._segs[1].q[Q_PID])
    x[:] = 1.0
    got = attempt(lambda: comm.allreduce(x, timeout=limit))
    x[:] = -1.0  # the caller uses its buffer again
    deadline = time.monotonic() + 30
    wait_until(lambda: _stopped(pid), deadline, "rank 1 never stopped")  # it did before this call timed out
    resume_when_done(pid, marker, deadline)  # its call returns or raises
    got["kept"] = bool(np.all(x == -1.0))
    return got


def test_a_writer_resumed_after_its_peer_gave_up_does_not_write(tmp_path):
    limit = 2.0
    got = run_ranks(writer_stopped, 2, limit, str(tmp_path / "done"), timeout=90, comm_timeout=20)
    if "skip" in got[0] or "skip" in got[1]:
        pytest.skip(got[0].get("skip") or got[1].get("skip"))
    assert got[1]["stopped"], "rank 1 never reached the direct path's writes"
    assert got[0]["outcome"] == "CollectiveTimeout", got[0]
    assert "rank 0" in got[0]["message"] and "allreduce #3" in got[0]["message"] and "rank 1" in got[0]["message"]
    assert limit <= got[0]["elapsed"] < limit + BOUND, got[0]
    assert got[0]["kept"], "rank 1 wrote into rank 0's buffer after rank 0 gave up on the call"
    assert got[1]["outcome"] != "ok", "rank 1 completed a call its peer had given up on"
    assert "rank 1" in got[1]["message"] and "allreduce #3" in got[1]["message"] and "rank 0" in got[1]["message"]
