"""A direct compiled call with a fallback on the window: where the race
found a cross-memory read slower than the window's copies (4 KiB pages), the
direct calls of the spans where the read wins still read a peer's arrays
directly where they lie in huge pages, and take them from the window where
they do not (the peer copied them in); the results are right either way
and with peers of both kinds, nothing is written outside a buffer, and a
mismatch is caught on every rank before anything is read."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from collectives import CollectiveError
from collectives.algorithms.window.state import WindowState
from collectives.algorithms.window.tuning import direct_where_huge
from collectives.bench.pages import empty
from collectives.transports.shm.pages import _PAGE_IS_HUGE, _some_page_lacks
from harness import run_ranks

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux")

GUARD = 64  # float64 elements of guard before and after each buffer
FILL = -7.0


def placed(n: int, huge: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """(the whole guarded span, its n float64 in the middle, whether they lie
    in huge pages): in huge pages (``huge``) or in 4 KiB pages."""
    whole = empty(n + 2 * GUARD, np.float64, "huge" if huge else "small")
    whole[:] = FILL
    view = whole[GUARD:GUARD + n]
    lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
    lacks = _some_page_lacks(-(-lo // 4096) * 4096, hi // 4096 * 4096, _PAGE_IS_HUGE)
    return whole, view, lacks is False


def _reads(comm) -> list[tuple[int, int]]:
    """(reads straight from peers' arrays, reads of their copies in the
    window) of every prepared direct call with a fallback, in its last run."""
    st = comm.transport.window.kept.get(WindowState)
    calls = [getattr(v.on_arrays[0], "__self__", None) for v in (st.cache.values() if st else ())
             if getattr(getattr(v, "on_arrays", None), "__len__", None)]
    return [(c.last_direct, c.last_window) for c in calls if getattr(c, "fallback", 0)]


def one(comm, collective: str, n: int, huge: bool, extra: int = 0) -> dict:
    """One call of ``collective`` (n float64 a block), its buffers in huge
    pages or not; ``extra`` more elements a block on rank 1 (a mismatch)."""
    p, r = comm.size, comm.rank
    n += extra * (r == 1)
    wholes, places = [], []

    def buf(count: int) -> np.ndarray:
        whole, view, in_huge = placed(count, huge)
        wholes.append(whole)
        places.append(in_huge)
        return view

    def ramp(rank: int, count: int, offset: int = 0) -> np.ndarray:
        return rank * 1_000_000 + offset + np.arange(count, dtype=np.float64)

    if collective == "alltoall":
        x, out = buf(n * p), buf(n * p)
        x[:] = ramp(r, n * p)
        args, want = (x, out), np.concatenate([ramp(q, n, r * n) for q in range(p)])
    elif collective == "allgather":
        x, out = buf(n), buf(n * p)  # (peers read the send buffer: out of place, it holds the block)
        out[:] = 0
        x[:] = ramp(r, n)
        args, want = (x, out), np.concatenate([ramp(q, n) for q in range(p)])
    elif collective == "scatter":
        x, out = buf(n * p), buf(n)
        x[:] = ramp(0, n * p)
        args, want = (x if r == 0 else None, out), ramp(0, n, r * n)
    else:  # gather
        x, out = buf(n), buf(n * p)
        x[:] = ramp(r, n)
        args, want = (x, out if r == 0 else None), np.concatenate([ramp(q, n) for q in range(p)]) if r == 0 else None
    t0 = time.monotonic()
    try:
        for _ in range(2):  # the second from the prepared call
            if collective in ("scatter", "gather"):
                getattr(comm, collective)(*args, root=0)
            else:
                getattr(comm, collective)(*args)
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    elapsed = time.monotonic() - t0
    got = args[1] if collective != "gather" else args[1]
    right = outcome == "ok" and (want is None or np.array_equal(got, want))
    guards = all(np.all(w[:GUARD] == FILL) and np.all(w[-GUARD:] == FILL) for w in wholes)
    hybrid = direct_where_huge(collective, n * p * 8, p, comm.transport.window.cores, comm.transport.window.cma_from)
    return {"outcome": outcome, "message": message, "elapsed": elapsed, "right": right, "guards": guards,
            "huge": all(places), "hybrid": hybrid, "reads": _reads(comm)}


CASES = [("alltoall", 2, 32 << 10), ("allgather", 2, 32 << 10), ("scatter", 2, 32 << 10),
         ("alltoall", 3, 16 << 10), ("scatter", 3, 32 << 10), ("gather", 3, 32 << 10),
         ("allgather", 4, 32 << 10)]  # 4 ranks on 2 cores: 1 MiB, where only huge pages are read straight

#: (CASES, the race's answer): where it found the read faster, only allgather's
#: span where ranks share cores (tuning.HugeOnly) still reads only huge pages
RACES = [(case, "0") for case in CASES] + [(("allgather", 4, 32 << 10), "1")]


@pytest.mark.parametrize("case,faster", RACES)
@pytest.mark.parametrize("where", ["huge", "small"])
def test_the_direct_call_reads_only_from_huge_pages(monkeypatch, case, faster, where):
    """Every rank's arrays in huge pages: every read is direct; in 4 KiB
    pages: every read is of the peer's copy in the window. Right either way."""
    collective, p, n = case
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", faster)  # "0": the race's answer never (as on 4 KiB pages)
    got = run_ranks(one, p, collective, n, where == "huge", timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip(f"{collective} of {n * p * 8} B at {p} ranks on these cores has no fallback")
    if where == "huge" and not all(g["huge"] for g in got):
        pytest.skip("the kernel gave no huge pages")
    for r, g in enumerate(got):
        assert g["outcome"] == "ok" and g["right"], f"rank {r}: {g['outcome']} {g['message']} right={g['right']}"
        assert g["guards"], f"rank {r}: wrote outside a buffer"
        assert len(g["reads"]) == 1, f"rank {r}: {g['reads']}"
    reads = (p - 1) * (p if collective in ("alltoall", "allgather") else 1)  # of peers' blocks, all ranks together
    direct, window = (sum(g["reads"][0][k] for g in got) for k in (0, 1))
    want = (reads, 0) if where == "huge" else (0, reads)
    assert (direct, window) == want, f"{where}: {[g['reads'] for g in got]}"


def mixed(comm, collective: str, n: int) -> dict:
    """Every rank's arrays in huge pages but one source's (scatter's root,
    else rank 1)."""
    return one(comm, collective, n, comm.rank != (0 if collective == "scatter" else 1))


@pytest.mark.parametrize("collective", ["alltoall", "allgather", "scatter"])
def test_each_peer_is_read_the_way_its_pages_allow(monkeypatch, collective):
    """Rank 1's arrays (scatter: the root's) in 4 KiB pages, the others' in
    huge pages: what comes from it comes through the window, the rest
    straight; right on every rank."""
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", "0")
    got = run_ranks(mixed, 2, collective, 32 << 10, timeout=120)
    if not got[0]["hybrid"]:
        pytest.skip("no fallback on these cores")
    if not got[1 if collective == "scatter" else 0]["huge"]:
        pytest.skip("the kernel gave no huge pages")
    for r, g in enumerate(got):
        assert g["outcome"] == "ok" and g["right"] and g["guards"], f"rank {r}: {g}"
    if collective == "scatter":
        assert [g["reads"] for g in got] == [[(0, 0)], [(0, 1)]], [g["reads"] for g in got]
    else:  # rank 0 reads rank 1's through the window, rank 1 reads rank 0's straight
        assert [g["reads"] for g in got] == [[(0, 1)], [(1, 0)]], [g["reads"] for g in got]


def mismatched(comm, collective: str, huge: bool) -> dict:
    return one(comm, collective, 32 << 10, huge, extra=1)


@pytest.mark.parametrize("collective", ["alltoall", "allgather", "scatter"])
@pytest.mark.parametrize("where", ["huge", "small"])
def test_a_mismatch_is_caught_on_every_rank_before_either_path(monkeypatch, collective, where):
    """Rank 1 passes one more element a block, every rank's arrays in huge
    pages (read straight) or in 4 KiB pages (through the window): every rank
    raises in its first call, nothing is written outside a buffer."""
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", "0")
    got = run_ranks(mismatched, 2, collective, where == "huge", timeout=60, comm_timeout=10)
    for r, g in enumerate(got):
        assert g["outcome"] == "MismatchedCollective", f"rank {r}: {g['outcome']} {g['message']}"
        assert re.search(rf"rank {r}[:,] {collective} #1", g["message"]), f"rank {r}: {g['message']}"
        assert g["elapsed"] < 5.0, f"rank {r}: took {g['elapsed']:.1f} s"
        assert g["guards"], f"rank {r}: wrote outside a buffer"
