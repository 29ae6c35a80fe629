"""Uneven alltoall (``comm.alltoallv``) on real ranks: results against numpy on
shared memory and TCP, the nonblocking form, and misuse: counts two ranks
disagree on, and bad arguments on one rank only."""

from __future__ import annotations

import time

import numpy as np
import pytest

from collectives import BadArgument, CollectiveError
from harness import run_ranks

TIMEOUT = 5.0


def _counts(p: int, r: int) -> tuple[list[int], list[int]]:
    """What rank r sends to each rank, and receives from each (zeros included)."""
    sends = [(r + j) % 3 + (j == 1) for j in range(p)]
    receives = [(i + r) % 3 + (r == 1) for i in range(p)]
    return sends, receives


def _data(p: int, r: int, counts: list[int]) -> np.ndarray:
    return np.concatenate([np.full(c, 100 * r + j, np.float64) for j, c in enumerate(counts)])


def exchange(comm, nonblocking: bool):
    p, r = comm.size, comm.rank
    sends, receives = _counts(p, r)
    recv = np.full(sum(receives), -1.0)
    if nonblocking:
        comm.ialltoallv(_data(p, r, sends), sends, recv, receives).wait(timeout=20)
    else:
        comm.alltoallv(_data(p, r, sends), sends, recv, receives)
    want = np.concatenate([np.full(receives[i], 100.0 * i + r) for i in range(p)])
    again = np.ones(4)
    comm.allreduce(again)  # the next call works
    return bool(np.array_equal(recv, want)), float(again[0])


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_block_lands_where_numpy_says(transport, p):
    for nonblocking in (False, True):
        assert run_ranks(exchange, p, nonblocking, transport=transport, timeout=60) == [(True, float(p))] * p


def disagreeing_counts(comm):
    """Rank 0 sends 3 elements to rank 1, which expects 2."""
    sends, receives = ([1, 3], [1, 1]) if comm.rank == 0 else ([1, 1], [2, 1])
    start = time.monotonic()
    try:
        comm.alltoallv(np.ones(sum(sends)), sends, np.zeros(sum(receives)), receives)
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "completed", "", time.monotonic() - start


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_counts_two_ranks_disagree_on_are_an_error_on_both(transport):
    outcomes = run_ranks(disagreeing_counts, 2, transport=transport, timeout=60, comm_timeout=TIMEOUT)
    for rank, (kind, message, took) in enumerate(outcomes):
        assert kind in ("MismatchedCollective", "PeerLost"), (rank, kind, message)
        assert "alltoall" in message and took < TIMEOUT + 2, (rank, message, took)
    assert any(kind == "MismatchedCollective" for kind, _, _ in outcomes), outcomes


def one_rank_wrong(comm, what: str):
    p, r = comm.size, comm.rank
    sends, receives = _counts(p, r)
    send, recv = _data(p, r, sends), np.zeros(sum(receives))
    if r == 1 and what == "short":
        recv = np.zeros(sum(receives) - 1)
    if r == 1 and what == "dtype":
        recv = np.zeros(sum(receives), np.float32)
    start = time.monotonic()
    try:
        comm.alltoallv(send, sends, recv, receives)
    except BadArgument as exc:
        first = str(exc)
    else:
        first = "no error"
    return first, time.monotonic() - start


@pytest.mark.parametrize("what", ["short", "dtype"])
def test_a_bad_argument_on_one_rank_is_bad_argument_on_every_rank(what):
    """Every rank raises BadArgument in that call, naming rank 1 (over
    messages a refusal aborts the communicator: see docs/failures.md)."""
    outcomes = run_ranks(one_rank_wrong, 3, what, timeout=60, comm_timeout=TIMEOUT)
    for rank, (message, took) in enumerate(outcomes):
        assert "rank 1" in message and "alltoall #1" in message, (rank, message)
        assert took < TIMEOUT, (rank, took)


def test_only_the_pairwise_algorithm_takes_uneven_blocks():
    import collectives

    comm = collectives.init()
    try:
        with pytest.raises(BadArgument, match="pairwise"):
            comm.alltoallv(np.ones(2), [2], np.zeros(2), [2], algorithm="bruck")
        with pytest.raises(BadArgument, match="counts must be 1"):
            comm.alltoallv(np.ones(2), [1, 1], np.zeros(2), [2])
    finally:
        comm.close()
