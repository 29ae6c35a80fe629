"""Fault injection on shared memory: mismatched calls, bad arguments on one
rank, and ranks killed, stopped, raising or leaving; every rank's outcome,
the time it took, what its message names, and guard regions after every
buffer that must stay untouched.

The randomized mismatch campaign is ``tests/test_mismatch_fuzz.py``; the
TCP and MPI transports have their own fault tests.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time

import numpy as np
import pytest

from collectives import CollectiveError
from collectives.bench.faults import Spec, call, expected, fresh, guarded, intact, named_algorithms
from harness import attempt, run_ranks

#: Elements per block well past every window path's switch (pieces, direct reads).
LARGE = 3 << 20
BOUND = 3.0  # seconds: a mismatch or refusal is found at the first step, far sooner

REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("bcast", "reduce", "gather", "scatter")
ALL = ("allreduce", "reduce", "bcast", "allgather", "gather", "scatter", "reduce_scatter", "alltoall", "barrier")


def _mutations(collective: str) -> list[tuple[str, dict, str]]:
    """(field, change to rank 1's spec, a word the message must contain)."""
    out = [("dtype", {"dtype": "float64"}, "float64"), ("count", {"count_add": 1}, "x "),
           ("collective", {"collective": "allreduce" if collective != "allreduce" else "allgather"}, "collective")]
    if collective in REDUCING:
        out.append(("op", {"op": "max"}, "op"))
    if collective in ROOTED:
        out.append(("root", {"root": 1}, "root"))
    if collective == "barrier":
        out = [("collective", {"collective": "allreduce"}, "collective")]
    return out


def mismatch_every_field(comm, collective: str, count: int, algorithm: str):
    """Rank 1 changes one field of the call at a time: every rank raises
    MismatchedCollective in that call (or, for a rank that only sends over
    messages, at its next call), naming the field; no guard is touched."""
    report = []
    for i, (field, change, word) in enumerate(_mutations(collective)):
        c = fresh(f"m{i}")
        spec = Spec(collective, algorithm, count=count)
        if comm.rank == 1:
            change = dict(change)
            add = change.pop("count_add", 0)
            spec = spec.with_(count=spec.count + add, **change)
        got = call(c, spec)
        nxt = call(c, Spec("barrier")) if got["outcome"] == "ok" else None
        report.append((field, word, got["outcome"], got["message"], got["elapsed"], got["intact"],
                       nxt and nxt["outcome"]))
        c.close()
    return report


def _check_mismatches(outcomes, senders_may_finish: bool) -> None:
    for r, report in enumerate(outcomes):
        for field, word, outcome, message, elapsed, ok_guards, nxt in report:
            where = f"rank {r}, {field}: {outcome}: {message}"
            assert ok_guards, f"{where}: a guard region was written"
            if outcome == "ok":  # a rank that only sent learns at its next call
                assert senders_may_finish and nxt == "MismatchedCollective", where
                continue
            assert outcome == "MismatchedCollective", where
            assert elapsed < BOUND, f"{where}: took {elapsed:.2f} s"
    # every field named on the ranks that saw it first-hand (rank 0 and 1 compare each other)
    for field, word, outcome, message, *_ in outcomes[0]:
        if outcome == "MismatchedCollective":
            assert word in message, f"rank 0, {field}: message does not name it: {message}"


@pytest.mark.parametrize("collective", ALL)
@pytest.mark.parametrize("p", [2, 3])
def test_shared_window_mismatches_are_caught_on_every_rank(collective, p):
    """The default path (``auto``: the shared window), small calls (compiled calls)."""
    outcomes = run_ranks(mismatch_every_field, p, collective, 8, "auto", timeout=120)
    _check_mismatches(outcomes, senders_may_finish=False)


@pytest.mark.parametrize("collective", [c for c in ALL if c != "barrier"])
def test_shared_window_mismatches_of_large_calls(collective):
    """Past every switch to pieces and direct reads."""
    outcomes = run_ranks(mismatch_every_field, 2, collective, LARGE // 4, "auto", timeout=120)
    _check_mismatches(outcomes, senders_may_finish=False)


def mismatch_each_algorithm(comm, collective: str):
    """For every algorithm: ranks that disagree about the dtype, then about
    the algorithm itself (rank 1 takes another)."""
    algos = named_algorithms(collective, frozenset(comm.transport.capabilities))
    report = []
    for i, algo in enumerate(algos):
        for kind in ("dtype", "algorithm"):
            c = fresh(f"a{i}{kind}")
            spec = Spec(collective, algo, count=40)
            if comm.rank == 1:
                spec = (spec.with_(dtype="float64") if kind == "dtype"
                        else spec.with_(algorithm=algos[(i + 1) % len(algos)]))
            if (kind == "algorithm" and len(algos) == 1) or (kind == "dtype" and collective == "barrier"):
                c.close()
                continue
            got = call(c, spec)
            nxt = call(c, Spec("barrier")) if got["outcome"] == "ok" else None
            report.append((f"{algo}/{kind}", "float64" if kind == "dtype" else kind, got["outcome"],
                           got["message"], got["elapsed"],
                           got["intact"], nxt and nxt["outcome"]))
            c.close()
    return report


@pytest.mark.parametrize("collective", ALL)
def test_every_algorithm_catches_mismatches(collective):
    """Rooted calls over messages start with every rank's signature, so even a
    rank that only sends raises in the call itself."""
    outcomes = run_ranks(mismatch_each_algorithm, 3, collective, timeout=180)
    _check_mismatches(outcomes, senders_may_finish=collective not in ROOTED)


# ------------------------------------------------------------ bad arguments


def _root_only_cases(p: int) -> dict:
    """Arguments only the root sees, wrong on the root (rank 0)."""
    def gather_small(comm, algo):
        x = np.ones(4, np.float32)
        comm.gather(x, np.zeros(4 * p - 1, np.float32) if comm.rank == 0 else None, 0, algorithm=algo)

    def gather_dtype(comm, algo):
        x = np.ones(4, np.float32)
        comm.gather(x, np.zeros(4 * p, np.float64) if comm.rank == 0 else None, 0, algorithm=algo)

    def gather_none(comm, algo):
        comm.gather(np.ones(4, np.float32), None, 0, algorithm=algo)

    def scatter_short(comm, algo):
        comm.scatter(np.ones(4 * p - 2, np.float32) if comm.rank == 0 else None, np.zeros(4, np.float32), 0,
                     algorithm=algo)

    def scatterv_dtype(comm, algo):
        counts = [k + 1 for k in range(p)]
        comm.scatterv(np.ones(sum(counts), np.int32) if comm.rank == 0 else None,
                      np.zeros(counts[comm.rank], np.float32), counts, 0, algorithm=algo)

    def reduce_read_only(comm, algo):
        x = np.ones(4, np.float32)
        x.flags.writeable = comm.rank != 0
        comm.reduce(x, 0, algorithm=algo)

    return {"gather recvbuf too small": ("gather", gather_small), "gather recvbuf dtype": ("gather", gather_dtype),
            "gather no recvbuf": ("gather", gather_none), "scatter sendbuf short": ("scatter", scatter_short),
            "scatterv sendbuf dtype": ("scatter", scatterv_dtype),
            "reduce read-only on the root": ("reduce", reduce_read_only)}


def root_refusals(comm):
    """Every rank raises BadArgument in the call the root refuses, whatever
    the algorithm; nothing moves, and the next call works."""
    report = []
    caps = frozenset(comm.transport.capabilities)
    for name, (collective, make) in _root_only_cases(comm.size).items():
        for algo in ["auto"] + named_algorithms(collective, caps):
            t0 = time.monotonic()
            try:
                make(comm, algo)
                outcome, message = "ok", ""
            except CollectiveError as exc:
                outcome, message = type(exc).__name__, str(exc)
            elapsed = time.monotonic() - t0
            x = np.full(3, comm.rank + 1.0)
            comm.allreduce(x)
            report.append((f"{name} ({algo})", outcome, message, elapsed, float(x[0])))
    return report


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("p", [2, 3])
def test_a_roots_refusal_reaches_every_rank_and_the_next_call_works(p, transport):
    """On shared memory (the window and the named algorithms' rings) and over
    TCP, where the refusal travels in the rooted call's signature check."""
    want = p * (p + 1) / 2
    for r, report in enumerate(run_ranks(root_refusals, p, transport=transport, timeout=120)):
        for case, outcome, message, elapsed, after in report:
            assert outcome == "BadArgument", f"rank {r}, {case}: {outcome} {message}"
            assert "rank 0" in message, f"rank {r}, {case}: does not name the root: {message}"
            assert elapsed < BOUND, f"rank {r}, {case}: {elapsed:.2f} s"
            assert after == want, f"rank {r}, {case}: the next allreduce gave {after}"


def non_root_refusals(comm):
    """Rank 1, not the root, refuses a rooted call (a receive buffer of the
    wrong size, a read-only one): every rank raises BadArgument in that call,
    naming rank 1, nothing is written, and the next call works."""
    p, report = comm.size, []
    caps = frozenset(comm.transport.capabilities)
    for collective in ("bcast", "scatter", "gather"):  # (a reduce's other ranks only read their buffers)
        for algo in ["auto"] + named_algorithms(collective, caps):
            raw, x = guarded(4, "float32", comm.rank + 1)
            gathered = np.zeros(4 * p, np.float32)  # the root's receive buffer (its own block included)
            t0 = time.monotonic()
            try:
                if collective == "bcast":
                    x.flags.writeable = comm.rank != 1
                    comm.bcast(x, 0, algorithm=algo)
                elif collective == "scatter":  # (counts agree: only rank 1's buffer is wrong)
                    recv = x if comm.rank != 1 else guarded(3, "float32", 2)[1]
                    comm.scatterv(np.ones(4 * p, np.float32) if comm.rank == 0 else None, recv, [4] * p, 0,
                                  algorithm=algo)
                elif collective == "gather":
                    send = x if comm.rank != 1 else guarded(3, "float32", 2)[1]
                    comm.gatherv(send, gathered if comm.rank == 0 else None, [4] * p, 0, algorithm=algo)
                outcome, message = "ok", ""
            except CollectiveError as exc:
                outcome, message = type(exc).__name__, str(exc)
            elapsed = time.monotonic() - t0
            y = np.full(3, comm.rank + 1.0)
            comm.allreduce(y)
            report.append((f"{collective} ({algo})", outcome, message, elapsed,
                           intact([raw], [4]) and bool(np.all(x == comm.rank + 1)) and not gathered.any(),
                           float(y[0])))
    return report


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_non_roots_refusal_of_a_rooted_call_reaches_every_rank_and_the_next_call_works(transport):
    _refused_by_rank_1_everywhere(run_ranks(non_root_refusals, 3, transport=transport, timeout=120))


def _refused_by_rank_1_everywhere(reports: list[list[tuple]]) -> None:
    """Every rank's report of ``(case, outcome, message, elapsed, untouched,
    the next allreduce's sum)``: BadArgument naming rank 1, in bounded time,
    nothing written, and the next call right."""
    p = len(reports)
    for r, report in enumerate(reports):
        for case, outcome, message, elapsed, untouched, after in report:
            assert outcome == "BadArgument", f"rank {r}, {case}: {outcome} {message}"
            assert "rank 1" in message, f"rank {r}, {case}: does not name rank 1: {message}"
            assert elapsed < BOUND, f"rank {r}, {case}: {elapsed:.2f} s"
            assert untouched, f"rank {r}, {case}: a buffer or guard changed"
            assert after == p * (p + 1) / 2, f"rank {r}, {case}: the next allreduce gave {after}"


def unrooted_refusals(comm, n: int, agreed: int) -> list:
    """Rank 1 refuses alltoall, allreduce out of place, reduce_scatter and
    allgather out of place (a read-only receive buffer), after ``agreed``
    agreed calls of each (two: their prepared calls run; none: the first
    call's plan): every rank raises BadArgument in that call, naming rank
    1; no rank's buffer changes, its own block of an out-of-place call
    neither; the next call works."""
    p, r, report = comm.size, comm.rank, []
    shapes = {"alltoall": (n * p, n * p), "allreduce": (n, n), "reduce_scatter": (n * p, n),
              "allgather": (n, n * p)}
    for collective, (ns, nr) in shapes.items():
        send, (raw, recv) = np.full(ns, r + 1.0), guarded(nr, "float64", 0)
        run = (lambda: comm.allreduce(send, out=recv)) if collective == "allreduce" else (
            lambda: getattr(comm, collective)(send, recv))
        for _ in range(agreed):
            run()
        recv[:] = -3.0
        recv.flags.writeable = r != 1
        got = attempt(run)
        kept = bool(np.all(recv == -3.0)) and intact([raw], [nr]) and bool(np.all(send == r + 1.0))
        y = np.full(3, r + 1.0)
        comm.allreduce(y)
        report.append((collective, got["outcome"], got["message"], got["elapsed"], kept, float(y[0])))
    return report


@pytest.mark.parametrize("agreed", [0, 2], ids=["first-call", "prepared"])
@pytest.mark.parametrize("n", [16, 20_000, 300_000, LARGE // 4])  # float64 a block: the window, the direct and
def test_a_refusal_of_a_call_that_is_not_rooted_changes_no_buffer_on_shared_memory(n, agreed):  # pooled calls
    _refused_by_rank_1_everywhere(run_ranks(unrooted_refusals, 3, n, agreed, timeout=120))


def out_of_place_mismatches(comm, n: int, agreed: int) -> list:
    """Allreduce and allgather out of place, each on a fresh communicator,
    ``agreed`` agreed calls first; then rank 1 changes the op (allreduce)
    or its block's size (allgather): every rank raises
    MismatchedCollective in that call, and no rank's output changes (its
    own block neither: it is copied in once every rank agreed)."""
    p, r, report = comm.size, comm.rank, []
    for i, collective in enumerate(("allreduce", "allgather")):
        c = fresh(f"oop{i}")
        m = n + (r == 1) if collective == "allgather" else n
        send = np.full(m, r + 1.0)
        raw, out = guarded(m * p if collective == "allgather" else m, "float64", 0)
        for _ in range(agreed):
            (c.allreduce(send, out=out) if collective == "allreduce" else c.allgather(send[:n], out[:n * p]))
        out[:] = -3.0
        op = "max" if r == 1 else "sum"
        got = attempt(lambda: c.allreduce(send, op, out=out) if collective == "allreduce" else c.allgather(send, out))
        kept = bool(np.all(out == -3.0)) and intact([raw], [out.size]) and bool(np.all(send == r + 1.0))
        report.append((collective, got["outcome"], got["message"], got["elapsed"], kept))
        c.close()
    return report


@pytest.mark.parametrize("compiled", ["1", "0"], ids=["compiled", "python"])
@pytest.mark.parametrize("agreed", [0, 2], ids=["first-call", "prepared"])
@pytest.mark.parametrize("n", [16, 300_000, LARGE // 4])  # float64: the window, direct calls, the pool's path
def test_a_mismatched_out_of_place_call_changes_no_output(monkeypatch, n, agreed, compiled):
    monkeypatch.setenv("COLLECTIVES_COMPILED", compiled)
    _mismatched_everywhere(run_ranks(out_of_place_mismatches, 3, n, agreed, timeout=120), "#")


def _mismatched_everywhere(reports: list[list[tuple]], call: str) -> None:
    """Every rank's report of ``(collective, outcome, message, elapsed,
    kept)``: MismatchedCollective naming ``collective`` and ``call`` (its
    number, or just "#"), in bounded time, every buffer and guard kept."""
    for r, report in enumerate(reports):
        for collective, outcome, message, elapsed, kept in report:
            assert outcome == "MismatchedCollective", f"rank {r}, {collective}: {outcome} {message}"
            assert f"{collective} {call}" in message, f"rank {r}: {message}"
            assert elapsed < BOUND, f"rank {r}, {collective}: {elapsed:.2f} s"
            assert kept, f"rank {r}, {collective}: a buffer or a guard changed"


def first_calls_mismatched(comm, n: int) -> list:
    """Every collective with data on the shared window, as the first call of
    a fresh communicator, rank 1's block one element larger: every rank
    raises MismatchedCollective in that call and every buffer of every
    rank, a root's own block included, holds what it held before."""
    report = []
    for i, collective in enumerate(("allreduce", "reduce", "bcast", "allgather", "gather", "scatter",
                                    "reduce_scatter", "alltoall")):
        c = fresh(f"first{i}")
        spec = Spec(collective, "shared_window", "float64", n + (comm.rank == 1), root=1,
                    out=collective == "allreduce")
        got = call(c, spec)
        report.append((collective, got["outcome"], got["message"], got["elapsed"], got["intact"] and got["untouched"]))
        c.close()
    return report


@pytest.mark.parametrize("compiled", ["1", "0"], ids=["compiled", "python"])
@pytest.mark.parametrize("n", [16, 300_000])  # float64 a block: the window's calls, its pieces and direct paths
def test_a_first_call_that_mismatches_changes_no_buffer_on_the_shared_window(monkeypatch, n, compiled):
    monkeypatch.setenv("COLLECTIVES_COMPILED", compiled)
    _mismatched_everywhere(run_ranks(first_calls_mismatched, 3, n, timeout=120), "#1")


def refusals_in_turns(comm, n: int) -> list:
    """Out-of-place allgather and allreduce in turns, rank 1's arguments
    wrong in odd rounds (a send buffer one element short, an ``out`` of
    another dtype): every rank raises BadArgument with rank 1's reason for
    that call (one refusal follows the other at once: a slow rank still
    judging the first must not read the second's reason), and nothing
    changes. In even rounds rank 1's buffers overlap (its send buffer
    reaches past its own block, its ``out`` overlaps ``buf``), which
    peers must not see: every rank's result is right."""
    p, r, report = comm.size, comm.rank, []
    for rep in range(4):
        bad = r == 1 and rep % 2 == 1
        raw, whole = guarded(n * p + 1, "float64", -3.0)
        recv = whole[:n * p]
        recv[r * n:(r + 1) * n] = r + rep
        if r == 1 and not bad:  # overlapping, the block shifted by one element
            whole[r * n + 1:(r + 1) * n + 1] = r + rep
        send = whole[r * n + 1:(r + 1) * n + (0 if bad else 1)] if r == 1 else recv[r * n:(r + 1) * n]
        before = whole.copy()
        got = attempt(lambda: comm.allgather(send, recv))
        kept = bool(np.array_equal(whole, before)) and intact([raw], [whole.size])
        right = got["outcome"] == "ok" and bool(np.array_equal(recv, np.repeat(np.arange(p) + rep, n)))
        report.append(("allgather", rep, got["outcome"], got["message"], got["elapsed"], kept, right))
        buf = np.arange(n + 1, dtype=np.float64) + r
        x = buf[:n]
        out = np.zeros(n, np.float32) if bad else (buf[1:] if r == 1 else buf[:n])
        before = buf.copy()
        got = attempt(lambda: comm.allreduce(x, out=out))
        want = np.arange(n) * p + p * (p - 1) / 2
        right = got["outcome"] == "ok" and bool(np.array_equal(out, want))
        report.append(("allreduce", rep, got["outcome"], got["message"], got["elapsed"],
                       bool(np.array_equal(buf, before)), right))
    return report


@pytest.mark.parametrize("n", [16, 300_000])  # float64 a block: the window's calls, the direct calls
def test_refusals_in_turns_name_their_own_reasons_and_overlapping_buffers_are_right(n):
    reasons = {"allgather": "sendbuf holds", "allreduce": "out has"}
    for r, report in enumerate(run_ranks(refusals_in_turns, 3, n, timeout=120)):
        for collective, rep, outcome, message, elapsed, kept, right in report:
            case = f"rank {r}, {collective} round {rep}"
            if rep % 2 == 0:
                assert outcome == "ok" and right, f"{case}: {outcome} {message}"
                continue
            assert outcome == "BadArgument", f"{case}: {outcome} {message}"
            assert f"{collective} #" in message and reasons[collective] in message, f"{case}: {message}"
            assert r == 1 or "rank 1 refused it" in message, f"{case}: {message}"
            assert elapsed < BOUND, f"{case}: {elapsed:.2f} s"
            assert kept, f"{case}: a buffer changed"


def numpy_scalar(comm):
    """Every rank passes a numpy scalar, which cannot hold a result."""
    comm.barrier()  # every rank is past its start-up: an abort must find them all in the call
    out = []
    for value in (np.float32(1.0), np.int64(3)):
        t0 = time.monotonic()
        try:
            comm.allreduce(value)
            out.append(("ok", "", time.monotonic() - t0))
        except CollectiveError as exc:
            out.append((type(exc).__name__, str(exc), time.monotonic() - t0))
        if comm.transport.name == "zmq":
            break  # over messages a refusal of a call that is not rooted aborts the communicator
    return out


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_numpy_scalar_is_a_bad_argument_on_every_rank(transport):
    for r, report in enumerate(run_ranks(numpy_scalar, 2, transport=transport, timeout=60)):
        for kind, message, elapsed in report:
            assert kind == "BadArgument", f"rank {r}: {kind} {message}"
            assert "numpy scalar" in message and "allreduce #" in message, f"rank {r}: {message}"
            assert elapsed < BOUND, f"rank {r}: {elapsed:.2f} s"


def prepared_mismatch(comm, field: str, both_prepared: bool):
    """An allreduce repeated until it is a prepared call (the shared window's
    compiled call), then rank 1 changes ``field``: every rank raises
    MismatchedCollective in that call, naming the field, guards intact.
    ``both_prepared``: rank 1's call was made (and prepared) before too."""
    n = 8
    other = {"dtype": ("float64", n), "count": ("float32", n + 1)}[field]
    for _ in range(5):
        for dtype, count in [("float32", n)] + ([other] if both_prepared else []):
            x = np.ones(count, dtype)
            comm.allreduce(x)
            assert x[0] == comm.size
    dtype, count = other if comm.rank == 1 else ("float32", n)
    raw, x = guarded(count, dtype, 1)
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return outcome, message, time.monotonic() - t0, intact([raw], [count]), bool(np.all(x == 1))


@pytest.mark.parametrize("both_prepared", [False, True], ids=["one-side", "both-sides"])
@pytest.mark.parametrize("field", ["dtype", "count"])
@pytest.mark.parametrize("p", [2, 3])
def test_a_mismatch_of_prepared_calls_is_caught_on_every_rank(p, field, both_prepared):
    words = {"dtype": "float64", "count": "x 9"}[field]
    for r, (outcome, message, elapsed, guards, untouched) in enumerate(
            run_ranks(prepared_mismatch, p, field, both_prepared, timeout=60)):
        assert outcome == "MismatchedCollective", f"rank {r}: {outcome} {message}"
        assert words in message and "allreduce #" in message, f"rank {r}: {message}"
        assert elapsed < BOUND, f"rank {r}: {elapsed:.2f} s"
        assert guards and untouched, f"rank {r}: its buffer or a guard changed"


#: collective: (a call on x of 8 float32 per rank, rank 1's differing call, what the error names)
PREPARED_CALLS = {
    "bcast": (lambda c, x: c.bcast(x, root=0), lambda c, x: c.bcast(x, root=1), "root"),
    "reduce": (lambda c, x: c.reduce(x, root=0), lambda c, x: c.reduce(x, root=0, op="max"), "op"),
    "gather": (lambda c, x: c.gather(x, np.zeros(8 * c.size, np.float32) if c.rank == 0 else None, root=0),
               lambda c, x: c.gather(x, np.zeros(8 * c.size, np.float32), root=1), "root"),
    "reduce_scatter": (lambda c, x: c.reduce_scatter(np.ones(8 * c.size, np.float32), x),
                       lambda c, x: c.reduce_scatter(np.ones(8 * c.size, np.float32), x, op="min"), "op"),
    "alltoall": (lambda c, x: c.alltoall(np.ones(8 * c.size, np.float32), np.zeros(8 * c.size, np.float32)),
                 lambda c, x: c.alltoall(np.ones(4 * c.size, np.float32), np.zeros(4 * c.size, np.float32)),
                 "rank 1 has float32 x"),
    "allgather": (lambda c, x: c.allgather(x, np.zeros(8 * c.size, np.float32)),
                  lambda c, x: c.allgather(x[:4], np.zeros(4 * c.size, np.float32)), "rank 1 has float32 x"),
    "allreduce out of place": (lambda c, x: c.allreduce(x, out=np.zeros(8, np.float32)),
                               lambda c, x: c.allreduce(x, "max", out=np.zeros(8, np.float32)), "op"),
    "allgather in place": (lambda c, x: c.allgather(None, np.ones(8 * c.size, np.float32)),
                           lambda c, x: c.allgather(None, np.ones(8 * c.size, np.float64)), "float64"),
}


def prepared_then_different(comm, collective: str):
    """``collective`` repeated until it is a prepared call on every rank, then
    rank 1 alone makes it with another root, op or size."""
    same, different, _ = PREPARED_CALLS[collective]
    x = np.ones(8, np.float32)
    for _ in range(5):
        same(comm, x)
    t0 = time.monotonic()
    try:
        (different if comm.rank == 1 else same)(comm, x)
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return outcome, message, time.monotonic() - t0


@pytest.mark.parametrize("collective", sorted(PREPARED_CALLS))
@pytest.mark.parametrize("p", [2, 3])
def test_prepared_calls_of_every_kind_check_their_signatures(p, collective):
    """Prepared calls skip validation, never the signature check: a rank that
    changes a field of a call every rank has prepared fails it on every rank."""
    named = PREPARED_CALLS[collective][2]
    for r, (outcome, message, elapsed) in enumerate(run_ranks(prepared_then_different, p, collective, timeout=60)):
        assert outcome == "MismatchedCollective", f"rank {r}: {outcome} {message}"
        assert named in message and f"{collective.split()[0]} #" in message, f"rank {r}: {message}"
        assert elapsed < BOUND, f"rank {r}: {elapsed:.2f} s"


def one_rank_bad_argument(comm, algorithm: str):
    """Rank 1 alone passes a read-only buffer to an allreduce."""
    raw, x = guarded(64, "float32", comm.rank + 1)
    x.flags.writeable = comm.rank != 1
    t0 = time.monotonic()
    try:
        comm.allreduce(x, algorithm=algorithm)
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    elapsed = time.monotonic() - t0
    try:
        y = np.ones(2)
        comm.allreduce(y)
        after = "ok"
    except CollectiveError as exc:
        after = type(exc).__name__
    return outcome, message, elapsed, intact([raw], [64]), bool(np.all(x == comm.rank + 1)), after


@pytest.mark.parametrize("algorithm", ["auto", "ring", "recursive_doubling"])
def test_a_bad_argument_on_one_rank_is_an_error_on_every_rank(algorithm):
    """On the shared window the call is refused everywhere and the next call
    works; over messages the refusal aborts the communicator, so every rank
    still hears of it at once."""
    for r, (outcome, message, elapsed, guards, untouched, after) in enumerate(
            run_ranks(one_rank_bad_argument, 3, algorithm, timeout=60)):
        assert outcome == "BadArgument", f"rank {r}: {outcome} {message}"
        assert "rank 1" in message and "read-only" in message, f"rank {r}: {message}"
        assert elapsed < BOUND and guards, f"rank {r}"
        if algorithm == "auto":  # over messages a peer may have reduced part of a block before it heard
            assert untouched, f"rank {r}: its buffer changed"
        assert after == ("ok" if algorithm == "auto" else "BadArgument"), f"rank {r}: next call {after}"


# ------------------------------------------------------------ dying, hanging


_LOOP = [Spec("allreduce", count=8), Spec("allreduce", count=LARGE // 8), Spec("bcast", count=1000),
         Spec("allgather", count=3), Spec("reduce_scatter", count=5000), Spec("alltoall", count=2),
         Spec("barrier"), Spec("gather", count=300_000), Spec("reduce", count=10, root=1),
         Spec("reduce", count=100_000, root=0)]  # where ranks share cores, allreduce of LARGE // 8 and this
                                                 # reduce take compiled calls of two steps


def killed_at_random(comm, victim: int, at: int, seed: int):
    """Loops over collectives; ``victim`` kills itself with SIGKILL at call ``at``."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    for i in range(10_000):
        if comm.rank == victim and i == at:
            os.kill(os.getpid(), signal.SIGKILL)
        got = call(comm, rng.choice(_LOOP))
        if got["outcome"] != "ok":
            return got["outcome"], got["message"], time.monotonic() - t0, i
    return "ok", "", time.monotonic() - t0, 10_000


@pytest.mark.parametrize("p,seed", [(2, 1), (3, 2), (4, 3), (4, 4)])
def test_a_rank_killed_at_a_random_point_is_named_by_every_survivor(p, seed):
    rng = random.Random(seed)
    victim, at = rng.randrange(p), rng.randrange(1, 40)
    outcomes = run_ranks(killed_at_random, p, victim, at, seed, timeout=60, comm_timeout=10,
                         expect_errors=True)
    for o in outcomes:
        if o.rank == victim:
            assert not o.ok
            continue
        assert o.ok, str(o)
        outcome, message, elapsed, calls = o.value
        assert outcome == "PeerLost", f"rank {o.rank}: {outcome}: {message}"
        assert f"rank {victim}" in message and "died" in message, f"rank {o.rank}: {message}"
        assert elapsed < 10 + 1, f"rank {o.rank}: {elapsed:.1f} s"


def stopped(comm, timeout: float):
    """Rank 1 stops itself (SIGSTOP) before a call; the others time out."""
    x = np.ones(16, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test resumes it once the others are done
    got = call(comm, Spec("allreduce", count=16))
    return got["outcome"], got["message"], got["elapsed"]


def test_a_stopped_rank_is_a_timeout_naming_it_and_every_survivor_says_the_same():
    import threading

    timeout = 2.0
    resumer = threading.Thread(target=_resume_stopped_children, daemon=True)
    resumer.start()
    outcomes = run_ranks(stopped, 4, timeout, timeout=60, comm_timeout=timeout, expect_errors=True)
    verdicts = set()
    for o in outcomes:
        assert o.ok, str(o)
        outcome, message, elapsed = o.value
        assert outcome == "CollectiveTimeout", f"rank {o.rank}: {outcome} {message}"
        assert "rank 1" in message and "has not arrived" in message, f"rank {o.rank}: {message}"
        if o.rank != 1:
            assert elapsed < timeout + 1, f"rank {o.rank}: {elapsed:.1f} s"
            verdicts.add(message.split("has not arrived", 1)[1].split("; in the call")[0])
    assert len(verdicts) == 1, verdicts


def _resume_stopped_children() -> None:
    """SIGCONT every stopped child of this process (the stopped rank), until the test ends."""
    me = os.getpid()
    for _ in range(600):
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] == "T" and int(fields[1]) == me:
                    time.sleep(3.0)  # past the others' timeout: they must have given up on it
                    os.kill(int(pid), signal.SIGCONT)
                    return
        time.sleep(0.05)


def leaves_between_calls(comm, how: str):
    """Rank 1 raises, exits or aborts between two calls."""
    x = np.ones(8, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        if how == "exit":
            sys.exit(0)
        if how == "abort":
            comm.abort("stopped by the application")
            return "aborted", "", 0.0
        raise RuntimeError("injected")
    got = call(comm, Spec("allreduce", count=8))
    return got["outcome"], got["message"], got["elapsed"]


@pytest.mark.parametrize("how", ["raise", "exit", "abort"])
def test_a_rank_that_leaves_between_calls_is_named(how):
    outcomes = run_ranks(leaves_between_calls, 3, how, timeout=60, comm_timeout=10, expect_errors=True)
    for o in outcomes:
        if o.rank == 1:
            continue
        assert o.ok, str(o)
        outcome, message, elapsed = o.value
        assert outcome == "PeerLost", f"rank {o.rank}: {outcome} {message}"
        assert "rank 1" in message, f"rank {o.rank}: {message}"
        assert elapsed < (0.5 if how == "abort" else 3.0), f"rank {o.rank}: {elapsed:.2f} s"


def abort_reaches_waiting_peers(comm, waiting):
    """Rank 0 waits in a call; rank 1 aborts: rank 0 raises within 100 ms of it."""
    x = np.ones(8, np.float32)
    comm.allreduce(x)
    if comm.rank == 1:
        assert waiting.wait(30)  # rank 0 is entering its call (it is timed from the abort either way)
        at = time.time()
        comm.abort("the application gave up")
        return at
    waiting.set()
    try:
        comm.allreduce(x)
    except CollectiveError as exc:
        return time.time(), type(exc).__name__, str(exc)
    return time.time(), "ok", ""


def test_abort_reaches_a_waiting_peer_within_100_ms():
    waiting = multiprocessing.get_context("fork").Event()
    (seen, kind, message), aborted_at = run_ranks(abort_reaches_waiting_peers, 2, waiting, timeout=60)
    assert kind == "PeerLost" and "the application gave up" in message and "rank 1" in message
    assert seen - aborted_at < 0.1, f"{(seen - aborted_at) * 1000:.0f} ms"


def late_rank_completes_nothing(comm):
    """Rank 2 arrives after rank 0 timed out: it must fail that call too."""
    x = np.ones(8, np.float32)
    comm.allreduce(x)
    if comm.rank == 2:
        time.sleep(2.5)  # past the others' 1 s timeout
    got = call(comm, Spec("allreduce", count=8))
    return got["outcome"], got["message"]


def test_no_rank_completes_a_call_another_saw_time_out():
    for r, (outcome, message) in enumerate(run_ranks(late_rank_completes_nothing, 3, timeout=60,
                                                       comm_timeout=1.0)):
        assert outcome == "CollectiveTimeout", f"rank {r}: {outcome} {message}"
        assert "rank 2" in message, f"rank {r}: {message}"


def good_calls_after_refusals(comm):
    """Correct results of every collective on every algorithm the window offers, small and large."""
    bad = []
    for spec in [Spec(c, count=n) for c in ALL for n in (1, 8, 70_000)] + [Spec("reduce", count=9, root=1)]:
        got = call(comm, spec)
        want = expected(spec, comm.size, comm.rank)
        if got["outcome"] != "ok" or not got["intact"] or (want is not None and not np.array_equal(got["result"], want)):
            bad.append(f"{spec}: {got['outcome']} {got['message']} intact={got['intact']}")
    return bad


def test_guarded_calls_are_correct_and_stay_in_their_buffers():
    for r, bad in enumerate(run_ranks(good_calls_after_refusals, 3, timeout=120)):
        assert not bad, f"rank {r}: " + "; ".join(bad)


def unchecked_direct_reads(comm):
    """With the signature checks off (for measuring only), ranks that disagree
    about the size still never touch memory outside a buffer: direct reads
    and writes stay inside what each rank published."""
    n = (1 << 20) * (1 + comm.rank)
    raw, x = guarded(n, "float32", comm.rank + 1)
    try:
        comm.allreduce(x)
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return outcome, message, intact([raw], [n])


def test_direct_reads_stay_inside_buffers_even_with_checks_off(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SIGNATURE_CHECKS", "0")
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(1 << 20))
    for r, (outcome, message, guards) in enumerate(run_ranks(unchecked_direct_reads, 2, timeout=60,
                                                              comm_timeout=5, expect_errors=False)):
        assert guards, f"rank {r}: wrote outside its buffer"
        assert outcome in ("MismatchedCollective", "PeerLost"), f"rank {r}: {outcome} {message}"
