"""Allreduce's and reduce's compiled calls of two steps, where ranks share
cores: each rank reduces 1/p of the vector, posts it in the other half, and
the others (reduce: the root) copy the reduced blocks; and their direct
calls, where those take over (test_direct_reduction.py). They must give the
bits of the paths they replace (allreduce: every element reduced in rank
order; reduce: each block by its owner, its own values first), leave
reduce's non-roots' buffers alone, take over exactly where the rule says,
and catch a mismatched call on every rank before anything is read.

Ranks share cores here either by their number (3 ranks on 2 cores) or by
pinning every rank to one core before its communicator is made."""

from __future__ import annotations

import os
from time import monotonic

import numpy as np
import pytest

from collectives import compiled, get_op
from collectives.algorithms.window.direct_reduction import takes_direct_call
from collectives.algorithms.window.state import window_state
from collectives.algorithms.window.pieces import blocks
from collectives.algorithms.window.tuning import (ALLREDUCE_TWO_STEPS_FROM, REDUCE_TWO_STEPS_FROM,
                                                  allreduce_two_steps, reduce_one_fence_limit, reduce_two_steps,
                                                  two_steps)
from collectives.bench.faults import fresh
from harness import run_ranks
from test_fault_injection import _check_mismatches, mismatch_every_field

pytestmark = pytest.mark.skipif(not compiled.built, reason="the C extension is not built here")

ITEM = 4
#: float32 elements: just below the switch, at it, blocks of uneven sizes,
#: and up to nearly a whole half of the default window.
COUNTS = (ALLREDUCE_TWO_STEPS_FROM // ITEM - 1, ALLREDUCE_TWO_STEPS_FROM // ITEM,
          ALLREDUCE_TWO_STEPS_FROM // ITEM + 3, 65537, 262144, 500001)


def _pin_to_one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _inputs(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    """Values whose sums depend on the order they are added in (int32:
    small ones, whose products do not overflow)."""
    if dtype == "int32":
        return (np.arange(n) % 3 + rank).astype(dtype)
    rng = np.random.default_rng(7919 * rank + 104729 * salt + n)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)


def _in_rank_order(p: int, n: int, dtype: str, op: str, salt: int) -> np.ndarray:
    ufunc = get_op(op).ufunc
    out = _inputs(0, n, dtype, salt)
    for r in range(1, p):
        ufunc(out, _inputs(r, n, dtype, salt), out=out)
    return out


def _owner_first(p: int, n: int, dtype: str, op: str, salt: int, root: int | None = None) -> np.ndarray:
    """Reduce's order in blocks: each block reduced by the rank that owns it,
    its own values first, then every other rank's in rank order (``root``:
    the whole vector as one block, the root's)."""
    ufunc, ins = get_op(op).ufunc, [_inputs(r, n, dtype, salt) for r in range(p)]
    out, lo = np.empty_like(ins[0]), 0
    owned = enumerate(blocks(n, p)) if root is None else [(root, n)]
    for q, c in owned:
        part = ins[q][lo:lo + c].copy()
        for r in range(p):
            if r != q:
                ufunc(part, ins[r][lo:lo + c], out=part)
        out[lo:lo + c] = part
        lo += c
    return out


def _steps_of(comm, key: tuple) -> int | str | None:
    """Steps of the compiled call the window keeps under ``key`` (None: none
    kept; "direct": allreduce's direct call, one step that reads peers' buffers)."""
    _, st = window_state(comm.transport.window, comm.size)
    run = st.cache.get(key)
    made = getattr(run, "on_arrays", None)
    if made is None:
        return None
    return "direct" if made[0].__self__.reduces else 1 + made[0].__self__.two_steps


def _communicator(pin: bool, tag: str):
    """A new communicator (its ranks first pinned to one core with ``pin``), its window and the window's state."""
    if pin:
        _pin_to_one_core()
    c = fresh(tag, timeout=30.0)
    window = c.transport.window
    return c, window, window_state(window, c.size)[1]


def allreduce_every_count(comm, pin: bool) -> list[str]:
    """Each count, dtype and op twice (the second a call from C), against the
    reduction in rank order, bit for bit; and the path each took."""
    c, window, st = _communicator(pin, "two-steps")
    p, me, failures = c.size, c.rank, []
    for n in COUNTS:
        for dtype, op in (("float32", "sum"), ("float64", "sum"), ("float32", "max"), ("int32", "prod")):
            nbytes = n * np.dtype(dtype).itemsize
            if nbytes > st.half:  # beyond both calls (in pieces, blocks are reduced in another order)
                continue
            for rep in range(2):
                x = _inputs(me, n, dtype, salt=rep)
                want = _in_rank_order(p, n, dtype, op, salt=rep)
                c.allreduce(x, op=op)
                if x.tobytes() != want.tobytes():
                    bad = int(np.flatnonzero(x != want)[0]) if x.shape == want.shape else -1
                    failures.append(f"{dtype} {op} n={n} #{rep}: differs first at {bad}")
            steps = _steps_of(c, ("allreduce", x.dtype, x.size, op))
            expect = 2 if allreduce_two_steps(nbytes, p, window.cores) else 1
            if takes_direct_call("allreduce", window, st, x, get_op(op)):  # the direct call takes over
                expect = "direct"
            if steps not in (None, expect) or (expect != 1 and steps is None):
                failures.append(f"{dtype} {op} n={n}: {steps} steps, the rule says {expect}")
            failures += _out_of_place(c, n, dtype, op, want, compiled_call=steps is not None)
    c.close()
    return failures


def _out_of_place(c, n: int, dtype: str, op: str, want: np.ndarray, compiled_call: bool) -> list[str]:
    """Out of place, three times (the first on the full path, the second
    prepared, the third from C): ``out`` gets the bits of the call in place,
    ``buf`` keeps its values, and the prepared call reads ``buf`` itself
    (no copy into ``out`` first) where the call in place is compiled. Odd
    ranks call in place meanwhile: the same signature."""
    failures, me = [], c.rank
    for rep in range(3):
        x = _inputs(me, n, dtype, salt=1)
        mine = x.copy()
        if me % 2:
            c.allreduce(x, op=op)
            got = x
        else:
            got = np.full(n, 7, dtype)
            hits = c._fast.hits
            c.allreduce(x, op=op, out=got)
            if x.tobytes() != mine.tobytes():
                failures.append(f"out of place {dtype} {op} n={n} #{rep}: buf changed")
            if rep == 2 and compiled_call and c._fast.hits != hits + 1:
                failures.append(f"out of place {dtype} {op} n={n} #{rep}: not a call from C")
        if got.tobytes() != want.tobytes():
            failures.append(f"out of place {dtype} {op} n={n} #{rep}: differs first at "
                            f"{int(np.flatnonzero(got != want)[0])}")
    entry = c._prepared.get(("allreduce", "auto", None, op, np.dtype(dtype), n, np.dtype(dtype), n))
    if me % 2 == 0 and compiled_call and (entry is None or entry.copy_in is not None or entry.direct is None):
        failures.append(f"out of place {dtype} {op} n={n}: the prepared call copies into out first")
    return failures


def reduce_every_count(comm, pin: bool) -> list[str]:
    """Reduce at each count, dtype and op, to the first and the last rank,
    twice: the root's result in reduce's order, bit for bit; the others'
    buffers unchanged; the path each took."""
    c, window, st = _communicator(pin, "two-steps-reduce")
    p, me, failures = c.size, c.rank, []
    for n in (REDUCE_TWO_STEPS_FROM // ITEM - 1, REDUCE_TWO_STEPS_FROM // ITEM + 3, 262144, 500001):
        for dtype, op in (("float32", "sum"), ("float64", "min")):
            nbytes = n * np.dtype(dtype).itemsize
            if nbytes > st.half:
                continue
            expect = 2 if reduce_two_steps(nbytes, p, window.cores) else 1
            whole = expect == 1 and nbytes <= reduce_one_fence_limit(p, window.cores)  # the root reduces alone
            for root in (0, p - 1):
                for rep in range(2):
                    mine = _inputs(me, n, dtype, salt=rep)
                    x = mine.copy()
                    c.reduce(x, root=root, op=op)
                    want = _owner_first(p, n, dtype, op, rep, root if whole else None) if me == root else mine
                    if x.tobytes() != want.tobytes():
                        failures.append(f"{dtype} {op} n={n} root {root} #{rep}: differs first at "
                                        f"{int(np.flatnonzero(x != want)[0])}")
                steps = _steps_of(c, ("reduce", x.dtype, x.size, root, op))
                if takes_direct_call("reduce", window, st, x, get_op(op)):  # the direct call takes over
                    if steps != "direct":
                        failures.append(f"{dtype} {op} n={n} root {root}: {steps} steps, not the direct call")
                elif (expect == 2 and steps != 2) or (expect == 1 and steps == 2):
                    failures.append(f"{dtype} {op} n={n} root {root}: {steps} steps, the rule says {expect}")
    c.close()
    return failures


@pytest.mark.parametrize("worker", [allreduce_every_count, reduce_every_count], ids=["allreduce", "reduce"])
@pytest.mark.parametrize("p, pin", [(2, True), (2, False), (3, False), (4, False)])
def test_two_steps_give_the_bits_of_the_paths_they_replace(worker, p, pin):
    """2 ranks pinned to one core, and 2, 3 and 4 ranks on the machine's
    cores (2 ranks with a core each: allreduce takes two steps, reduce keeps
    the root reducing alone)."""
    rule = allreduce_two_steps if worker is allreduce_every_count else reduce_two_steps
    cores = len(os.sched_getaffinity(0))
    if not pin and p != 2 and not rule(1 << 20, p, cores):
        pytest.skip(f"{p} ranks have a core each here")
    for r, failures in enumerate(run_ranks(worker, p, pin, timeout=240)):
        assert not failures, f"rank {r}: {failures[:6]}"


def pinned_mismatches(comm, collective: str, count: int, pin: bool = True):
    if pin:
        _pin_to_one_core()
    return mismatch_every_field(comm, collective, count, "auto")


@pytest.mark.parametrize("collective, count, pin", [("allreduce", ALLREDUCE_TWO_STEPS_FROM // ITEM, True),
                                                    ("allreduce", 262144, True),
                                                    ("reduce", REDUCE_TWO_STEPS_FROM // ITEM, True),
                                                    ("reduce", 262144, True),
                                                    ("allreduce", ALLREDUCE_TWO_STEPS_FROM // ITEM, False),
                                                    ("allreduce", 262144, False)])
def test_mismatched_calls_of_two_steps_are_caught_on_every_rank(collective, count, pin):
    """2 ranks on one core (and, for allreduce, each on its own); rank 1
    changes one field at a time (dtype, count, collective, op, root): every
    rank raises MismatchedCollective in that call, naming the field, and no
    guard region is touched."""
    outcomes = run_ranks(pinned_mismatches, 2, collective, count, pin, timeout=120)
    _check_mismatches(outcomes, senders_may_finish=False)


def out_of_place_mismatch(comm, count: int, field: str):
    """Rank 0 runs its kept out-of-place call from C (it reads ``buf``
    itself); rank 1 changes ``field``: both raise MismatchedCollective naming
    it, and rank 0's ``buf`` keeps its values."""
    _pin_to_one_core()
    c = fresh(f"oop-{field}", timeout=30.0)
    x, out = np.arange(count, dtype=np.float32), np.zeros(count, np.float32)
    for _ in range(3):
        c.allreduce(x, out=out)
    odd = {"count": np.arange(count + 1, dtype=np.float32), "dtype": np.arange(count, dtype=np.float64)}[field]
    mine, hits = (x, out) if c.rank == 0 else (odd, np.zeros_like(odd)), c._fast.hits
    t0 = monotonic()
    try:
        c.allreduce(mine[0], out=mine[1])
        outcome, message = "ok", ""
    except Exception as exc:
        outcome, message = type(exc).__name__, str(exc)
    took = monotonic() - t0
    kept = np.array_equal(x, np.arange(count, dtype=np.float32))
    c.close()
    return outcome, message, took, kept, c._fast.hits - hits


@pytest.mark.parametrize("field", ["count", "dtype"])
@pytest.mark.parametrize("count", [ALLREDUCE_TWO_STEPS_FROM // ITEM - 1, 262144])
def test_a_mismatch_against_an_out_of_place_call_from_c_is_caught_on_every_rank(count, field):
    """One step and two: the call that reads ``buf`` itself checks every
    signature before it reads a peer."""
    words = {"count": f"x {count + 1}", "dtype": "float64"}[field]
    for r, (outcome, message, took, kept, from_c) in enumerate(run_ranks(out_of_place_mismatch, 2, count, field,
                                                                    timeout=60)):
        assert outcome == "MismatchedCollective", f"rank {r}: {outcome} {message}"
        assert words in message and "allreduce #4" in message, f"rank {r}: {message}"
        assert took < 5.0, f"rank {r}: took {took:.2f} s"
        assert kept, f"rank {r}: buf changed"
        assert r != 0 or from_c == 1, "rank 0's call did not run from C"


def test_the_rule_takes_two_steps_only_where_ranks_share_cores():
    assert two_steps(ALLREDUCE_TWO_STEPS_FROM, 3, 2) and two_steps(1 << 20, 4, 2)
    assert not two_steps(ALLREDUCE_TWO_STEPS_FROM - 1, 4, 2)
    assert not two_steps(1 << 20, 2, 2) and not two_steps(1 << 20, 8, 0)


def test_allreduce_takes_two_steps_at_two_ranks_too_and_reduce_does_not():
    for cores in (0, 2, 8):
        assert allreduce_two_steps(ALLREDUCE_TWO_STEPS_FROM, 2, cores)
        assert not allreduce_two_steps(ALLREDUCE_TWO_STEPS_FROM - 1, 2, cores)
        assert not reduce_two_steps(1 << 20, 2, cores)
    assert allreduce_two_steps(1 << 20, 4, 2) and reduce_two_steps(REDUCE_TWO_STEPS_FROM, 3, 2)
    assert not allreduce_two_steps(1 << 20, 8, 0) and not allreduce_two_steps(1 << 20, 3, 4)
    assert not reduce_two_steps(REDUCE_TWO_STEPS_FROM - 1, 3, 2)
