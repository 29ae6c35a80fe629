"""Bad input raises before anything is sent; a failure on one rank reaches every rank."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from collectives import BadArgument, CollectiveError
from harness import run_ranks


def bad_calls(comm):
    """Every rank makes the same bad calls; each must raise BadArgument, and a
    good collective afterwards must still work (nothing was sent)."""
    p, r = comm.size, comm.rank
    x = np.ones(8, np.float32)
    nc = np.ones((4, 4), np.float32)[:, 1]
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    cases = {
        "bcast root out of range": lambda: comm.bcast(x, root=p),
        "bcast negative root": lambda: comm.bcast(x, root=-1),
        "bcast non-contiguous": lambda: comm.bcast(nc),
        "bcast read-only": lambda: comm.bcast(ro),
        "bcast unknown algorithm": lambda: comm.bcast(x, algorithm="telepathy"),
        "allreduce unknown op": lambda: comm.allreduce(x, op="median"),
        "allreduce op invalid for dtype": lambda: comm.allreduce(x, op="bxor"),
        "allreduce avg of ints": lambda: comm.allreduce(np.ones(3, np.int32), op="avg"),
        "allreduce unsupported dtype": lambda: comm.allreduce(np.array(["a", "b"])),
        "allreduce out of wrong size": lambda: comm.allreduce(x, out=np.ones(3, np.float32)),
        "allreduce not a buffer": lambda: comm.allreduce(object()),
        "reduce root out of range": lambda: comm.reduce(x, root=p + 3),
        "reduce read-only on root": lambda: comm.reduce(ro, root=r),
        "scatter wrong sendbuf size on root": lambda: comm.scatter(np.ones(p * 2 + 1), np.ones(2), root=r),
        "scatter dtype mismatch on root": lambda: comm.scatter(np.ones(p * 2, np.int32), np.ones(2), root=r),
        "gather wrong recvbuf size on root": lambda: comm.gather(np.ones(2), np.ones(2 * p + 1), root=r),
        "allgather wrong recvbuf size": lambda: comm.allgather(np.ones(2), np.ones(2 * p + 1)),
        "allgather dtype mismatch": lambda: comm.allgather(np.ones(2, np.int32), np.ones(2 * p)),
        "allgatherv wrong counts length": lambda: comm.allgatherv(np.ones(2), np.ones(2 * p), [2] * (p + 1)),
        "allgatherv negative count": lambda: comm.allgatherv(np.ones(2), np.ones(2), [-1] + [0] * (p - 1)),
        "reduce_scatter wrong sizes": lambda: comm.reduce_scatter(np.ones(p * 3 + 1), np.ones(3)),
        "send to missing rank": lambda: comm.send(x, p),
        "recv negative tag": lambda: comm.recv(x, 0, tag=-2),
        "barrier unknown algorithm": lambda: comm.barrier(algorithm="nope"),
    }
    same = np.ones(2 * p)
    cases["alltoall overlapping buffers"] = lambda: comm.alltoall(same, same)
    if p > 1:
        cases["alltoall not divisible"] = lambda: comm.alltoall(np.ones(p + 1), np.ones(p + 1))
    missed = []
    for name, call in cases.items():
        try:
            call()
        except BadArgument:
            continue
        except Exception as exc:  # wrong error type
            missed.append(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        missed.append(f"{name}: did not raise")
    y = np.full(5, r + 1.0)
    comm.allreduce(y)
    if not np.all(y == p * (p + 1) / 2):
        missed.append(f"allreduce after bad calls gave {y}")
    return missed


@pytest.mark.parametrize("p", [1, 2, 3])
def test_bad_input_raises_before_sending(p):
    for r, missed in enumerate(run_ranks(bad_calls, p, timeout=60)):
        assert not missed, f"rank {r}: " + "; ".join(missed)


def rank_raises_mid_collective(comm):
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except CollectiveError as exc:
        return type(exc).__name__, time.monotonic() - t0, str(exc)
    return "no error", time.monotonic() - t0, ""


def rank_dies_mid_collective(comm):
    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x)
    if comm.rank == comm.size - 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            comm.allreduce(x)
    except CollectiveError as exc:
        return type(exc).__name__, time.monotonic() - t0, str(exc)
    return "no error", time.monotonic() - t0, ""


@pytest.mark.parametrize("scenario", [rank_raises_mid_collective, rank_dies_mid_collective])
@pytest.mark.parametrize("p", [2, 4])
def test_failure_on_one_rank_reaches_every_rank(scenario, p):
    comm_timeout = 10.0
    outcomes = run_ranks(scenario, p, timeout=60, comm_timeout=comm_timeout, expect_errors=True)
    failed_rank = 1 if scenario is rank_raises_mid_collective else p - 1
    for o in outcomes:
        if o.rank == failed_rank:
            assert not o.ok
            continue
        assert o.ok, str(o)
        kind, waited, msg = o.value
        assert kind in ("PeerLost", "CollectiveTimeout"), f"rank {o.rank}: {kind} {msg}"
        assert waited < comm_timeout + 1.0, f"rank {o.rank} waited {waited:.1f}s"


def mismatched_sizes(comm):
    x = np.ones(100 if comm.rank == 0 else 300, np.float32)
    try:
        comm.allreduce(x, algorithm="ring")
    except CollectiveError as exc:
        return type(exc).__name__
    return "no error"


def test_mismatched_collective_is_an_error_not_a_hang():
    outcomes = run_ranks(mismatched_sizes, 2, timeout=60, comm_timeout=5, expect_errors=True)
    for o in outcomes:
        assert o.ok and o.value in ("MismatchedCollective", "PeerLost", "CollectiveTimeout"), str(o)
    assert any(o.value == "MismatchedCollective" for o in outcomes)


# -------------------------------------------------- v-counts that differ


def v_counts_differ(comm, collective: str, counts: list[int], theirs: list[int]):
    """Rank 1 passes ``theirs`` for the v-counts, every other rank ``counts``
    (the same total): every rank raises MismatchedCollective in that call."""
    mine = theirs if comm.rank == 1 else counts
    total, r = sum(mine), comm.rank
    comm.barrier()  # every rank is past its start-up: an abort must find them all in the call
    t0 = time.monotonic()
    try:
        if collective == "allgatherv":
            comm.allgatherv(np.ones(mine[r], np.float32), np.zeros(total, np.float32), mine)
        else:
            comm.reduce_scatterv(np.ones(total, np.float32), np.zeros(mine[r], np.float32), mine)
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("collective", ["allgatherv", "reduce_scatterv"])
def test_differing_v_counts_are_named(collective, transport):
    counts, theirs = [1, 2, 3], [2, 1, 3]
    outcomes = run_ranks(v_counts_differ, 3, collective, counts, theirs, transport=transport, timeout=60,
                         comm_timeout=10)
    for r, (kind, message, took) in enumerate(outcomes):
        assert kind == "MismatchedCollective", f"rank {r}: {kind}: {message}"
        assert took < 5, f"rank {r} took {took:.2f}s"
        assert "counts: " in message and "rank 1 has [2, 1, 3]" in message, f"rank {r}: {message}"
        assert "[1, 2, 3]" in message and "digest" not in message, f"rank {r}: {message}"


def test_v_counts_too_large_to_carry_are_named_where_known():
    """Counts too large for the signature's word travel as a hash: the rank
    that finds the mismatch names its own counts, and the other rank's as
    other counts (a rank that hears of it through an abort says the same)."""
    counts, theirs = [300_000, 1, 2], [300_000, 2, 1]
    outcomes = run_ranks(v_counts_differ, 3, "allgatherv", counts, theirs, timeout=60, comm_timeout=10)
    for r, (kind, message, took) in enumerate(outcomes):
        assert kind == "MismatchedCollective", f"rank {r}: {kind}: {message}"
        assert str(theirs) in message or str(counts) in message, f"rank {r}: {message}"
        assert "other counts (digest 0x" in message, f"rank {r}: {message}"
