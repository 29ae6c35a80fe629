"""Back-to-back and concurrent nonblocking collectives, and point-to-point."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks


def many_in_flight(comm):
    p, r = comm.size, comm.rank
    handles, bufs = [], []
    for i in range(12):
        n = [0, 1, 5, 1000, 70000][i % 5]
        b = np.full(n, float(r + i), np.float64)
        bufs.append((b, n, i))
        algo = ["ring", "recursive_doubling", "rabenseifner", "mst", "auto"][i % 5]
        handles.append(comm.iallreduce(b, algorithm=algo))
    g = np.zeros(3 * p, np.int32)
    hg = comm.iallgather(np.full(3, r, np.int32), g)
    bc = np.full(10, r, np.int64)
    hb = comm.ibcast(bc, root=p - 1)
    hbar = comm.ibarrier()
    errors = []
    for h, (b, n, i) in zip(handles, bufs):
        out = h.wait()
        want = sum(k + i for k in range(p))
        if out is not b or not np.all(b == want):
            errors.append(f"iallreduce {i}: {b[:3]} != {want}")
    hg.wait()
    hbar.wait()
    if not np.array_equal(g, np.repeat(np.arange(p, dtype=np.int32), 3)):
        errors.append(f"iallgather {g}")
    if not np.all(hb.wait() == p - 1):
        errors.append(f"ibcast {bc}")
    # blocking after nonblocking: completes in order
    h = comm.iallreduce(np.ones(4))
    y = np.ones(4)
    comm.allreduce(y)
    if not (h.done() and np.all(y == p)):
        errors.append("blocking call overtook a nonblocking one")
    return errors


def eager_posts(comm):
    """Under ``comm.eager()`` a post with nothing pending runs in the calling
    thread (its handle is done on return); behind a pending post it queues."""
    p, r = comm.size, comm.rank
    errors = []
    with comm.eager():
        x = np.full(5, float(r))
        h = comm.iallreduce(x)
        if not h.done() or not np.all(x == sum(range(p))):
            errors.append(f"eager iallreduce: done={h.done()} {x}")
    big = np.ones(1 << 20, np.float32)
    pending = comm.iallreduce(big)  # on the worker lane
    with comm.eager():
        y = np.full(3, float(r))
        h2 = comm.iallreduce(y)  # must not overtake the pending one
        h2.wait()
    if not pending.done() or not np.all(big == p) or not np.all(y == sum(range(p))):
        errors.append("eager post overtook a pending one")
    h3 = comm.iallreduce(np.ones(2))  # outside the block: the lane again
    h3.wait()
    if comm._eager:
        errors.append("eager mode leaked out of its block")
    return errors


def back_to_back(comm):
    p, r = comm.size, comm.rank
    errors = []
    for i in range(200):
        x = np.array([r * i], np.int64)
        comm.allreduce(x, op="max")
        if x[0] != (p - 1) * i:
            errors.append(f"iteration {i}: {x[0]}")
    return errors


def point_to_point(comm):
    p, r = comm.size, comm.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    got = np.zeros(1 << 18, np.float32)
    reqs = [comm.irecv(got, prv, tag=7)]
    small = np.zeros(3, np.int32)
    reqs.append(comm.irecv(small, prv, tag=8))
    comm.send(np.full(3, r, np.int32), nxt, tag=8)
    comm.send(np.full(1 << 18, r, np.float32), nxt, tag=7)
    for q in reqs:
        q.wait()
    ok = np.all(got == prv) and np.all(small == prv)
    return bool(ok)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_concurrent_nonblocking(p):
    for r, errs in enumerate(run_ranks(many_in_flight, p, timeout=90)):
        assert not errs, f"rank {r}: {errs}"


@pytest.mark.parametrize("p", [2, 3])
def test_eager_posts_run_inline_in_order(p):
    for r, errs in enumerate(run_ranks(eager_posts, p, timeout=60)):
        assert not errs, f"rank {r}: {errs}"


@pytest.mark.parametrize("p", [4, 8])
def test_back_to_back(p):
    for r, errs in enumerate(run_ranks(back_to_back, p, timeout=90)):
        assert not errs, f"rank {r}: {errs[:5]}"


@pytest.mark.parametrize("p", [2, 3])
def test_point_to_point_tags(p):
    assert all(run_ranks(point_to_point, p, timeout=60))


def alloc_buffers(comm):
    x = comm.alloc((4, 256), np.float32)
    x[...] = comm.rank
    comm.allreduce(x)
    z = comm.zeros(10, np.int64)
    return bool(np.all(x == sum(range(comm.size)))) and x.shape == (4, 256) and not z.any()


def test_alloc_buffers_in_collectives():
    assert all(run_ranks(alloc_buffers, 3, timeout=60))
