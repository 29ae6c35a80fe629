"""Allreduce's and reduce's direct compiled calls: each rank reduces its
block straight from its peers' buffers, where each lies (in its rank's
shared pool, in place; in huge pages, across; else from the copy its rank
makes in the window), and writes the reduced block into theirs (reduce:
the root's only) through the pool, across, or the owner's region, which
the owner copies out. The results carry the bits of the window's calls
(allreduce: rank order; reduce: each block's owner first), for every kind
of buffer, in place and out of place; reduce leaves the other ranks'
buffers alone; nothing is written outside a buffer; no rank returns while
a peer still writes into its buffer; a mismatch is caught on every rank
before anything moves; a read past a peer's buffer is refused even with
signature checks off; and a rank stopped after its post never writes once
its peer gave up."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from collectives import get_op
from collectives.algorithms.window.direct_reduction import takes_direct_call
from collectives.algorithms.window.pieces import blocks
from collectives.algorithms.window.tuning import compiled_direct
from collectives.bench.pages import empty
from harness import attempt, run_ranks, stopped_after_its_post

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/map_files"), reason="needs Linux")

GUARD = 40  # elements of guard before and after each buffer (its start then lies off the page grid)
FILL = 91  # fits every dtype
N = (1 << 17) + 5  # float64: just over 1 MiB, uneven blocks, adopted by the pool from its second call
BOUND = 5.0  # seconds: a refused read is found at the call's first synchronisation
KINDS = ("huge", "small", "alloc", "mixed")


def _data(rank: int, n: int, dtype, seed: int) -> np.ndarray:
    """Rank ``rank``'s vector of call ``seed``: values whose sum in another
    order has other bits (floats), or spread over the type's range (ints)."""
    rng = np.random.default_rng(seed * 1009 + rank)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -(1 << 20)), min(info.max, 1 << 20), n, endpoint=True).astype(dtype)


def _want(p: int, n: int, dtype, seed: int, ufunc) -> np.ndarray:
    """The reduction in rank order: ((x0 op x1) op x2) ..."""
    out = _data(0, n, dtype, seed)
    for q in range(1, p):
        out = ufunc(out, _data(q, n, dtype, seed))
    return out


class Guarded:
    """Buffers with guard regions on both sides, placed as asked."""

    def __init__(self, comm) -> None:
        self.comm, self.wholes = comm, []

    def __call__(self, n: int, dtype, where: str) -> np.ndarray:
        if where == "alloc":
            whole = self.comm.alloc(n + 2 * GUARD, dtype)
        else:
            whole = empty(n + 2 * GUARD, dtype, where)
        whole[:] = FILL
        self.wholes.append(whole)
        return whole[GUARD:GUARD + n]

    def intact(self) -> bool:
        return all(np.all(w[:GUARD] == FILL) and np.all(w[-GUARD:] == FILL) for w in self.wholes)


def _in_span(comm, collective: str, buf: np.ndarray, op: str) -> bool:
    """Whether ``collective`` of ``buf`` takes its direct call on this communicator's window."""
    from collectives.algorithms.window.state import window_state
    window, st = window_state(comm.transport.window, comm.size)
    return takes_direct_call(collective, window, st, buf, get_op(op))


def _reduction_call(comm, keys_before: set):
    """The compiled call of the allreduce prepared since ``keys_before``."""
    new = [e.call for k, e in comm._prepared.items() if k not in keys_before]
    calls = [c for c in new if getattr(c, "reduces", 0)]
    return calls[0] if calls else None


def every_kind(comm, times: int, dtype: str = "float64", op: str = "sum", odd_in_place: bool = False,
               size: int = N) -> dict:
    """``times`` allreduces of ``size`` float64's bytes for each kind of buffer (rank 0's
    in huge pages and the others' in 4 KiB pages: "mixed"), in place and
    out of place (with ``odd_in_place``, odd ranks call in place where
    the others call out of place), each kind with its own size:
    every result against the reduction in rank order, the input of an out
    of place call unchanged, guards, and the last run's reads by kind."""
    r, p = comm.rank, comm.size
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
             "bxor": np.bitwise_xor}[op]
    bufs = Guarded(comm)
    rows = {}
    for i, kind in enumerate(KINDS):
        where = ("huge" if r == 0 else "small") if kind == "mixed" else kind
        for asked in (True, False):
            inplace = asked or (odd_in_place and r % 2 == 1)
            n = size * 8 // np.dtype(dtype).itemsize + 2 * i + (0 if asked else 1)
            x, out = bufs(n, dtype, where), bufs(n, dtype, where)
            keys = set(comm._prepared)
            bad = []
            for t in range(times):
                x[:] = _data(r, n, dtype, t)
                comm.allreduce(x, op, out=None if inplace else out)
                got = x if inplace else out
                if not np.array_equal(got, _want(p, n, dtype, t, ufunc)):
                    bad.append(f"call {t}: {int(np.sum(got != _want(p, n, dtype, t, ufunc)))} elements wrong")
                if not inplace and not np.array_equal(x, _data(r, n, dtype, t)):
                    bad.append(f"call {t}: the input changed")
            call = _reduction_call(comm, keys)
            rows[(kind, asked)] = {"bad": bad, "reads": None if call is None else
                                     (call.last_direct, call.last_window, call.last_pooled)}
    return {"rows": rows, "guards": bufs.intact(),
            "span": _in_span(comm, "allreduce", np.empty(size * 8 // np.dtype(dtype).itemsize, dtype), op)}


def _check_rows(got: list[dict], adopt: bool, falls_back: bool = True) -> None:
    """Every rank's results and guards, and the kinds of its reads: out of
    pools (adopted or from alloc), across (huge pages; 4 KiB pages too
    where the call has no fallback), or from the window."""
    p = len(got)
    for r, g in enumerate(got):
        assert g["guards"], f"rank {r}: wrote outside a buffer"
        for (kind, inplace), row in g["rows"].items():
            where = f"rank {r}, {kind}, {'in place' if inplace else 'out of place'}"
            assert not row["bad"], f"{where}: " + "; ".join(row["bad"])
            assert row["reads"] is not None, f"{where}: no direct compiled call ran"
            if kind == "alloc" or adopt:  # from comm.alloc, or adopted by the pool once seen twice
                want = (False, False, True)
            elif not falls_back:  # read across from either kind of page
                want = (True, False, False)
            elif kind == "mixed":  # rank 0's in huge pages, read across; the others' through the window
                want = (r != 0, r == 0 or p > 2, False)
            else:
                want = (kind == "huge", kind == "small", False)
            assert tuple(k > 0 for k in row["reads"]) == want, f"{where}: reads {row['reads']}"


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("adopt", [True, False])
def test_every_kind_of_buffer_reduces_right(monkeypatch, p, adopt):
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "1" if adopt else "0")
    got = run_ranks(every_kind, p, 3, timeout=180)
    if not got[0]["span"]:
        pytest.skip(f"allreduce of {N * 8} B at {p} ranks on these cores takes no direct call")
    _check_rows(got, adopt)


def _owner_first(p: int, n: int, dtype, seed: int, ufunc) -> np.ndarray:
    """Reduce's order: each block its owner's values first, then the others' in rank order."""
    ins, out, lo = [_data(q, n, dtype, seed) for q in range(p)], np.empty(n, dtype), 0
    for q, c in enumerate(blocks(n, p)):
        part = ins[q][lo:lo + c].copy()
        for r in range(p):
            if r != q:
                part = ufunc(part, ins[r][lo:lo + c])
        out[lo:lo + c] = part
        lo += c
    return out


def reduce_every_kind(comm, times: int, root: int, size: int = N) -> dict:
    """``times`` reduces to ``root`` of ``size`` float64 (about) for each
    kind of buffer: the root's result against reduce's order, bit for bit;
    the other ranks' buffers unchanged; guards; the last run's reads."""
    r, p = comm.rank, comm.size
    bufs, rows = Guarded(comm), {}
    for i, kind in enumerate(KINDS):
        where = ("huge" if r == 0 else "small") if kind == "mixed" else kind
        n = size + 2 * i
        x = bufs(n, "float64", where)
        keys, bad = set(comm._prepared), []
        for t in range(times):
            x[:] = _data(r, n, "float64", t)
            comm.reduce(x, root=root)
            want = _owner_first(p, n, "float64", t, np.add) if r == root else _data(r, n, "float64", t)
            if not np.array_equal(x, want):
                bad.append(f"call {t}: {int(np.sum(x != want))} elements {'wrong' if r == root else 'changed'}")
        call = _reduction_call(comm, keys)
        rows[(kind, True)] = {"bad": bad, "reads": None if call is None else
                              (call.last_direct, call.last_window, call.last_pooled)}
    return {"rows": rows, "guards": bufs.intact(), "span": _in_span(comm, "reduce", np.empty(size), "sum")}


@pytest.mark.parametrize("p,root,adopt", [(3, 2, True), (3, 1, False), (4, 0, True), (4, 3, False)])
def test_reduce_reads_every_kind_of_buffer_and_writes_only_the_roots(monkeypatch, p, root, adopt):
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "1" if adopt else "0")
    got = run_ranks(reduce_every_kind, p, 3, root, timeout=180)
    if not got[0]["span"]:
        pytest.skip(f"reduce of {N * 8} B at {p} ranks on these cores takes no direct call")
    _check_rows(got, adopt)


@pytest.mark.parametrize("p,root,size,adopt,falls_back", [
    (2, 0, 2 * N, False, True),      # 2 MiB at 2 ranks: the root's block and one piece fit a half
    (2, 1, 9 * N // 2, False, False),  # 4.5 MiB: they do not, arrays in 4 KiB pages are read across
    (2, 0, 9 * N // 2, True, False),
    (3, 1, 6 * N, False, False)])    # 6 MiB at 3 ranks
def test_reduce_past_a_half_reduces_into_one_piece(monkeypatch, p, root, size, adopt, falls_back):
    """Reduce's direct call at any size: a rank that is not the root reduces
    its block a piece at a time into one piece of its region and writes each
    into the root's buffer; right bit for bit, the other ranks' buffers
    unchanged, every read of the kind its pages allow."""
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "1" if adopt else "0")
    got = run_ranks(reduce_every_kind, p, 2, root, size, timeout=180)
    if not got[0]["span"]:
        pytest.skip(f"reduce of {size * 8} B at {p} ranks on these cores takes no direct call")
    _check_rows(got, adopt, falls_back)


@pytest.mark.parametrize("p,adopt", [(2, True), (3, False)])
def test_ranks_in_place_and_out_of_place_mix(monkeypatch, p, adopt):
    """The same signature: a rank out of place reads a peer in place, whose
    one array is both its input and its output, and the other way round."""
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "1" if adopt else "0")
    got = run_ranks(every_kind, p, 3, "float64", "sum", True, timeout=180)
    if not got[0]["span"]:
        pytest.skip(f"allreduce of {N * 8} B at {p} ranks on these cores takes no direct call")
    _check_rows(got, adopt)


@pytest.mark.parametrize("p,size", [(2, 3 * N - 16), (3, 5 * N // 2)])
def test_a_vector_past_a_half_reduces_right(monkeypatch, p, size):
    """About 3 MiB at 2 ranks, 2.5 MiB at 3: more than a half of the window,
    but the blocks a rank's peers reduce fit there, where a rank whose
    array lies in 4 KiB pages outside its pool puts them (no adoption)."""
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "0")
    got = run_ranks(every_kind, p, 2, "float64", "sum", False, size, timeout=180)
    if not got[0]["span"]:
        pytest.skip(f"allreduce of {size * 8} B at {p} ranks on these cores takes no direct call")
    _check_rows(got, False)


def test_a_vector_whose_blocks_do_not_fit_a_half_is_read_across(monkeypatch):
    """3.5 MiB at 3 ranks: the blocks a rank's peers reduce take more than a
    half, and the pool's direct path begins at 4 MiB; no adoption: arrays in
    4 KiB pages are read across too."""
    monkeypatch.setenv("COLLECTIVES_SHM_ADOPT", "0")
    got = run_ranks(every_kind, 3, 2, "float64", "sum", False, 7 * N // 2, timeout=180)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    _check_rows(got, False, falls_back=False)


@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float64", "max"), ("int64", "bxor"),
                                      ("int32", "min"), ("uint8", "sum")])
def test_every_dtype_and_op_reduces_right(dtype, op):
    """At 2 ranks, 3 ranks for float32: the same buffers, other kernels
    (uint8 sums wrap around as numpy's do)."""
    p = 3 if dtype == "float32" else 2
    got = run_ranks(every_kind, p, 3, dtype, op, timeout=180)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    _check_rows(got, True)


def overwrite_at_once(comm, rounds: int, collective: str = "allreduce") -> dict:
    """Each rank overwrites its buffer as soon as the call returns and
    checks, after the next barrier, that nothing wrote into it since: no
    rank may return while a peer still writes its reduced block there
    (reduce: to the last rank, whose result is checked)."""
    r, p, n = comm.rank, comm.size, N
    x = empty(n, np.float64, "small")
    bad = []
    for i in range(rounds):
        x[:] = i + r
        if collective == "reduce":
            comm.reduce(x, root=p - 1)
        else:
            comm.allreduce(x)
        if (collective == "allreduce" or r == p - 1) and not np.all(x == p * i + p * (p - 1) // 2):
            bad.append(f"round {i}: {np.unique(x)[:4]}")
        x[:] = -1.0  # at once
        comm.barrier()
        if not np.all(x == -1.0):
            bad.append(f"round {i}: {np.unique(x)[:4]} written after the call returned")
    return {"bad": bad, "span": compiled_direct(collective, n * 8, p, comm.transport.window.cores)}


@pytest.mark.parametrize("p,collective", [(2, "allreduce"), (3, "allreduce"), (3, "reduce")])
def test_no_rank_returns_while_peers_write_into_its_buffer(p, collective):
    got = run_ranks(overwrite_at_once, p, 100, collective, timeout=120)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    for r, g in enumerate(got):
        assert not g["bad"], f"rank {r}: " + "; ".join(g["bad"][:5])


def longer_on_rank_1(comm) -> dict:
    """Two matched allreduces (rank 0's buffer adopted into its pool), then
    rank 1 passes a vector a quarter longer than rank 0's."""
    bufs = Guarded(comm)
    x = bufs(N, np.float64, "small")
    for _ in range(2):
        x[:] = comm.rank
        comm.allreduce(x)
    keys = {k for k, e in comm._prepared.items() if getattr(e.call, "reduces", 0)}
    if comm.rank == 1:  # its block starts past rank 0's vector's 5/8
        x = bufs(N * 5 // 4, np.float64, "small")
        x[:] = 1.0
    got = attempt(lambda: comm.allreduce(x))
    return dict(got, guards=bufs.intact(), kept=bool(np.all(x[:N // 2] == comm.rank)) if comm.rank == 1 else True,
                prepared=len(keys), span=compiled_direct("allreduce", N * 8, comm.size, comm.transport.window.cores))


def test_a_mismatch_is_caught_on_every_rank_before_anything_moves():
    got = run_ranks(longer_on_rank_1, 2, timeout=60, comm_timeout=5)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    for r, g in enumerate(got):
        assert g["prepared"] == 1, f"rank {r}: the matched calls took no direct call"
        assert g["outcome"] == "MismatchedCollective", f"rank {r}: {g['outcome']}: {g['message']}"
        assert re.search(rf"rank {r}[:,] allreduce #3", g["message"]), f"rank {r}: {g['message']}"
        assert g["elapsed"] < BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
        assert g["guards"], f"rank {r}: wrote outside its buffer"
    assert got[1]["kept"], "rank 0 wrote into rank 1's buffer in a call the ranks disagree about"


def test_a_read_past_a_peer_is_refused_even_with_checks_off(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SIGNATURE_CHECKS", "0")
    got = run_ranks(longer_on_rank_1, 2, timeout=60, comm_timeout=5)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    for r, g in enumerate(got):
        assert g["guards"], f"rank {r}: wrote outside its buffer"
        assert g["outcome"] != "ok", f"rank {r}: a call with different sizes completed"
        assert g["elapsed"] < 5 + BOUND, f"rank {r}: took {g['elapsed']:.1f} s"
    assert got[1]["outcome"] == "MismatchedCollective", got[1]["message"]
    assert re.search(r"rank 1, allreduce #3", got[1]["message"]), got[1]["message"]
    assert "would read outside rank 0's buffer" in got[1]["message"], got[1]["message"]
    assert "rank 1" in got[0]["message"], got[0]["message"]  # rank 0 learns of it from rank 1


def writer_stopped(comm, limit: float, marker: str) -> dict:
    """Allreduces of just over 1 MiB (the buffers adopted into the pools);
    in the third, rank 1 is stopped (SIGSTOP) once it has posted, before it
    reduces: rank 0 times out naming rank 1, fills its buffer, and resumes
    rank 1, which finds rank 0's abort and raises without writing; rank 0's
    buffer keeps what it filled in, checked once rank 1 is done."""
    x = empty(N, np.float64, "small")
    x[:] = comm.rank
    for _ in range(2):
        comm.allreduce(x)
    span = compiled_direct("allreduce", N * 8, comm.size, comm.transport.window.cores)
    got = stopped_after_its_post(comm, lambda timeout: comm.allreduce(x, timeout=timeout), limit, marker,
                                 lambda: x.fill(-1.0))
    return dict(got, span=span) if comm.rank == 1 else dict(got, kept=bool(np.all(x == -1.0)), span=span)


def test_a_rank_stopped_before_it_writes_never_writes_after_its_peer_gave_up(tmp_path):
    limit = 2.0
    got = run_ranks(writer_stopped, 2, limit, str(tmp_path / "done"), timeout=60, comm_timeout=20)
    if not got[0]["span"]:
        pytest.skip("no direct call on these cores")
    assert got[0]["outcome"] == "CollectiveTimeout", got[0]
    assert "rank 0" in got[0]["message"] and "allreduce #3" in got[0]["message"] and "rank 1" in got[0]["message"]
    assert limit <= got[0]["elapsed"] < limit + BOUND, got[0]
    assert got[0]["kept"], "rank 1 wrote into rank 0's buffer after rank 0 gave up on the call"
    assert got[1]["outcome"] != "ok", "rank 1 completed a call its peer had given up on"
    assert all(word in got[1]["message"] for word in ("rank 1", "allreduce #3", "rank 0")), got[1]
