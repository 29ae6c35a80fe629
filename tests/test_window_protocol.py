"""The shared window's protocol under a mixed load: compiled calls (which wait
only for the ranks they read from), fenced steps of the Python algorithms
(large messages, half floats, direct reads), prepared and full-path calls,
nonblocking calls, and ranks that lag at random, in one seeded sequence that
every rank follows. Every result is checked against numpy."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harness import run_ranks
from reference import data, expect_equal, reduced

COLLECTIVES = ["bcast", "reduce", "allreduce", "gather", "scatter", "allgather", "reduce_scatter", "alltoall",
               "barrier", "iallreduce"]
#: elements per rank: one-piece plans, several pieces, direct reads (from
#: DIRECT_BYTES, set lower than the default for these tests)
DIRECT_BYTES = 512 * 1024
COUNTS = [1, 7, 300, 3000, 20_000, 150_000]
DTYPES = [("int64", "sum"), ("float32", "max"), ("float16", "sum"), ("int32", "bxor")]


def mixed_sequence(comm, seed: int, steps: int) -> list[str]:
    p, r, failures = comm.size, comm.rank, []
    plan = np.random.default_rng(seed)  # the same sequence on every rank
    lag = np.random.default_rng(seed * 1000 + r)  # each rank lags on its own
    for i in range(steps):
        coll = str(plan.choice(COLLECTIVES))
        n = int(plan.choice(COUNTS))
        dtype, op = DTYPES[int(plan.integers(len(DTYPES)))]
        root = int(plan.integers(p))
        again = int(plan.integers(1, 4))  # repeats make prepared calls
        if lag.random() < 0.1:
            time.sleep(lag.random() * 0.003)
        for k in range(again):
            salt = i * 8 + k
            what = f"step {i}.{k} {coll} n={n} {dtype} {op} root={root}"
            mine = data(r, n, dtype, op, salt)
            if coll == "bcast":
                buf = mine.copy()
                comm.bcast(buf, root)
                expect_equal(failures, what, buf, data(root, n, dtype, op, salt))
            elif coll == "reduce":
                buf = mine.copy()
                comm.reduce(buf, root, op)
                expect_equal(failures, what, buf, reduced(p, n, dtype, op, salt) if r == root else mine)
            elif coll in ("allreduce", "iallreduce"):
                buf = mine.copy()
                if coll == "iallreduce":
                    comm.iallreduce(buf, op).wait(30)
                else:
                    comm.allreduce(buf, op)
                expect_equal(failures, what, buf, reduced(p, n, dtype, op, salt))
            elif coll == "gather":
                recv = np.zeros(n * p, mine.dtype) if r == root else None
                comm.gather(mine, recv, root)
                if r == root:
                    expect_equal(failures, what, recv,
                                 np.concatenate([data(q, n, dtype, op, salt) for q in range(p)]))
            elif coll == "scatter":
                whole = data(root, n * p, dtype, op, salt)
                recv = np.zeros(n, mine.dtype)
                comm.scatter(whole if r == root else None, recv, root)
                expect_equal(failures, what, recv, whole[r * n:(r + 1) * n])
            elif coll == "allgather":
                recv = np.zeros(n * p, mine.dtype)
                comm.allgather(mine, recv)
                expect_equal(failures, what, recv, np.concatenate([data(q, n, dtype, op, salt) for q in range(p)]))
            elif coll == "reduce_scatter":
                send = data(r, n * p, dtype, op, salt)
                recv = np.zeros(n, mine.dtype)
                comm.reduce_scatter(send, recv, op)
                expect_equal(failures, what, recv, reduced(p, n * p, dtype, op, salt)[r * n:(r + 1) * n])
            elif coll == "alltoall":
                send = data(r, n * p, dtype, op, salt)
                recv = np.zeros(n * p, mine.dtype)
                comm.alltoall(send, recv)
                want = np.concatenate([data(q, n * p, dtype, op, salt)[r * n:(r + 1) * n] for q in range(p)])
                expect_equal(failures, what, recv, want)
            else:
                comm.barrier()
        if len(failures) > 5:
            break
    return failures


@pytest.fixture(autouse=True)
def _direct_reads_from_half_a_mebibyte(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(DIRECT_BYTES))


@pytest.mark.parametrize("p,seed", [(2, 1), (3, 2), (4, 3), (5, 4), (6, 5), (8, 6), (4, 7), (3, 8)])
def test_a_mixed_sequence_of_window_collectives(p, seed):
    for failures in run_ranks(mixed_sequence, p, seed, 80, timeout=240):
        assert not failures, failures


@pytest.mark.parametrize("p,seed", [(3, 9), (4, 10)])
def test_the_same_in_python_alone(monkeypatch, p, seed):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "0")  # fences everywhere, no compiled calls
    for failures in run_ranks(mixed_sequence, p, seed, 80, timeout=240):
        assert not failures, failures
