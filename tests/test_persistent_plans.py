"""Prepared (persistent) plans of repeated blocking allreduce calls.

The second call with the same (dtype, count, op, algorithm) runs the plan the
first call prepared; these tests check that it gives numpy's answer with new
data each time, and that the calls the plan does not cover (strided or
read-only buffers, calls queued behind nonblocking ones, a new selector, a
closed communicator) still take the full path and behave as before.
"""

from __future__ import annotations

import numpy as np
import pytest

from collectives import BadArgument
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
    if not any(comm._persistent.values()):
        failures.append("no call ran a prepared plan")
    return failures


def full_path_cases(comm) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    n = 64
    want = reduced(p, n, "float32", "sum")
    contiguous = data(r, n, "float32")
    comm.allreduce(contiguous.copy())
    comm.allreduce(contiguous.copy())  # the plan for (float32, 64, sum) exists now

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


@pytest.mark.parametrize("p", [2, 3, 4])
def test_repeated_allreduce_matches_numpy(p):
    for failures in run_ranks(repeated_calls, p, timeout=120):
        assert not failures, failures


@pytest.mark.parametrize("p", [2, 3])
def test_calls_the_plan_does_not_cover(p):
    for failures in run_ranks(full_path_cases, p, timeout=120):
        assert not failures, failures


def test_closed_communicator_refuses():
    for message in run_ranks(after_close, 2, timeout=60):
        assert "closed" in message
