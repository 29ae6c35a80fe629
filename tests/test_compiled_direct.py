"""The shared window's direct compiled calls (allgather, alltoall, scatter,
bcast, gather read peers' buffers by cross-memory attach in one C call):
right results in every block, nothing written outside a buffer, the path
really taken; a mismatch, a read past a peer's buffer (signature checks off)
and a peer gone before the read are errors on every rank, in bounded time,
naming what happened."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

from collectives.algorithms.window.state import WindowState
from collectives.algorithms.window.tuning import compiled_direct
from collectives.transports.shm.copy_race import NEVER
from collectives.bench.faults import guarded, intact
from harness import attempt, run_ranks, wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux")

COLLECTIVES = ("allgather", "alltoall", "scatter", "bcast", "gather")
BOUND = 5.0  # seconds: every failure here is found at the call's first synchronisation


def _direct_runs(comm) -> int:
    """How many of the window's prepared calls are direct compiled calls
    whose last run read its peers directly (one with a fallback on the
    window may not have)."""
    st = comm.transport.window.kept.get(WindowState)
    if st is None:
        return 0
    return sum(1 for v in st.cache.values() if getattr(getattr(v, "on_arrays", None), "__len__", None)
               and getattr(getattr(v.on_arrays[0], "__self__", None), "last_direct", 0))


def _counts(p: int, n: int, uneven: bool) -> list[int]:
    """Per-rank block sizes: n each, or n, 0, 3n, n + 1, ... (one rank without any)."""
    if not uneven:
        return [n] * p
    return [(n, 0, 3 * n, n + 1)[r % 4] for r in range(p)]


def _one(comm, collective: str, counts: list[int], root: int) -> tuple[bool, bool]:
    """One call on guarded buffers holding a ramp unique per rank and
    element: (every element right, every guard intact)."""
    p, r = comm.size, comm.rank
    total = sum(counts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int)

    def ramp(rank: int, n: int, offset: int = 0) -> np.ndarray:
        return (rank * 1_000_000 + offset + np.arange(n)).astype(np.float64)

    raws, ns = [], []

    def buf(values: np.ndarray) -> np.ndarray:
        raw, view = guarded(values.size, "float64", 0)
        view[:] = values
        raws.append(raw)
        ns.append(values.size)
        return view

    if collective == "allgather":
        out = buf(np.zeros(total))
        out[starts[r]:starts[r] + counts[r]] = ramp(r, counts[r])
        comm.allgatherv(out[starts[r]:starts[r] + counts[r]].copy(), out, counts)
        want = np.concatenate([ramp(q, counts[q]) for q in range(p)])
    elif collective == "alltoall":
        b = counts[0]
        x, out = buf(ramp(r, b * p)), buf(np.zeros(b * p))
        comm.alltoall(x, out)
        want = np.concatenate([ramp(q, b, r * b) for q in range(p)])
    elif collective == "scatter":
        send = buf(ramp(root, total)) if r == root else None
        out = buf(np.zeros(counts[r]))
        comm.scatterv(send, out, counts, root)
        want = ramp(root, counts[r], starts[r])
    elif collective == "bcast":
        out = buf(ramp(root, total) if r == root else np.zeros(total))
        comm.bcast(out, root)
        want = ramp(root, total)
    else:  # gather
        x = buf(ramp(r, counts[r]))
        out = buf(np.zeros(total)) if r == root else None
        comm.gatherv(x, out, counts, root)
        want = np.concatenate([ramp(q, counts[q]) for q in range(p)]) if r == root else None
    right = want is None or np.array_equal(out, want)
    return right, intact(raws, ns)


def every_case(comm, sizes: list[int]) -> dict:
    """Every collective, even and uneven blocks, roots 0 and the last; each
    case twice (the second from the prepared call)."""
    bad, took = [], {}
    for collective in COLLECTIVES:
        for n in sizes:
            for uneven in (False, True):
                if uneven and collective in ("alltoall", "bcast"):
                    continue
                counts = _counts(comm.size, n, uneven)
                for root in sorted({0, comm.size - 1}):
                    for turn in range(2):
                        before = _direct_runs(comm)
                        right, guards = _one(comm, collective, counts, root)
                        if not (right and guards):
                            bad.append(f"{collective} counts={counts} root={root} turn={turn}: "
                                       f"right={right} intact={guards}")
                    took[collective] = took.get(collective, 0) + (_direct_runs(comm) > before)
    return {"bad": bad, "direct": _direct_runs(comm), "took": took}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_direct_calls_are_right_stay_in_their_buffers_and_are_taken(monkeypatch, p):
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")  # every size below the pool's direct path
    for r, got in enumerate(run_ranks(every_case, p, [1, 7, 40_000], timeout=120)):
        assert not got["bad"], f"rank {r}: " + "; ".join(got["bad"])
        assert got["direct"] > 0, f"rank {r}: no direct compiled call was made"


def test_the_default_sizes_take_the_direct_call_where_the_table_says():
    """With a core each, allgather, alltoall and scatter of 256 KiB at 2 ranks take it where a
    cross-memory read beats the window's two copies; bcast and gather do not; below the size from
    which the read wins, none. Every span ends where the pool's direct path's span begins
    (tuning.POOL_SPAN), which a pooled call takes over."""
    from collectives.algorithms.window.tuning import direct_from, direct_where_huge
    for collective in COLLECTIVES:
        assert compiled_direct(collective, 256 << 10, 2, 2) == (collective in ("allgather", "alltoall", "scatter"))
        assert not compiled_direct(collective, 256 << 10, 2, 2, cma_from=1 << 20)
        assert not compiled_direct(collective, 64 << 10, 2, 2)
        assert not compiled_direct(collective, 64 << 10, 4, 2)
        for p, cores in ((2, 2), (3, 2), (4, 2), (8, 2), (8, 4)):
            start = direct_from(collective, p, cores)
            for cma_from in (0, 1 << 20, NEVER):
                assert not any(compiled_direct(collective, n, p, cores, cma_from) for n in (start, 2 * start, 64 << 20))
    assert not any(compiled_direct(c, n, 2, 2, cma_from=NEVER) for c in COLLECTIVES
                   for n in (1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20))
    # from the size the race found on, the table for a read that wins
    assert compiled_direct("alltoall", 1 << 20, 2, 2, 1 << 20) and not compiled_direct("alltoall", 512 << 10, 2, 2, 1 << 20)
    assert compiled_direct("alltoall", (4 << 20) - 1, 2, 2) and compiled_direct("scatter", (4 << 20) - 1, 2, 2)
    # where ranks share cores: alltoall's from 256 KiB and scatter's from 128 KiB where the read wins;
    # below the race's size scatter's from blocks of 512 KiB (up to its pool's span, 4 MiB)
    assert compiled_direct("gather", 512 << 10, 4, 2) and compiled_direct("scatter", 128 << 10, 4, 2)
    assert not compiled_direct("gather", 512 << 10, 4, 2, NEVER) and not compiled_direct("scatter", 1 << 20, 4, 2, NEVER)
    for p, first in ((3, 1536 << 10), (4, 2 << 20), (5, 2560 << 10)):
        assert compiled_direct("scatter", first, p, 2, NEVER) and not compiled_direct("scatter", first - p, p, 2, NEVER)
    assert compiled_direct("alltoall", 256 << 10, 4, 2) and compiled_direct("alltoall", (2 << 20) - 1, 4, 2)
    assert not any(compiled_direct("alltoall", n, p, 2, NEVER) for p in (3, 4, 8) for n in (256 << 10, 1 << 20))
    for cma_from in (0, 1 << 20, NEVER):
        assert not any(compiled_direct("allgather", n, 4, 2, cma_from) for n in (1 << 20, 4 << 20, 64 << 20))
    # bcast's and gather's from 512 KiB up to their pools' spans where the read wins (huge pages), never
    # below the race's size
    for c, end in (("bcast", 4 << 20), ("gather", 8 << 20)):
        assert compiled_direct(c, 512 << 10, 4, 2) and compiled_direct(c, end - 1, 4, 2)
        assert not compiled_direct(c, end, 4, 2) and not compiled_direct(c, (512 << 10) - 1, 4, 2)
        assert not any(compiled_direct(c, n, 4, 2, NEVER) for n in (512 << 10, 1 << 20, 4 << 20, 64 << 20))
    # allgather's where ranks share cores: huge pages only, whatever the race says, from blocks of
    # 256 KiB up to its pool's span (DIRECT_FROM: 4 MiB at 3 and 4 ranks, 8 MiB at 8 on 2 cores)
    for p, first, end in ((3, 768 << 10, 4 << 20), (4, 1 << 20, 4 << 20), (8, 2 << 20, 8 << 20)):
        for cma_from in (0, 1 << 20, NEVER):
            assert direct_where_huge("allgather", first, p, 2, cma_from)
            assert direct_where_huge("allgather", end - 1, p, 2, cma_from)
            assert not direct_where_huge("allgather", first - p, p, 2, cma_from)
            assert not direct_where_huge("allgather", end, p, 2, cma_from)


def test_bcast_has_no_span_with_a_fallback_where_its_window_call_runs_in_pieces():
    """A fallback's copies are whole, and bcast's window call in pieces (where
    ranks have a core each) ran twice as fast as whole: there bcast reads
    directly with a fallback nowhere its window call runs (below the pool's
    direct path). Where ranks share cores a window call runs whole anyway."""
    from collectives.algorithms.window.tuning import direct_from, direct_where_huge

    for p, cores in ((2, 0), (2, 2), (3, 4), (4, 4), (8, 0)):
        for shift in range(10, 27):
            n = 1 << shift
            assert not (direct_where_huge("bcast", n, p, cores, NEVER) and n < direct_from("bcast", p, cores)), \
                (p, cores, n)


def _allgather_direct_runs(comm) -> tuple:
    before = _direct_runs(comm)
    _one(comm, "allgather", [32 << 10] * comm.size, 0)  # 2 x 256 KiB of float64
    return comm.transport.cma_from, _direct_runs(comm) - before


@pytest.mark.parametrize("faster", ["1", "0"])
def test_the_race_picks_the_direct_call(monkeypatch, faster):
    """The rendezvous's answer picks the path (here set, not raced)."""
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", faster)
    if (os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    want = (0 if faster == "1" else NEVER, int(faster == "1"))
    assert run_ranks(_allgather_direct_runs, 2, timeout=60) == [want, want]


def mismatched(comm, collective: str, n: int) -> dict:
    """Rank 1 passes one more element per block: every rank raises in this call."""
    counts = [n + (comm.rank == 1)] * comm.size
    seen = {}
    got = attempt(lambda: seen.update(guards=_one(comm, collective, counts, 0)[1]))
    return dict(got, guards=seen.get("guards", True))


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_mismatch_is_caught_on_every_rank_before_any_read(monkeypatch, collective):
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")
    for r, g in enumerate(run_ranks(mismatched, 3, collective, 20_000, timeout=60, comm_timeout=10)):
        assert g["outcome"] == "MismatchedCollective", f"rank {r}: {g['outcome']}: {g['message']}"
        assert re.search(rf"rank {r}[:,] {collective} #1", g["message"]), f"rank {r}: {g['message']}"
        assert g["elapsed"] < BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
        assert g["guards"], f"rank {r}: a guard was written"


def unchecked(comm) -> dict:
    """With signature checks off (for measuring only), rank 1's blocks are
    larger: rank 1 would read past rank 0's buffer, and refuses to."""
    n = 20_000 + 30_000 * comm.rank  # rank 1 reads 50,000 elements of rank 0's 40,000
    raw, x = guarded(n, "float64", comm.rank + 1)
    raw_out, out = guarded(n * comm.size, "float64", 0)
    got = attempt(lambda: comm.allgather(x, out))
    return dict(got, guards=intact([raw, raw_out], [n, n * comm.size]))


def test_a_read_past_a_peers_buffer_is_refused_even_with_checks_off(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SIGNATURE_CHECKS", "0")
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")
    got = run_ranks(unchecked, 2, timeout=60, comm_timeout=5)
    for r, g in enumerate(got):
        assert g["guards"], f"rank {r}: wrote outside its buffer"
        assert g["outcome"] != "ok", f"rank {r}: a call with different sizes completed"
        assert g["elapsed"] < 5 + BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
    message = got[1]["message"]
    assert got[1]["outcome"] == "MismatchedCollective", message
    assert "rank 1, allgather #1" in message and "would read outside rank 0's buffer" in message, message
    assert "rank 1" in got[0]["message"], got[0]["message"]  # rank 0 learns of it from rank 1


def peer_gone(comm) -> dict:
    """Rank 1 posts its allgather and is killed while it waits for rank 0;
    rank 0 then makes the call: the read of rank 1's memory fails, and rank 0
    names rank 1 as dead."""
    x = np.arange(40_000, dtype=np.float64)
    out = np.zeros(80_000)
    comm.allgather(x, out)  # the prepared direct call, made on both ranks
    if comm.rank == 1:
        comm.allgather(x, out)  # rank 0 kills this process once its post is visible
        return {"outcome": "not killed"}
    from collectives.transports.shm.layout import Q_PID, Q_POST
    from collectives.transports.shm.liveness import exited
    own, peer = comm.transport._segs[0].q, comm.transport._segs[1].q
    deadline = time.monotonic() + 30
    # rank 1's post of its second call (a step ahead of this rank)
    wait_until(lambda: peer[Q_POST] > own[Q_POST], deadline, "rank 1 never posted")
    pid = int(peer[Q_PID])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: exited(pid), deadline, "rank 1 did not exit")  # its memory is gone once it is a zombie
    return attempt(lambda: comm.allgather(x, out))


def test_a_peer_gone_before_the_read_is_named_as_dead(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")
    outcomes = run_ranks(peer_gone, 2, timeout=60, comm_timeout=10, expect_errors=True)
    assert not outcomes[1].ok, str(outcomes[1])  # killed
    assert outcomes[0].ok, str(outcomes[0])
    got = outcomes[0].value
    message = got["message"]
    assert got["outcome"] == "PeerLost", f"{got['outcome']}: {message}"
    assert "rank 0, allgather #2" in message and "rank 1" in message and "died" in message, message
    assert got["elapsed"] < BOUND, f"took {got['elapsed']:.1f} s"


def overwrite_at_once(comm, collective: str, rounds: int) -> list[str]:
    """Each rank overwrites what others read from it as soon as the call
    returns: a direct call must not return before its readers are done."""
    p, r = comm.size, comm.rank
    n = 60_000  # elements per block: each read takes far longer than an overwrite's start
    send = np.zeros(n * p)
    recv = np.zeros(n * p if collective == "alltoall" else n)
    bad = []
    for i in range(rounds):
        send[:] = i * 10 + r
        if collective == "scatter":
            comm.scatter(send if r == 0 else None, recv, 0)
            want = i * 10  # the root's value
        else:
            comm.alltoall(send, recv)
            want = None
        send[:] = -1.0  # at once
        if collective == "scatter" and not np.all(recv == want):
            bad.append(f"round {i}: {np.unique(recv)[:4]}")
        if collective == "alltoall":
            expect = np.repeat(np.arange(p) + i * 10, n)
            if not np.array_equal(recv, expect):
                bad.append(f"round {i}: {np.unique(recv)[:4]}")
    return bad


@pytest.mark.parametrize("collective", ["scatter", "alltoall"])
def test_no_rank_returns_while_others_still_read_its_buffer(monkeypatch, collective):
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")
    for r, bad in enumerate(run_ranks(overwrite_at_once, 3, collective, 300, timeout=120)):
        assert not bad, f"rank {r}: " + "; ".join(bad[:5])


def peer_stopped(comm, limit: float) -> dict:
    """Rank 1 posts its allgather and is stopped (SIGSTOP) before it reads;
    rank 0 then makes the call: it reads rank 1's buffer, waits for rank 1
    to be done with its own, times out naming rank 1 and resumes it; rank 1
    then finds rank 0's abort and raises without completing the call."""
    x = np.arange(40_000, dtype=np.float64)
    out = np.zeros(80_000)
    comm.allgather(x, out)  # the prepared direct call, made on both ranks
    if comm.rank == 1:
        return attempt(lambda: comm.allgather(x, out))
    from collectives.transports.shm.layout import Q_PID, Q_POST
    own, peer = comm.transport._segs[0].q, comm.transport._segs[1].q
    deadline = time.monotonic() + 30
    wait_until(lambda: peer[Q_POST] > own[Q_POST], deadline, "rank 1 never posted")  # its second call's post
    pid = int(peer[Q_PID])
    os.kill(pid, signal.SIGSTOP)
    got = attempt(lambda: comm.allgather(x, out, timeout=limit))
    os.kill(pid, signal.SIGCONT)
    return got


def test_a_peer_stopped_after_its_post_is_a_timeout_and_it_learns_of_it(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", "1")
    limit = 2.0
    got = run_ranks(peer_stopped, 2, limit, timeout=60, comm_timeout=20)
    message = got[0]["message"]
    assert got[0]["outcome"] == "CollectiveTimeout", f"rank 0: {got[0]['outcome']}: {message}"
    assert "rank 0" in message and "allgather #2" in message and "rank 1" in message, message
    assert limit <= got[0]["elapsed"] < limit + BOUND, f"rank 0: took {got[0]['elapsed']:.1f} s"
    message = got[1]["message"]
    assert got[1]["outcome"] != "ok", "rank 1 completed a call its peer had given up on"
    assert "rank 1" in message and "allgather #2" in message and "rank 0" in message, f"{got[1]['outcome']}: {message}"
