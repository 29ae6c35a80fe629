"""Prepared calls: repeated blocking collectives with the same signature.

The second call with the same signature (collective, algorithm, root, op,
each buffer's dtype and size) runs what the first call validated (and, for
the shared-window allreduce, the algorithm's own prepared call); these
tests check that every collective gives numpy's answer with new data each
time, and that the calls a prepared call does not cover (strided or
read-only buffers, overlapping alltoall buffers, calls queued behind
nonblocking ones, a new selector, a closed communicator) still take the
full path and behave as before.
"""

from __future__ import annotations

import numpy as np
import pytest

from collectives import BadArgument
from collectives.registry import algorithms_for
from collectives.selection import RuleSelector
from harness import run_ranks
from reference import data, expect_equal, reduced

CASES = [("float32", "sum", 2), ("float64", "max", 1000), ("int64", "sum", 4096),
         ("int32", "bxor", 70001)]


def repeated_calls(comm) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    for dtype, op, n in CASES:
        buf = np.empty(n, dtype=np.dtype(dtype))
        for salt in range(5):
            buf[...] = data(r, n, dtype, op, salt)
            got = comm.allreduce(buf, op)
            if got is not buf:
                failures.append(f"{dtype} {op} n={n}: result is not the buffer passed in")
            expect_equal(failures, f"{dtype} {op} n={n} round {salt}", buf, reduced(p, n, dtype, op, salt))
    if not any(e is not None and e.func is not e.algo.func for e in comm._prepared.values()):
        failures.append("no call ran a prepared call")
    return failures


def full_path_cases(comm) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    n = 64
    want = reduced(p, n, "float32", "sum")
    contiguous = data(r, n, "float32")
    comm.allreduce(contiguous.copy())
    comm.allreduce(contiguous.copy())  # the prepared call for (float32, 64, sum) exists now

    strided = np.zeros(2 * n, dtype=np.float32)[::2]
    frozen = contiguous.copy()
    frozen.flags.writeable = False
    for what, bad in (("strided", strided), ("read-only", frozen)):
        try:
            comm.allreduce(bad)
            failures.append(f"{what} buffer was accepted")
        except BadArgument:
            pass
    again = contiguous.copy()
    comm.allreduce(again)
    expect_equal(failures, "after refused calls", again, want)

    first, second = contiguous.copy(), contiguous.copy()
    handle = comm.iallreduce(first)
    comm.allreduce(second)  # queued behind the nonblocking call
    handle.wait(20)
    expect_equal(failures, "after iallreduce (nonblocking)", first, want)
    expect_equal(failures, "after iallreduce (blocking)", second, want)

    comm.selector = RuleSelector()
    again = contiguous.copy()
    comm.allreduce(again, algorithm="ring")
    expect_equal(failures, "named algorithm after new selector", again, want)
    again = contiguous.copy()
    comm.allreduce(again)
    expect_equal(failures, "auto after new selector", again, want)
    return failures


def _algorithms(comm, collective: str) -> list[str]:
    caps = comm.transport.capabilities
    return ["auto"] + sorted(a.name for a in algorithms_for(collective).values() if a.needs <= caps)


def every_collective_repeated(comm) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    b = 5
    root = p - 1
    for salt in range(4):  # the first call validates, the others run prepared
        mine = data(r, b, "int64", "sum", salt)
        every = [data(q, b, "int64", "sum", salt) for q in range(p)]
        for algo in _algorithms(comm, "bcast"):
            buf = mine.copy()
            comm.bcast(buf, root, algorithm=algo)
            expect_equal(failures, f"bcast/{algo} {salt}", buf, every[root])
        for algo in _algorithms(comm, "reduce"):
            buf = mine.copy()
            comm.reduce(buf, root, "sum", algorithm=algo)
            expect_equal(failures, f"reduce/{algo} {salt}", buf, reduced(p, b, "int64", "sum", salt) if r == root else mine)
        for algo in _algorithms(comm, "gather"):
            recv = np.zeros(b * p, np.int64) if r == root else None
            got = comm.gather(mine, recv, root, algorithm=algo)
            if r == root:
                expect_equal(failures, f"gather/{algo} {salt}", got, np.concatenate(every))
            elif got is not None:
                failures.append(f"gather/{algo}: a non-root got {got!r}")
        for algo in _algorithms(comm, "scatter"):
            recv = np.zeros(b, np.int64)
            comm.scatter(np.concatenate(every) if r == root else None, recv, root, algorithm=algo)
            expect_equal(failures, f"scatter/{algo} {salt}", recv, np.concatenate(every)[r * b:(r + 1) * b])
        for algo in _algorithms(comm, "allgather"):
            recv = np.zeros(b * p, np.int64)
            comm.allgather(mine, recv, algorithm=algo)
            expect_equal(failures, f"allgather/{algo} {salt}", recv, np.concatenate(every))
            recv = np.zeros(b * p, np.int64)
            recv[r * b:(r + 1) * b] = mine
            comm.allgather(None, recv, algorithm=algo)
            expect_equal(failures, f"allgather in place/{algo} {salt}", recv, np.concatenate(every))
        for algo in _algorithms(comm, "allreduce"):
            out = np.zeros(b, np.int64)
            comm.allreduce(mine, "sum", algorithm=algo, out=out)
            expect_equal(failures, f"allreduce out of place/{algo} {salt}", out, reduced(p, b, "int64", "sum", salt))
            expect_equal(failures, f"allreduce out of place/{algo} {salt}: buf", mine, data(r, b, "int64", "sum", salt))
        for algo in _algorithms(comm, "reduce_scatter"):
            send = data(r, b * p, "int64", "sum", salt)
            recv = np.zeros(b, np.int64)
            comm.reduce_scatter(send, recv, "sum", algorithm=algo)
            expect_equal(failures, f"reduce_scatter/{algo} {salt}", recv,
                         reduced(p, b * p, "int64", "sum", salt)[r * b:(r + 1) * b])
        for algo in _algorithms(comm, "alltoall"):
            send = data(r, b * p, "int64", "sum", salt)
            recv = np.zeros(b * p, np.int64)
            comm.alltoall(send, recv, algorithm=algo)
            want = np.concatenate([data(q, b * p, "int64", "sum", salt)[r * b:(r + 1) * b] for q in range(p)])
            expect_equal(failures, f"alltoall/{algo} {salt}", recv, want)
        for algo in _algorithms(comm, "barrier"):
            comm.barrier(algorithm=algo)
    kinds = {key[0] for key, entry in comm._prepared.items() if entry is not None}
    missing = {"bcast", "reduce", "allreduce", "gather", "scatter", "allgather", "reduce_scatter", "alltoall",
               "barrier"} - kinds
    if missing:
        failures.append(f"no prepared call for {sorted(missing)}")
    return failures


def refused_on_the_prepared_path(comm) -> list[str]:
    """Per-call checks still refuse what the full path refuses, after a prepared call exists."""
    p, failures = comm.size, []
    send, recv = np.arange(2 * p, dtype=np.float64), np.zeros(2 * p)
    for _ in range(2):
        comm.alltoall(send, recv)
        comm.bcast(recv, 0)
    both = np.zeros(4 * p)
    cases = [("alltoall into overlapping memory", lambda: comm.alltoall(both[:2 * p], both[p:3 * p])),
             ("bcast into a read-only buffer", lambda: comm.bcast(_frozen(2 * p), 0)),
             ("bcast into a strided buffer", lambda: comm.bcast(np.zeros(4 * p)[::2], 0))]
    for what, call in cases:
        try:
            call()
            failures.append(f"{what} was accepted")
        except BadArgument:
            pass
    comm.alltoall(send, recv)  # and the prepared call still runs right
    want = np.concatenate([np.arange(2 * p, dtype=np.float64)[comm.rank * 2:comm.rank * 2 + 2]] * p)
    expect_equal(failures, "alltoall after refusals", recv, want)
    return failures


def _frozen(n: int) -> np.ndarray:
    arr = np.zeros(n)
    arr.flags.writeable = False
    return arr


def after_close(comm) -> str:
    buf = np.ones(8, dtype=np.float32)
    comm.allreduce(buf)
    comm.allreduce(buf)
    comm.close()
    try:
        comm.allreduce(buf)
    except BadArgument as exc:
        return str(exc)
    return "no error"


def _no_failures(fn, p: int, timeout: float) -> None:
    for failures in run_ranks(fn, p, timeout=timeout):
        assert not failures, failures


@pytest.mark.parametrize("p", [2, 3, 4])
def test_repeated_allreduce_matches_numpy(p):
    _no_failures(repeated_calls, p, 120)


@pytest.mark.parametrize("p", [2, 3])
def test_calls_the_plan_does_not_cover(p):
    _no_failures(full_path_cases, p, 120)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_collective_repeated_matches_numpy(p):
    _no_failures(every_collective_repeated, p, 180)


@pytest.mark.parametrize("p", [2, 3])
def test_prepared_calls_still_refuse_bad_buffers(p):
    _no_failures(refused_on_the_prepared_path, p, 60)


def test_closed_communicator_refuses():
    for message in run_ranks(after_close, 2, timeout=60):
        assert "closed" in message
