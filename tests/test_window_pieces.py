"""Compiled window calls in pieces (``COLLECTIVES_WINDOW_PIECE_BYTES``): a
reader copies or reduces each piece once its writer has filled it. Every
collective gives the reference's bits at sizes that split pieces, blocks and
cache lines unevenly; ranks that disagree about pieces (one runs a call
whole) still agree; more ranks than cores (readers wait for writers that are
not running, and block in Python); and mismatched calls in pieces are caught
on every rank before anything is read."""

from __future__ import annotations

import os

import numpy as np
import pytest

from collectives import compiled
from harness import run_ranks
from reference import data, expect_equal, reduced
from test_fault_injection import _check_mismatches, mismatch_every_field

pytestmark = pytest.mark.skipif(not compiled.built, reason="the C extension is not built here")

PIECE = 4096
#: Elements: 8 B over a piece, a piece and a half, and odd counts whose blocks
#: start off the 64-byte grid.
COUNTS = (2048 + 2, 3 * PIECE // 8, 20011, 65537)


def every_collective(comm, piece_of_rank: list[int], counts: tuple[int, ...]) -> list[str]:
    """Each collective twice (a prepared call the second time) at each count,
    against the reference; the failures."""
    os.environ["COLLECTIVES_WINDOW_PIECE_BYTES"] = str(piece_of_rank[comm.rank])
    p, me, failures = comm.size, comm.rank, []
    for n in counts:
        for dtype in ("float32", "float64", "int8"):
            mine = data(me, n, dtype)
            every = np.concatenate([data(r, n, dtype) for r in range(p)])
            for rep in range(2):
                what = f"n={n} {dtype} #{rep}"
                b = mine.copy() if me == 1 % p else np.zeros(n, mine.dtype)
                comm.bcast(b, root=1 % p)
                expect_equal(failures, f"bcast {what}", b, data(1 % p, n, dtype))
                out = np.zeros(n * p, mine.dtype) if me == 0 else None
                comm.gather(mine, out, root=0)
                if me == 0:
                    expect_equal(failures, f"gather {what}", out, every)
                block = np.zeros(n, mine.dtype)
                comm.scatter(every if me == p - 1 else None, block, root=p - 1)
                expect_equal(failures, f"scatter {what}", block, every[me * n:(me + 1) * n])
                out = np.zeros(n * p, mine.dtype)
                comm.allgather(mine, out)
                expect_equal(failures, f"allgather {what}", out, every)
                send = np.concatenate([data(me, n, dtype, salt=r + 1) for r in range(p)])
                out = np.zeros(n * p, mine.dtype)
                comm.alltoall(send, out)
                expect_equal(failures, f"alltoall {what}",
                             out, np.concatenate([data(r, n, dtype, salt=me + 1) for r in range(p)]))
                if dtype == "int8":
                    continue
                x = mine.copy()
                comm.allreduce(x)
                expect_equal(failures, f"allreduce {what}", x, reduced(p, n, dtype, "sum"))
                x = mine.copy()
                comm.reduce(x, root=0)
                expect_equal(failures, f"reduce {what}", x, reduced(p, n, dtype, "sum") if me == 0 else mine)
                big = np.concatenate([data(me, n, dtype, salt=9)] * p)
                out = np.zeros(n, mine.dtype)
                comm.reduce_scatter(big, out)
                expect_equal(failures, f"reduce_scatter {what}", out, reduced(p, n, dtype, "sum", salt=9))
    return failures


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_collective_in_pieces(p):
    """3 and 4 ranks on a 2-core machine: readers wait for writers that are not running."""
    for r, failures in enumerate(run_ranks(every_collective, p, [PIECE] * p, COUNTS, timeout=240)):
        assert not failures, f"rank {r}: {failures[:5]}"


def test_ranks_that_disagree_about_pieces_agree_on_results():
    """Rank 0 runs every call whole, rank 1 in pieces of 4 KiB, rank 2 of 8 KiB."""
    for r, failures in enumerate(run_ranks(every_collective, 3, [0, PIECE, 2 * PIECE], COUNTS[1:3],
                                           timeout=240)):
        assert not failures, f"rank {r}: {failures[:5]}"


def mismatch_in_pieces(comm, collective: str, count: int):
    os.environ["COLLECTIVES_WINDOW_PIECE_BYTES"] = str(PIECE)
    return mismatch_every_field(comm, collective, count, "auto")


@pytest.mark.parametrize("collective", ["bcast", "gather", "scatter", "allgather", "alltoall", "allreduce",
                                        "reduce", "reduce_scatter"])
@pytest.mark.parametrize("p", [2, 3])
def test_mismatches_in_pieces_are_caught_on_every_rank(collective, p):
    """Rank 1 changes one field at a time, at 3 pieces per block: every rank
    raises MismatchedCollective naming it, no guard region is written."""
    outcomes = run_ranks(mismatch_in_pieces, p, collective, 3 * PIECE // 4, timeout=120)
    _check_mismatches(outcomes, senders_may_finish=False)
