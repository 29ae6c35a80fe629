"""Prepared calls run straight from C (:mod:`collectives.fast_calls`): they
run (the counter of C hits goes up), give the reference's results, count
calls as the Python path does, miss rather than guess where the objects
differ, and fail as the Python path fails: a peer killed, stopped or
aborting, the communicator aborted or closed, a new selector, a mismatch
against a rank on the Python path."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from collectives import CollectiveError, compiled
from collectives.selection import RuleSelector
from harness import run_ranks
from reference import data, expect_equal, reduced
from test_fault_injection import _resume_stopped_children

pytestmark = pytest.mark.skipif(not compiled.built, reason="the C extension is not built here")


def _outcome(fn) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return "ok", "", time.monotonic() - t0
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0


def counted(comm, n: int) -> list[str]:
    """Every kept kind from C, with results and call numbers as on the Python
    path (``n`` float32 a block: 24, the window calls; 32768, allgather's
    direct calls, in place on a view of its buffer made in C)."""
    p, me, failures = comm.size, comm.rank, []
    mine = data(me, n, "float32")
    every = np.concatenate([data(r, n, "float32") for r in range(p)])
    for rep in range(4):
        seq, hits = comm._seq, comm._fast.hits
        x = mine.copy()
        comm.allreduce(x)
        expect_equal(failures, f"allreduce #{rep}", x, reduced(p, n, "float32", "sum"))
        x = mine.copy()
        comm.reduce(x, root=p - 1)
        expect_equal(failures, f"reduce #{rep}", x, reduced(p, n, "float32", "sum") if me == p - 1 else mine)
        b = mine.copy()
        comm.bcast(b, root=0)
        expect_equal(failures, f"bcast #{rep}", b, data(0, n, "float32"))
        out = np.zeros(n * p, np.float32) if me == 0 else None
        comm.gather(mine, out, root=0)
        if me == 0:
            expect_equal(failures, f"gather #{rep}", out, every)
        block = np.zeros(n, np.float32)
        comm.scatter(every if me == 0 else None, block, root=0)
        expect_equal(failures, f"scatter #{rep}", block, every[me * n:(me + 1) * n])
        out = np.zeros(n, np.float32)
        comm.reduce_scatter(np.concatenate([mine] * p), out)
        expect_equal(failures, f"reduce_scatter #{rep}", out, reduced(p, n, "float32", "sum"))
        send = np.concatenate([data(me, n, "float32", salt=r + 1) for r in range(p)])
        out = np.zeros(n * p, np.float32)
        comm.alltoall(send, out)
        expect_equal(failures, f"alltoall #{rep}", out,
                     np.concatenate([data(r, n, "float32", salt=me + 1) for r in range(p)]))
        out = np.zeros(n * p, np.float32)
        out[me * n:(me + 1) * n] = mine
        comm.allgather(None, out)  # in place
        expect_equal(failures, f"allgather #{rep}", out, every)
        out = np.zeros(n * p, np.float32)
        comm.allgather(mine, out)  # out of place: the block copied in once every rank agreed
        expect_equal(failures, f"allgather out of place #{rep}", out, every)
        out = np.zeros(n, np.float32)
        x = mine.copy()
        comm.allreduce(x, out=out)
        expect_equal(failures, f"allreduce out of place #{rep}", out, reduced(p, n, "float32", "sum"))
        expect_equal(failures, f"allreduce out of place #{rep}: its input", x, mine)
        comm.barrier()
        if comm._seq != seq + 11:
            failures.append(f"round {rep}: 11 calls counted as {comm._seq - seq}")
        if rep >= 2 and comm._fast.hits != hits + 11:
            failures.append(f"round {rep}: {comm._fast.hits - hits} of 11 calls ran from C")
    return failures


@pytest.mark.parametrize("n", [24, 32768])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_kept_calls_run_from_c_and_count_alike(p, n):
    for r, failures in enumerate(run_ranks(counted, p, n, timeout=120)):
        assert not failures, f"rank {r}: {failures}"


def other_objects(comm) -> list[str]:
    """Equal objects that are not the kept ones miss, and the Python path runs
    them right; another array of the kept dtype and size (a view) is the kept call."""
    p, failures = comm.size, []
    x = np.ones(8, np.float32)
    for _ in range(3):
        comm.allreduce(x, "max")
    hits = comm._fast.hits
    op = "".join(["m", "ax"])  # equal to "max", not the same object
    for _ in range(3):
        y = np.full(8, comm.rank + 1, np.float32)
        comm.allreduce(y, op)
        expect_equal(failures, "an equal op", y, np.full(8, p, np.float32))
    if comm._fast.hits != hits:
        failures.append("a call with an equal op (another object) ran from C")
    view = np.zeros(16, np.float32)[4:12]  # another array, inside a larger one: the same call
    view[:] = comm.rank + 1
    comm.allreduce(view, "max")
    expect_equal(failures, "a view", view, np.full(8, p, np.float32))
    if comm._fast.hits != hits + 1:
        failures.append("a view of the kept dtype and size did not run from C")
    reshaped = np.full(8, comm.rank + 1, np.float32)
    comm.allreduce(reshaped, "max")
    hits = comm._fast.hits
    reshaped.shape = (2, 4)  # the same object, now two-dimensional: not the kept call
    reshaped[...] = comm.rank + 1
    comm.allreduce(reshaped, "max")
    expect_equal(failures, "reshaped in place", reshaped.ravel(), np.full(8, p, np.float32))
    if comm._fast.hits != hits:
        failures.append("a two-dimensional array ran from C")
    for i in range(100):  # more calls than the table keeps: it starts over, results stay right
        z = np.full(i + 1, comm.rank + 1, np.float32)
        comm.allreduce(z, "max")
        comm.allreduce(z, "max")
        expect_equal(failures, f"size {i + 1}", z, np.full(i + 1, p, np.float32))
    if comm._fast.generation < 1:
        failures.append("the table never started over")
    return failures


def test_other_objects_miss_and_a_full_table_starts_over():
    for r, failures in enumerate(run_ranks(other_objects, 2, timeout=120)):
        assert not failures, f"rank {r}: {failures}"


def after_state_changes(comm) -> list[str]:
    """A new selector forgets the kept calls; a closed communicator refuses."""
    failures = []
    x = np.ones(8, np.float32)
    for _ in range(3):
        comm.allreduce(x)
    comm.selector = RuleSelector()
    hits = comm._fast.hits
    comm.allreduce(x)
    if comm._fast.hits != hits:
        failures.append("a call ran from C after a new selector")
    comm.close()
    outcome = _outcome(lambda: comm.allreduce(x))
    if "closed" not in outcome[1]:
        failures.append(f"after close: {outcome}")
    return failures


def overlapping_out(comm) -> list[str]:
    """An out-of-place allreduce kept for apart arrays; then out overlapping
    buf: it misses, and the Python path runs it (from a copy of buf). An
    allgather whose send buffer is its own block runs from C; one whose
    send buffer reaches past it misses."""
    failures = []
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    for _ in range(3):
        comm.allreduce(x, out=out)
    both = np.ones(12, np.float32)
    hits = comm._fast.hits
    comm.allreduce(both[:8], out=both[4:])
    expect_equal(failures, "overlapping out", both[4:], np.full(8, comm.size, np.float32))
    if comm._fast.hits != hits:
        failures.append("overlapping out ran from C")
    p, me = comm.size, comm.rank
    recv = np.zeros(8 * p + 1, np.float32)
    for i in range(4):  # the send buffer is this rank's own block: from C from the third call on
        hits = comm._fast.hits
        recv[me * 8:(me + 1) * 8] = me + i
        comm.allgather(recv[me * 8:(me + 1) * 8], recv[:8 * p])
        expect_equal(failures, f"allgather of its own block #{i}", recv[:8 * p], np.repeat(np.arange(p, dtype=np.float32) + i, 8))
        if i >= 2 and comm._fast.hits != hits + 1:
            failures.append(f"allgather of its own block #{i} did not run from C")
    hits = comm._fast.hits
    recv[me * 8 + 1:(me + 1) * 8 + 1] = -1.0
    comm.allgather(recv[me * 8 + 1:(me + 1) * 8 + 1], recv[:8 * p])  # past its own block: a copy aside first
    expect_equal(failures, "allgather past its own block", recv[:8 * p], np.full(8 * p, -1.0, np.float32))
    if comm._fast.hits != hits:
        failures.append("allgather past its own block ran from C")
    return failures


def test_overlapping_out_of_place_arrays_miss():
    for r, failures in enumerate(run_ranks(overlapping_out, 2, timeout=60)):
        assert not failures, f"rank {r}: {failures}"


def test_a_new_selector_or_a_closed_communicator_misses():
    for r, failures in enumerate(run_ranks(after_state_changes, 2, timeout=60)):
        assert not failures, f"rank {r}: {failures}"


def mismatch_against_python(comm, p_field: str):
    """Rank 0 runs its kept call from C; rank 1 makes a call it never made
    (the Python path): both raise MismatchedCollective naming the field."""
    x = np.ones(8, np.float32)
    for _ in range(3):
        comm.allreduce(x)
    hits = comm._fast.hits
    if comm.rank == 1:
        y = np.ones(8, np.float64) if p_field == "dtype" else np.ones(9, np.float32)
        got = _outcome(lambda: comm.allreduce(y))
    else:
        got = _outcome(lambda: comm.allreduce(x))
    return got + (comm._fast.hits - hits,)


@pytest.mark.parametrize("field", ["dtype", "count"])
def test_a_call_from_c_against_one_on_the_python_path_is_a_mismatch_on_every_rank(field):
    words = {"dtype": "float64", "count": "x 9"}[field]
    for r, (outcome, message, elapsed, hits) in enumerate(run_ranks(mismatch_against_python, 3, field,
                                                                     timeout=60)):
        assert outcome == "MismatchedCollective", f"rank {r}: {outcome} {message}"
        assert words in message and "allreduce #4" in message, f"rank {r}: {message}"
        assert elapsed < 3.0, f"rank {r}: {elapsed:.2f} s"
        assert hits == (0 if r == 1 else 1), f"rank {r}: {hits} calls from C"


def peer_fails(comm, how: str):
    """The call is kept on every rank; then rank 1 is killed, stopped or
    aborts, and the others' next call (from C) must say so."""
    x = np.ones(16, np.float32)
    for _ in range(3):
        comm.allreduce(x)
    if comm.rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes it once the others gave up
        if how == "aborts":
            comm.abort("the application gave up")
            return ("aborted",) + _outcome(lambda: comm.allreduce(x))
    hits = comm._fast.hits
    return _outcome(lambda: comm.allreduce(x)) + (comm._fast.hits - hits,)


@pytest.mark.parametrize("how", ["killed", "stopped", "aborts"])
def test_a_peer_lost_during_a_call_from_c_is_named_on_every_rank(how):
    timeout = 2.0
    if how == "stopped":
        threading.Thread(target=_resume_stopped_children, daemon=True).start()
    outcomes = run_ranks(peer_fails, 3, how, timeout=60, comm_timeout=timeout, expect_errors=True)
    want = {"killed": ("PeerLost", "died"), "stopped": ("CollectiveTimeout", "has not arrived"),
            "aborts": ("PeerLost", "the application gave up")}[how]
    for o in outcomes:
        if o.rank == 1:
            if how == "aborts":
                assert o.ok and o.value[1] == "PeerLost", str(o)  # its own later call raises too
            continue
        assert o.ok, str(o)
        outcome, message, elapsed, hits = o.value
        assert outcome == want[0], f"rank {o.rank}: {outcome} {message}"
        assert "rank 1" in message and want[1] in message and "allreduce #4" in message, \
            f"rank {o.rank}: {message}"
        assert elapsed < timeout + 1.5, f"rank {o.rank}: {elapsed:.1f} s"
        assert hits == 1, f"rank {o.rank}: the call did not run from C"


def waits_let_threads_run(comm, flag: str) -> tuple[int, int]:
    """Rank 0 waits in a barrier from C while its other thread must run for
    rank 1 to come: the thread watches, under the GIL, for the call number
    to move (the call from C has begun), then writes ``flag``, which rank 1
    waits for before its barrier. A wait that kept the GIL would keep the
    thread from ever seeing it (and rank 1 from coming)."""
    for _ in range(3):
        comm.barrier()  # kept, so the next one runs from C
    hits = comm._fast.hits
    if comm.rank == 0:
        done = threading.Event()
        before = comm._fast.seq

        def flag_once_inside() -> None:
            deadline = time.monotonic() + 30
            while comm._fast.seq == before and time.monotonic() < deadline:
                pass  # bytecode, under the GIL
            with open(flag, "w") as f:
                f.write("go")
            done.set()

        threading.Thread(target=flag_once_inside, daemon=True).start()
        comm.barrier()
        assert done.wait(5)
    else:
        deadline = time.monotonic() + 10
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "rank 0's thread never ran while rank 0 waited"
            time.sleep(0.001)
        comm.barrier()
    return comm._fast.hits - hits, comm.rank


def test_a_wait_from_c_lets_other_threads_run(tmp_path, monkeypatch):
    """A compiled wait holds the GIL for its first checks only (about 2 us),
    then lets go of it while it spins or yields. The yielding is made to
    last 60 s here, so that a wait that kept the GIL would stay in C past
    rank 1's deadline rather than hand the wait back to Python."""
    monkeypatch.setenv("COLLECTIVES_SHM_YIELD_US", str(60_000_000))
    flag = str(tmp_path / "go")
    for hits, rank in run_ranks(waits_let_threads_run, 2, flag, timeout=60, comm_timeout=15):
        assert hits == 1, f"rank {rank}: the barrier did not run from C"
