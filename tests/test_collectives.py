"""Every (collective, algorithm) against numpy on p real processes over shared memory.

One launch per (collective, p) runs every algorithm the transport offers,
with several dtypes and ops, sizes 0, 1, p-1, one not divisible by p and
2 MiB, and roots other than 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from collectives import BadArgument
from harness import run_ranks
from reference import (DTYPE_OP_CASES, LARGE_BYTES, MOVE_DTYPES, data, dtype_of, expect_equal,
                       reduced, runnable, sizes)

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]


def _roots(p: int) -> list[int]:
    return sorted({0, p - 1, p // 2})


def _reduce_cases(p: int):
    for dtype, op in DTYPE_OP_CASES:
        for n in sizes(p):
            yield dtype, op, n
    yield "float32", "sum", LARGE_BYTES // 4


def _move_cases(p: int):
    for dtype in MOVE_DTYPES:
        for n in sizes(p):
            yield dtype, n
    yield "float32", LARGE_BYTES // 4 // max(p, 1)


def unsupported_native(algo: str, call) -> bool:
    """Run ``call``; True if a native algorithm refused the dtype/op (skipped)."""
    try:
        call()
    except BadArgument:
        if algo == "native":
            return True
        raise
    return False


def check_allreduce(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "allreduce"):
        for dtype, op, n in _reduce_cases(p):
            buf = data(r, n, dtype, op)
            if unsupported_native(algo, lambda: comm.allreduce(buf, op, algorithm=algo)):
                continue
            expect_equal(failures, f"allreduce/{algo} {dtype} {op} n={n}", buf, reduced(p, n, dtype, op))
    return failures


def check_reduce(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "reduce"):
        for i, (dtype, op, n) in enumerate(_reduce_cases(p)):
            root = _roots(p)[i % len(_roots(p))]
            buf = data(r, n, dtype, op)
            orig = buf.copy()
            if unsupported_native(algo, lambda: comm.reduce(buf, root, op, algorithm=algo)):
                continue
            want = reduced(p, n, dtype, op) if r == root else orig
            expect_equal(failures, f"reduce/{algo} {dtype} {op} n={n} root={root}", buf, want)
    return failures


def check_reduce_scatter(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "reduce_scatter"):
        for dtype, op, n in _reduce_cases(p):
            m = n // max(p, 1) if n >= p else n  # block size
            send = data(r, m * p, dtype, op)
            orig = send.copy()
            recv = np.zeros(m, dtype_of(dtype))
            if unsupported_native(algo, lambda: comm.reduce_scatter(send, recv, op, algorithm=algo)):
                continue
            want = reduced(p, m * p, dtype, op)[r * m:(r + 1) * m]
            expect_equal(failures, f"reduce_scatter/{algo} {dtype} {op} m={m}", recv, want)
            expect_equal(failures, f"reduce_scatter/{algo} sendbuf unchanged", send, orig)
        # uneven blocks (reduce_scatterv)
        counts = [(i * 3 + 1) % 5 for i in range(p)]
        send = data(r, sum(counts), "float64", "sum", salt=1)
        recv = np.zeros(counts[r], np.float64)
        comm.reduce_scatterv(send, recv, counts, "sum", algorithm=algo)
        off = sum(counts[:r])
        expect_equal(failures, f"reduce_scatterv/{algo} counts={counts}", recv,
                     reduced(p, sum(counts), "float64", "sum", salt=1)[off:off + counts[r]])
    return failures


def check_bcast(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "bcast"):
        for i, (dtype, n) in enumerate(_move_cases(p)):
            root = _roots(p)[i % len(_roots(p))]
            buf = data(r, n, dtype)
            comm.bcast(buf, root, algorithm=algo)
            expect_equal(failures, f"bcast/{algo} {dtype} n={n} root={root}", buf, data(root, n, dtype))
    return failures


def check_scatter_gather(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "scatter"):
        for i, (dtype, n) in enumerate(_move_cases(p)):
            root = _roots(p)[i % len(_roots(p))]
            full = data(root, n * p, dtype)
            recv = np.zeros(n, dtype_of(dtype))
            comm.scatter(full if r == root else None, recv, root, algorithm=algo)
            expect_equal(failures, f"scatter/{algo} {dtype} n={n} root={root}", recv, full[r * n:(r + 1) * n])
        counts = [(i * 5 + 2) % 4 for i in range(p)]
        full = data(0, sum(counts), "int32", salt=2)
        recv = np.zeros(counts[r], np.int32)
        comm.scatterv(full if r == p - 1 else None, recv, counts, p - 1, algorithm=algo)
        off = sum(counts[:r])
        expect_equal(failures, f"scatterv/{algo}", recv, full[off:off + counts[r]])
    for algo in runnable(comm, "gather"):
        for i, (dtype, n) in enumerate(_move_cases(p)):
            root = _roots(p)[i % len(_roots(p))]
            send = data(r, n, dtype)
            recv = np.zeros(n * p, dtype_of(dtype)) if r == root else None
            out = comm.gather(send, recv, root, algorithm=algo)
            if r == root:
                want = np.concatenate([data(k, n, dtype) for k in range(p)])
                expect_equal(failures, f"gather/{algo} {dtype} n={n} root={root}", out, want)
            elif out is not None:
                failures.append(f"gather/{algo}: non-root got {type(out)}")
        counts = [(i * 5 + 2) % 4 for i in range(p)]
        send = data(r, counts[r], "float64", salt=3)
        recv = np.zeros(sum(counts)) if r == 0 else None
        comm.gatherv(send, recv, counts, 0, algorithm=algo)
        if r == 0:
            want = np.concatenate([data(k, counts[k], "float64", salt=3) for k in range(p)])
            expect_equal(failures, f"gatherv/{algo}", recv, want)
    return failures


def check_allgather(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "allgather"):
        for dtype, n in _move_cases(p):
            send = data(r, n, dtype)
            recv = np.zeros(n * p, dtype_of(dtype))
            comm.allgather(send, recv, algorithm=algo)
            want = np.concatenate([data(k, n, dtype) for k in range(p)])
            expect_equal(failures, f"allgather/{algo} {dtype} n={n}", recv, want)
        counts = [(i * 7 + 3) % 5 for i in range(p)]
        send = data(r, counts[r], "int16", salt=4)
        recv = np.zeros(sum(counts), np.int16)
        comm.allgatherv(send, recv, counts, algorithm=algo)
        want = np.concatenate([data(k, counts[k], "int16", salt=4) for k in range(p)])
        expect_equal(failures, f"allgatherv/{algo} counts={counts}", recv, want)
    return failures


def check_alltoall(comm):
    p, r, failures = comm.size, comm.rank, []
    for algo in runnable(comm, "alltoall"):
        for dtype, n in _move_cases(p):
            send = data(r, n * p, dtype)
            recv = np.zeros(n * p, dtype_of(dtype))
            comm.alltoall(send, recv, algorithm=algo)
            want = np.concatenate([data(k, n * p, dtype)[r * n:(r + 1) * n] for k in range(p)])
            expect_equal(failures, f"alltoall/{algo} {dtype} n={n}", recv, want)
    for algo in runnable(comm, "barrier"):
        for _ in range(3):
            comm.barrier(algorithm=algo)
    return failures


CHECKS = {
    "allreduce": check_allreduce,
    "reduce": check_reduce,
    "reduce_scatter": check_reduce_scatter,
    "bcast": check_bcast,
    "scatter_gather": check_scatter_gather,
    "allgather": check_allgather,
    "alltoall_barrier": check_alltoall,
}


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_collective_against_numpy(name, p):
    results = run_ranks(CHECKS[name], p, timeout=240, comm_timeout=60)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def check_every_algorithm_registered(comm):
    import collectives

    return {c: sorted(collectives.algorithms_for(c)) for c in collectives.COLLECTIVES}


def test_registered_algorithm_names():
    """The names users type are all registered."""
    names = run_ranks(check_every_algorithm_registered, 1)[0]
    expected = {
        "bcast": {"binomial", "scatter_ring_allgather", "scatter_recursive_doubling_allgather",
                  "pipelined_chain", "shared_window"},
        "scatter": {"binomial", "linear"},
        "gather": {"binomial", "linear"},
        "allgather": {"ring", "recursive_doubling", "bruck", "shared_window"},
        "reduce": {"binomial", "rabenseifner"},
        "reduce_scatter": {"recursive_halving", "ring", "shared_window"},
        "allreduce": {"mst", "ring", "recursive_doubling", "rabenseifner", "shared_window"},
        "alltoall": {"pairwise", "bruck"},
        "barrier": {"dissemination"},
    }
    for c, want in expected.items():
        assert want <= set(names[c]), f"{c}: missing {want - set(names[c])}"
