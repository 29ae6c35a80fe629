"""Transport.irecv_reduce: receive a message and reduce it into place.

ZeroMQ reduces each segment straight from its frame; other transports use
the default (receive into scratch, reduce on completion). Both are checked
on real processes: messages posted before and after they arrive, one frame
and many segments, in place and out of place, several dtypes and ops.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from collectives.ops import get_op
from harness import run_ranks

CASES = [(n, dtype, op) for n in (0, 3, 70_000, 3_000_000)
         for dtype, op in (("float32", "sum"), ("float16", "sum"), ("int64", "max"))]


def _sent(n: int, dtype: str, k: int) -> np.ndarray:
    return ((np.arange(n) * 3 + k) % 11).astype(dtype)


def _mine(n: int, dtype: str, k: int) -> np.ndarray:
    return ((np.arange(n) * 5 + 2 * k) % 13).astype(dtype)


def exchange_and_reduce(comm, early: bool, sent) -> int:
    t = comm.transport
    if comm.rank == 0:
        reqs = [t.isend(_sent(n, dtype, k), 1, 100 + k) for k, (n, dtype, _) in enumerate(CASES)]
        sent.set()  # every message is on its way (what fits has arrived) before any receive is posted
        t.waitall(reqs, 30)
        return 0
    if early:
        assert sent.wait(30)
    checked = 0
    for k, (n, dtype, opname) in enumerate(CASES):
        op = get_op(opname)
        mine = _mine(n, dtype, k)
        want = op.ufunc(mine, _sent(n, dtype, k))
        in_place = k % 2 == 0
        out = mine if in_place else np.zeros(n, dtype)
        t.irecv_reduce(out, mine, 0, 100 + k, op, np.empty(n, dtype)).wait(30)
        assert out.dtype == want.dtype and np.array_equal(out, want), (n, dtype, opname, in_place)
        checked += 1
    return checked


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("early", [False, True])
def test_receive_and_reduce(transport, early):
    sent = multiprocessing.get_context("fork").Event()
    assert run_ranks(exchange_and_reduce, 2, early, sent, transport=transport, timeout=120)[1] == len(CASES)


def many_small_messages(comm, rounds: int) -> int:
    """Small messages of odd sizes, enough to wrap the shared-memory ring many
    times, received once they have arrived (copied or reduced straight from
    the ring) and before (posted), alternately."""
    t, op = comm.transport, get_op("sum")
    checked = 0
    for k in range(rounds):
        n = 1 + (k * 37) % 300
        if comm.rank == 0:
            t.isend(_sent(n, "float64", k), 1, k % 7).wait(30)
            if k % 50 == 49:
                comm.barrier()
            continue
        mine = _mine(n, "float64", k)
        if k % 2:
            out = np.zeros(n)
            t.irecv(out, 0, k % 7).wait(30)
            assert np.array_equal(out, _sent(n, "float64", k)), k
        else:
            out = mine.copy()
            t.irecv_reduce(out, mine, 0, k % 7, op, np.empty(n)).wait(30)
            assert np.array_equal(out, mine + _sent(n, "float64", k)), k
        if k % 50 == 49:
            comm.barrier()
        checked += 1
    return checked


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_many_small_messages_wrap_the_ring(transport):
    assert run_ranks(many_small_messages, 2, 3000, transport=transport, timeout=120)[1] == 3000
