"""From each collective's DIRECT_FROM on, the direct compiled calls that
took over the pool's direct path move a peer's array outside huge pages
(or of 4 MiB and more) out of or into the peer's shared pool, where the
pool holds it (a buffer from ``comm.alloc``, or a private buffer used
again, which the pool adopts): allgather, alltoall and bcast read there,
gather's senders write into the root's buffer there. The results are right
on every call (the first, before the pool adopts a buffer, reads across or
through the window), an adopted buffer's partial first and last pages are
moved across, nothing is written outside a buffer, peers of every kind mix,
no rank returns while a peer still moves its buffer, a read or write past a
peer's pooled buffer is refused even with signature checks off, and a
writer stopped after its post never writes once its root gave up."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from collectives.algorithms.window.state import WindowState
from collectives.algorithms.window.tuning import (DIRECT_FROM, POOLED_ACROSS, POOLED_CALLS, compiled_direct,
                                                   direct_from, direct_where_huge)
from collectives.bench.faults import guarded, intact
from collectives.bench.pages import empty
from harness import attempt, run_ranks, stopped_after_its_post

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/map_files"), reason="needs Linux")

GUARD = 64  # float64 elements of guard before and after each buffer (the buffers start off the page grid)
FILL = -7.0
BOUND = 5.0  # seconds: a refused read is found at the call's first synchronisation


@pytest.fixture(autouse=True)
def _race_says_never(monkeypatch):
    """The race's answer as on 4 KiB pages: a cross-memory read never beats
    the window's copies (the spans with a fallback are then the widest)."""
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", "0")


def _last_reads(comm) -> list[tuple[int, int, int]]:
    """(straight, through the window, from the pool) reads of the last run of
    every prepared direct call that the communicator keeps (the calls after
    its first run there)."""
    calls = [getattr(e, "call", None) for e in list(comm._prepared.values())]
    return [(c.last_direct, c.last_window, c.last_pooled) for c in calls if getattr(c, "direct", 0)]


def _window_reads(comm) -> list[tuple[int, int, int]]:
    """The same of the window's own prepared direct calls (those that run
    through the algorithm's body: gatherv's)."""
    st = comm.transport.window.kept.get(WindowState)
    calls = [getattr(v.on_arrays[0], "__self__", None) for v in (st.cache.values() if st else ())
             if getattr(getattr(v, "on_arrays", None), "__len__", None)]
    return [(c.last_direct, c.last_window, c.last_pooled) for c in calls if getattr(c, "direct", 0)]


def _placed(n: int, where: str, comm) -> tuple[np.ndarray, np.ndarray]:
    """(the whole guarded span, its n float64 after the guard): in 4 KiB pages
    ("small"), huge pages ("huge"), or the transport's pool ("alloc")."""
    whole = comm.alloc(n + 2 * GUARD, np.float64) if where == "alloc" else empty(n + 2 * GUARD, np.float64, where)
    whole[:] = FILL
    return whole, whole[GUARD:GUARD + n]


def calls(comm, collective: str, n: int, where: str, times: int) -> dict:
    """``times`` calls of ``collective`` (n float64 a block) on the same
    buffers; rank 0's in ``where``, the others' too unless ``where`` is
    "huge-0" (rank 0 in huge pages, the others in 4 KiB pages). Gather's
    root is the last rank: rank 0 writes the first block, across the
    partial first page of an adopted buffer."""
    p, r = comm.size, comm.rank
    root = p - 1 if collective == "gather" else 0
    mine = ("huge" if r == 0 else "small") if where == "huge-0" else where
    wholes = []

    def buf(count: int) -> np.ndarray:
        whole, view = _placed(count, mine, comm)
        wholes.append(whole)
        return view

    def ramp(rank: int, count: int, offset: int = 0) -> np.ndarray:
        return rank * 1_000_000 + offset + np.arange(count, dtype=np.float64)

    if collective == "alltoall":
        x, out = buf(n * p), buf(n * p)
        args, want = (x, out), np.concatenate([ramp(q, n, r * n) for q in range(p)])
    elif collective == "allgather":  # (out of place, peers read the send buffer)
        x, out = buf(n), buf(n * p)
        args, want = (x, out), np.concatenate([ramp(q, n) for q in range(p)])
    elif collective == "scatter":
        x, out = buf(n * p), buf(n)
        args, want = (x if r == 0 else None, out), ramp(0, n, r * n)
    elif collective == "bcast":
        out = buf(n)
        args, want = (None, out), ramp(0, n)
    else:  # gather
        x, out = buf(n), buf(n * p)
        args, want = (x, out if r == root else None), (np.concatenate([ramp(q, n) for q in range(p)]) if r == root
                                                        else None)
    rights = []
    for i in range(times):
        if collective == "alltoall":
            x[:] = ramp(r, n * p) + i
        elif collective == "allgather":
            out[:] = 0
            x[:] = ramp(r, n) + i
        elif collective == "scatter":
            out[:] = 0
            if r == 0:
                x[:] = ramp(0, n * p) + i
        elif collective == "bcast":
            out[:] = ramp(0, n) + i if r == 0 else 0
        else:
            x[:] = ramp(r, n) + i
        if collective == "bcast":
            comm.bcast(out, root=0)
        elif collective in ("scatter", "gather"):
            getattr(comm, collective)(*args, root=root)
        else:
            getattr(comm, collective)(*args)
        got = args[1]
        rights.append(want is None or bool(np.array_equal(got, want + i)))
    guards = all(np.all(w[:GUARD] == FILL) and np.all(w[-GUARD:] == FILL) for w in wholes)
    window = comm.transport.window
    return {"rights": rights, "guards": guards, "reads": _last_reads(comm),
            "hybrid": _with_pools(collective, n * (1 if collective == "bcast" else p) * 8, p, window)}


def _with_pools(collective: str, nbytes: int, p: int, window) -> bool:
    """Whether ``collective`` of ``nbytes`` takes a direct compiled call that
    reads peers' pools: in the pool's
    direct path's span, for the collectives a call takes it over for, where
    no direct call of the table serves (see ``compiled_calls.direct_mode``;
    allgather, which reads only huge pages or the pool there, in its
    whole span on any cores: the cases below)."""
    cores = window.cores
    return (nbytes >= direct_from(collective, p, cores) and collective in POOLED_CALLS
            and not compiled_direct(collective, nbytes, p, cores, window.cma_from)
            and (not DIRECT_FROM[collective][2] or direct_where_huge(collective, nbytes, p, cores, window.cma_from)
                 or collective in POOLED_ACROSS))


# (collective, ranks, float64 a block): from each collective's DIRECT_FROM on,
# where the pool's direct path ran before (2 ranks: allgather 2 MiB, alltoall and
# bcast 4 MiB; 3 ranks on 2 cores: alltoall 2 MiB), every published array of 1 MiB
# or more (the pool adopts no smaller one)
CASES = [("allgather", 2, 128 << 10), ("alltoall", 2, 256 << 10), ("bcast", 2, 512 << 10),
         ("gather", 2, 256 << 10), ("alltoall", 3, 96 << 10), ("gather", 3, 384 << 10),
         ("allgather", 2, 256 << 10), ("allgather", 2, 512 << 10),  # past allgather's window call: 4 and 8 MiB
         ("allgather", 4, 128 << 10), ("allgather", 4, 512 << 10)]  # 4 ranks: 4 MiB, and 16 MiB past a half


def _peer_reads(collective: str, p: int) -> int:
    """The reads of peers' blocks in one call, all ranks together (gather's
    senders write theirs into the root's buffer: those writes)."""
    return (p - 1) * (p if collective in ("alltoall", "allgather") else 1)


@pytest.mark.parametrize("faster", ["0", "1"])
@pytest.mark.parametrize("collective,p,n", CASES)
def test_a_buffer_the_pool_adopted_is_read_from_the_pool(monkeypatch, collective, p, n, faster):
    """4 KiB pages, the same buffers on every call: from the second call on
    (the pool adopts a buffer it sees again) every read of a peer (gather:
    every write into the root's buffer) goes through its pool, whatever the
    race answers (a direct call's span ends where the pool's begins); every
    call's result is right, every guard intact."""
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", faster)
    got = run_ranks(calls, p, collective, n, "small", 4, timeout=120)
    assert got[0]["hybrid"] or faster == "0", "a direct call reads across in the pool's span"
    if not got[0]["hybrid"]:
        pytest.skip(f"{collective} of {n} float64 a block at {p} ranks takes no call with pools on these cores")
    for r, g in enumerate(got):
        assert all(g["rights"]), f"rank {r}: wrong results in calls {g['rights']}"
        assert g["guards"], f"rank {r}: wrote outside a buffer"
        assert len(g["reads"]) == 1, f"rank {r}: {g['reads']}"
    totals = tuple(sum(g["reads"][0][k] for g in got) for k in range(3))
    assert totals == (0, 0, _peer_reads(collective, p)), [g["reads"] for g in got]


def first_allgather(comm, n: int) -> dict:
    """One allgather (n float64 a block) on buffers in 4 KiB pages that the
    pool has not seen before (it adopts a buffer on its second sight)."""
    p, r = comm.size, comm.rank
    whole, out = _placed(n * p, "small", comm)
    out[:] = 0
    out[r * n:(r + 1) * n] = r + np.arange(n)
    comm.allgather(out[r * n:(r + 1) * n].copy(), out)
    want = np.concatenate([q + np.arange(n, dtype=np.float64) for q in range(p)])
    return {"right": bool(np.array_equal(out, want)), "reads": _window_reads(comm),
            "guards": bool(np.all(whole[:GUARD] == FILL) and np.all(whole[-GUARD:] == FILL)),
            "hybrid": _with_pools("allgather", n * p * 8, p, comm.transport.window)}


@pytest.mark.parametrize("p,n,kind", [(2, 256 << 10, 1), (2, 512 << 10, 0), (4, 128 << 10, 1), (4, 512 << 10, 0)])
def test_allgather_past_its_window_call_before_the_pool_adopts(p, n, kind):
    """4 KiB pages, a first call (nothing adopted yet): blocks of up to a
    half (2 ranks: 2 MiB; 4 ranks: 1 MiB) come through the window, each
    rank's block at the start of its region; blocks past a half (4 MiB)
    are read across."""
    got = run_ranks(first_allgather, p, n, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no call with pools on these cores")
    for r, g in enumerate(got):
        assert g["right"] and g["guards"], f"rank {r}: {g}"
        assert len(g["reads"]) == 1 and g["reads"][0][kind] == p - 1 and sum(g["reads"][0]) == p - 1, g["reads"]


@pytest.mark.parametrize("collective,p,n", [("bcast", 2, 512 << 10), ("alltoall", 2, 256 << 10)])
def test_a_large_buffer_in_huge_pages_is_read_from_the_pool(collective, p, n):
    """Published arrays of 4 MiB and more in huge pages: once the pool has
    adopted them they are read out of it (a copy beats a cross-memory read
    of huge pages there)."""
    got = run_ranks(calls, p, collective, n, "huge", 3, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip(f"{collective} of {n} float64 a block at {p} ranks takes no call with pools on these cores")
    for r, g in enumerate(got):
        assert all(g["rights"]) and g["guards"], f"rank {r}: {g}"
    totals = tuple(sum(g["reads"][0][k] for g in got) for k in range(3))
    assert totals == (0, 0, _peer_reads(collective, p)), [g["reads"] for g in got]


@pytest.mark.parametrize("collective,n", [("allgather", 128 << 10), ("alltoall", 256 << 10), ("bcast", 512 << 10)])
def test_an_array_from_alloc_is_read_from_the_pool(collective, n):
    """Arrays from ``comm.alloc`` lie in the pool from the start, nothing
    adopted: read from there."""
    got = run_ranks(calls, 2, collective, n, "alloc", 2, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no fallback on these cores")
    for r, g in enumerate(got):
        assert all(g["rights"]) and g["guards"], f"rank {r}: {g}"
    totals = tuple(sum(g["reads"][0][k] for g in got) for k in range(3))
    assert totals == (0, 0, _peer_reads(collective, 2)), [g["reads"] for g in got]


def test_peers_in_huge_pages_and_in_the_pool_mix():
    """Allgather of 2 MiB: rank 0's array in huge pages, rank 1's in 4 KiB
    pages (adopted): rank 1 reads rank 0's straight, rank 0 reads rank 1's
    from its pool."""
    got = run_ranks(calls, 2, "allgather", 128 << 10, "huge-0", 3, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no fallback on these cores")
    for r, g in enumerate(got):
        assert all(g["rights"]) and g["guards"], f"rank {r}: {g}"
    if got[1]["reads"] != [(1, 0, 0)]:  # rank 1 read rank 0's straight: rank 0's really lay in huge pages
        pytest.skip(f"the kernel gave rank 0 no huge pages: {got[1]['reads']}")
    assert got[0]["reads"] == [(0, 0, 1)], got[0]["reads"]


def past(comm) -> dict:
    """Signature checks off: two matched alltoalls of 4 MiB (each rank's
    send buffer adopted into its pool), then rank 1 passes larger blocks
    than rank 0's: rank 1 would read past rank 0's pooled array and refuses
    to."""
    b0 = 256 << 10  # float64 a block: 4 MiB a rank sends, adopted from its second call
    raws = []

    def buf(n: int) -> np.ndarray:
        raw, view = guarded(n, "float64", 0)
        raws.append((raw, n))
        return view

    send, recv = buf(b0 * 2), buf(b0 * 2)
    for _ in range(2):
        send[:] = comm.rank
        comm.alltoall(send, recv)
    pooled = _last_reads(comm)
    if comm.rank == 1:  # reads bytes [2.5, 5) MiB of rank 0's 4 MiB
        send, recv = buf(b0 * 5 // 2), buf(b0 * 5 // 2)
    return dict(attempt(lambda: comm.alltoall(send, recv)), pooled=pooled,
                guards=intact([w for w, _ in raws], [n for _, n in raws]))


def _refused(got: list[dict], collective: str, verb: str) -> None:
    """Rank 1 refused to ``verb`` past rank 0's pooled buffer in its third
    ``collective``, within bounded time, and rank 0 learned of it; no guard
    written; the matched calls before went through rank 0's pool."""
    assert got[1]["pooled"] == [(0, 0, 1)], got[1]["pooled"]
    for r, g in enumerate(got):
        assert g["guards"], f"rank {r}: wrote outside its buffer"
        assert g["outcome"] != "ok", f"rank {r}: a call with different sizes completed"
        assert g["elapsed"] < 5 + BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
    assert got[1]["outcome"] == "MismatchedCollective", got[1]["message"]
    assert re.search(rf"rank 1, {collective} #3", got[1]["message"]), got[1]["message"]
    assert f"would {verb} outside rank 0's buffer" in got[1]["message"], got[1]["message"]
    assert "rank 1" in got[0]["message"], got[0]["message"]  # rank 0 learns of it from rank 1


def test_a_read_past_a_pooled_array_is_refused_even_with_checks_off(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SIGNATURE_CHECKS", "0")
    _refused(run_ranks(past, 2, timeout=60, comm_timeout=5), "alltoall", "read")


def write_past(comm) -> dict:
    """Signature checks off: two matched gathers of 2 MiB to rank 0 (its
    buffer adopted into its pool), then rank 1 passes blocks larger than
    rank 0's: rank 1 would write past rank 0's pooled buffer and refuses
    to."""
    n0 = 128 << 10  # float64 a block: rank 0 receives 2 MiB
    raws = []

    def buf(n: int) -> np.ndarray:
        raw, view = guarded(n, "float64", 0)
        raws.append((raw, n))
        return view

    send, recv = buf(n0), buf(n0 * 2)
    for _ in range(2):
        send[:] = comm.rank
        comm.gather(send, recv if comm.rank == 0 else None, root=0)
    pooled = _last_reads(comm)
    if comm.rank == 1:  # writes bytes [1.25, 2.5) MiB of rank 0's 2 MiB
        send = buf(n0 * 5 // 4)
    return dict(attempt(lambda: comm.gather(send, recv if comm.rank == 0 else None, root=0)), pooled=pooled,
                guards=intact([w for w, _ in raws], [n for _, n in raws]))


def test_a_write_past_a_pooled_buffer_is_refused_even_with_checks_off(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SIGNATURE_CHECKS", "0")
    _refused(run_ranks(write_past, 2, timeout=60, comm_timeout=5), "gather", "write")


@pytest.mark.parametrize("fn,collective", [(past, "alltoall"), (write_past, "gather")])
def test_a_mismatch_after_pooled_calls_is_caught_on_every_rank_before_any_move(fn, collective):
    """The same calls with signature checks on: every rank raises
    ``MismatchedCollective`` naming itself and the call, before any byte of
    a peer is read or written."""
    got = run_ranks(fn, 2, timeout=60, comm_timeout=5)
    assert got[1]["pooled"] == [(0, 0, 1)], got[1]["pooled"]
    for r, g in enumerate(got):
        assert g["outcome"] == "MismatchedCollective", f"rank {r}: {g['outcome']}: {g['message']}"
        assert re.search(rf"rank {r}[:,] {collective} #3", g["message"]), f"rank {r}: {g['message']}"
        assert g["elapsed"] < BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
        assert g["guards"], f"rank {r}: wrote outside its buffer"


def allgather_mismatched(comm) -> dict:
    """4 ranks, two matched allgathers of 4 MiB in 4 KiB pages (each
    rank's send buffer adopted into its pool from the second), then rank 2
    passes blocks a quarter larger (in place): every rank raises in that
    call and every buffer stays as it was."""
    p, r, n = comm.size, comm.rank, 128 << 10
    raws = []

    def buf(count: int) -> np.ndarray:
        raw, view = guarded(count, "float64", 0)
        raws.append((raw, count))
        return view

    x, out = buf(n), buf(n * p)
    for i in range(2):
        x[:] = r + i
        comm.allgather(x, out)
    pooled = _last_reads(comm)
    m = n + n // 4 if r == 2 else n
    if r == 2:
        out = buf(m * p)
    out[r * m:(r + 1) * m] = -1.0  # in place
    before = out.copy()
    got = attempt(lambda: comm.allgather(None, out))
    return dict(got, pooled=pooled, guards=intact([w for w, _ in raws], [c for _, c in raws]),
                kept=bool(np.array_equal(out, before)),
                hybrid=_with_pools("allgather", n * p * 8, p, comm.transport.window))


def test_a_mismatch_in_allgathers_pooled_call_where_ranks_share_cores_is_caught_everywhere():
    """4 ranks on 2 cores take allgather's pooled call from 4 MiB: a
    mismatch after pooled calls is caught on every rank, naming itself and
    the call, before any byte is read (every rank's buffer unchanged)."""
    got = run_ranks(allgather_mismatched, 4, timeout=60, comm_timeout=5)
    if not got[0]["hybrid"]:
        pytest.skip("no call with pools on these cores")
    for r, g in enumerate(got):
        assert g["pooled"] == [(0, 0, 3)], f"rank {r}: {g['pooled']}"
        assert g["outcome"] == "MismatchedCollective", f"rank {r}: {g['outcome']}: {g['message']}"
        assert re.search(rf"rank {r}[:,] allgather #3", g["message"]), f"rank {r}: {g['message']}"
        assert g["elapsed"] < BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
        assert g["guards"] and g["kept"], f"rank {r}: wrote outside its buffer or into it"


def written_late(comm, rounds: int) -> dict:
    """Gather of 4 MiB to rank 0, which sends one element itself (its
    buffer adopted into its pool): as soon as the call returns, rank 0
    fills its buffer and checks, after everyone's next barrier, that nothing
    changed it since: a root must not return before every sender has
    written."""
    p, r, n = comm.size, comm.rank, 512 << 10
    counts = [1] + [n] * (p - 1)
    send, recv = empty(counts[r], np.float64, "small"), empty(sum(counts), np.float64, "small")
    want = np.concatenate([np.full(c, q * 1.0) for q, c in enumerate(counts)])
    bad = []
    for i in range(rounds):
        send[:] = i * 10 + r
        comm.gatherv(send, recv if r == 0 else None, counts, root=0)
        if r == 0:
            recv[:] = -1.0  # at once
        comm.barrier()
        if r == 0 and not np.all(recv == -1.0):
            bad.append(f"round {i}: {np.unique(recv)[:4]} written after the call returned")
    if r == 0:  # and the result, once more, checked
        comm.gatherv(send, recv, counts, root=0)
        if not np.array_equal(recv, want + (rounds - 1) * 10):
            bad.append(f"the last result: {np.unique(recv)[:4]}")
    else:
        comm.gatherv(send, None, counts, root=0)
    return {"bad": bad, "reads": _window_reads(comm),
            "hybrid": _with_pools("gather", sum(counts) * 8, p, comm.transport.window)}


def test_a_root_does_not_return_before_every_sender_wrote():
    got = run_ranks(written_late, 2, 100, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no call with pools on these cores")
    assert not got[0]["bad"], "; ".join(got[0]["bad"][:5])
    assert got[1]["reads"] == [(0, 0, 1)], got[1]["reads"]


def overwrite_at_once(comm, collective: str, rounds: int) -> dict:
    """Each rank overwrites its buffer as soon as the call returns, the
    buffers the pool adopted after the first call: a rank whose readers
    take its array out of its pool must not return before they are done."""
    p, r = comm.size, comm.rank
    n = (512 << 10 if collective == "bcast" else 96 << 10)  # float64 a block: 4 MiB, 2.25 MiB a rank sends
    send = empty(n * (1 if collective == "bcast" else p), np.float64, "small")
    recv = empty(n * p, np.float64, "small")
    bad = []
    for i in range(rounds):
        send[:] = i * 10 + r
        if collective == "bcast":  # the root's buffer is read; the others' receive
            comm.bcast(send, root=0)
            if r == 0:
                send[:] = -1.0  # at once
                continue
            got, want = send.copy(), np.full(n, i * 10.0)
        else:
            comm.alltoall(send, recv)
            got, want = recv, np.repeat(np.arange(p) + i * 10.0, n)
        send[:] = -1.0  # at once
        if not np.array_equal(got, want):
            bad.append(f"round {i}: {np.unique(got)[:4]}")
    return {"bad": bad, "reads": _last_reads(comm),
            "hybrid": _with_pools(collective, send.nbytes, p, comm.transport.window)}


@pytest.mark.parametrize("collective,p", [("bcast", 2), ("alltoall", 3)])
def test_no_rank_returns_while_others_read_its_pool(collective, p):
    got = run_ranks(overwrite_at_once, p, collective, 100, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no call with pools on these cores")
    for r, g in enumerate(got):
        assert not g["bad"], f"rank {r}: " + "; ".join(g["bad"][:5])
    assert sum(g["reads"][0][2] for g in got) == _peer_reads(collective, p), [g["reads"] for g in got]


def writer_stopped(comm, limit: float, marker: str) -> dict:
    """Gathers of 4 MiB to rank 0 (its buffer adopted into its pool); in the
    third, rank 1 is stopped (SIGSTOP) once it has posted, before it
    writes: rank 0 times out naming rank 1, fills its buffer, and resumes
    rank 1, which finds rank 0's abort and raises without writing; rank 0's
    buffer keeps what it filled in, checked once rank 1 is done."""
    n = 256 << 10
    send, recv = empty(n, np.float64, "small"), empty(2 * n, np.float64, "small")
    send[:] = comm.rank
    for _ in range(2):
        comm.gather(send, recv if comm.rank == 0 else None, root=0)
    pooled = _last_reads(comm)
    got = stopped_after_its_post(comm, lambda timeout: comm.gather(send, recv if comm.rank == 0 else None, root=0,
                                                                   timeout=timeout), limit, marker,
                                 lambda: recv.fill(-1.0))
    return dict(got, pooled=pooled) if comm.rank == 1 else dict(got, kept=bool(np.all(recv == -1.0)))


def test_a_writer_stopped_before_it_writes_never_writes_after_the_root_gave_up(tmp_path):
    limit = 2.0
    got = run_ranks(writer_stopped, 2, limit, str(tmp_path / "done"), timeout=60, comm_timeout=20)
    assert got[1]["pooled"] == [(0, 0, 1)], got[1]["pooled"]  # rank 1 wrote into rank 0's pool before
    assert got[0]["outcome"] == "CollectiveTimeout", got[0]
    assert "rank 0" in got[0]["message"] and "gather #3" in got[0]["message"] and "rank 1" in got[0]["message"]
    assert limit <= got[0]["elapsed"] < limit + BOUND, got[0]
    assert got[0]["kept"], "rank 1 wrote into rank 0's buffer after rank 0 gave up on the call"
    assert got[1]["outcome"] != "ok", "rank 1 completed a call its root had given up on"
    assert "rank 1" in got[1]["message"] and "gather #3" in got[1]["message"] and "rank 0" in got[1]["message"], got[1]


def lookup_fails(comm) -> dict:
    """Alltoall of 4 MiB, rank 1's pool lookups failing from its third
    call on (an exception in the window's adoption): the calls go on,
    rank 1's buffer read across, right on every rank."""
    p, r, n = comm.size, comm.rank, 256 << 10
    send, recv = empty(n * p, np.float64, "small"), empty(n * p, np.float64, "small")
    asked = [0]
    if r == 1:
        adoptions = comm.transport.window._adoptions
        lookup = adoptions.find

        def failing(address: int, nbytes: int, adopt: bool):
            asked[0] += 1
            if asked[0] >= 3:
                raise MemoryError("the pool's lookup failed")
            return lookup(address, nbytes, adopt)

        adoptions.find = failing
    rights = []
    for i in range(5):
        send[:] = np.repeat(np.arange(p) * 0 + r * 10 + i, n) + np.tile(np.arange(n) / n, p)
        comm.alltoall(send, recv)
        want = np.concatenate([q * 10 + i + np.arange(n) / n for q in range(p)])
        rights.append(bool(np.array_equal(recv, want)))
    return {"rights": rights, "asked": asked[0], "reads": _last_reads(comm)}


def test_a_failing_pool_lookup_moves_the_buffer_across():
    got = run_ranks(lookup_fails, 2, timeout=60)
    for r, g in enumerate(got):
        assert all(g["rights"]), f"rank {r}: {g['rights']}"
    assert got[1]["asked"] >= 3, got[1]
    assert got[0]["reads"] == [(1, 0, 0)], got[0]["reads"]  # rank 1's read across in the last call
    assert got[1]["reads"] == [(0, 0, 1)], got[1]["reads"]  # rank 0's still out of its pool
