"""The shared-memory transport on real processes: rings, tags, errors, cleanup."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import re
import secrets
import signal
import time

import numpy as np
import pytest

from collectives import CollectiveTimeout, MismatchedCollective, PeerLost
from collectives.transports.shm import (BOUNCE_BYTES, HUGE_PAGE, PAGE, SharedMemoryTransport, huge_pages,
                                        segment_path, skewed)
import harness
from harness import run_ranks


def _left_by(job: str, size: int) -> list[str]:
    """The segments of ``job``'s ranks still in /dev/shm."""
    return [path for path in (segment_path(job, r) for r in range(size)) if os.path.exists(path)]


def _pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def bidirectional_large(comm):
    t, other = comm.transport, 1 - comm.rank
    n = 9 * (1 << 20) + 13  # several ring lengths, not a multiple of anything
    out, into = _pattern(n, comm.rank), np.zeros(n, np.uint8)
    send = t.isend(out, other, 7)  # both send before either receives
    recv = t.irecv(into, other, 7)
    t.waitall([send, recv], 20)
    return bool(np.array_equal(into, _pattern(n, other)))


def test_large_messages_both_ways_do_not_deadlock():
    assert run_ranks(bidirectional_large, 2, timeout=60) == [True, True]


def many_tags_out_of_order(comm, sent):
    # point-to-point tags (even): any number may be in flight at once, unlike
    # a collective call's (odd), of which a rank runs one at a time
    t = comm.transport
    sizes = [0, 1, 15, 16, 17, 4096, 300_000, 1_500_000]
    if comm.rank == 0:
        reqs = [t.isend(_pattern(n, tag), 1, 2 * tag) for tag, n in enumerate(sizes)]
        # three messages with one tag must arrive in the order sent
        reqs += [t.isend(np.full(3, i, np.int32), 1, 198) for i in range(3)]
        sent.set()  # every message is on its way before any receive is posted
        t.waitall(reqs, 20)
        return True
    assert sent.wait(20)
    bufs = {tag: np.zeros(n, np.uint8) for tag, n in enumerate(sizes)}
    reqs = [t.irecv(bufs[tag], 0, 2 * tag) for tag in reversed(range(len(sizes)))]
    fifo = [np.zeros(3, np.int32) for _ in range(3)]
    reqs += [t.irecv(b, 0, 198) for b in fifo]
    t.waitall(reqs, 20)
    ok = all(np.array_equal(bufs[tag], _pattern(n, tag)) for tag, n in enumerate(sizes))
    return ok and [int(b[0]) for b in fifo] == [0, 1, 2]


def test_many_tags_in_flight_out_of_order_and_fifo_per_tag():
    sent = multiprocessing.get_context("fork").Event()
    assert run_ranks(many_tags_out_of_order, 2, sent, timeout=60) == [True, True]


def ring_exchange(comm):
    t, p, r = comm.transport, comm.size, comm.rank
    results = []
    for n in (0, 1, 8, 70_000):
        into = np.zeros(n, np.uint8)
        reqs = [t.irecv(into, (r - 1) % p, 3), t.isend(_pattern(n, r), (r + 1) % p, 3)]
        t.waitall(reqs, 20)
        results.append(bool(np.array_equal(into, _pattern(n, (r - 1) % p))))
    mine = np.zeros(5, np.uint8)  # to itself
    t.waitall([t.isend(_pattern(5, 1), r, 4), t.irecv(mine, r, 4)], 5)
    results.append(bool(np.array_equal(mine, _pattern(5, 1))))
    return all(results)


@pytest.mark.parametrize("p", [1, 3])
def test_zero_byte_small_and_self_messages(p):
    assert all(run_ranks(ring_exchange, p, timeout=60))


RING = 64 * 1024  # the smallest ring: its end comes round often


def _ring_sizes() -> list[int]:
    """Message sizes whose headers start at every 16-byte offset of the ring's
    last 64 bytes, the two where a 48-byte header runs past the end included."""
    sizes = [(i * 7) % 41 for i in range(4000)]
    head, starts = 0, set()
    for n in sizes:
        starts.add(head % RING)
        head += 48 + (n + 15) // 16 * 16
    assert {RING - 64, RING - 48, RING - 32, RING - 16} <= starts
    return sizes


def headers_across_the_ring_end(comm):
    t, sizes = comm.transport, _ring_sizes()
    if comm.rank == 0:
        t.waitall([t.isend(_pattern(n, i), 1, 2 + 2 * (i % 3)) for i, n in enumerate(sizes)], 30)
        return True
    for i, n in enumerate(sizes):
        got = np.zeros(n, np.uint8)
        t.irecv(got, 0, 2 + 2 * (i % 3)).wait(30)
        if not np.array_equal(got, _pattern(n, i)):
            return f"message {i} ({n} bytes) differs"
    return True


def test_headers_that_run_past_the_ring_end(monkeypatch):
    """A header starting in the ring's last 32 bytes wraps to its start (it
    used to raise struct.error and abort the job)."""
    monkeypatch.setenv("COLLECTIVES_SHM_RING_BYTES", str(RING))
    assert run_ranks(headers_across_the_ring_end, 2, timeout=60) == [True, True]


def size_mismatch(comm, early: bool, sent):
    t = comm.transport
    if comm.rank == 0:
        t.isend(np.zeros(10, np.uint8), 1, 5).wait(10)
        t.isend(np.ones(4, np.uint8), 1, 6).wait(10)
        sent.set()
        return "sent"
    if early:
        assert sent.wait(10)  # both messages are in the ring before the receive is posted
    try:
        t.irecv(np.zeros(12, np.uint8), 0, 5).wait(10)
    except MismatchedCollective:
        after = np.zeros(4, np.uint8)  # the stream stays usable
        t.irecv(after, 0, 6).wait(10)
        return "mismatch" if after.sum() == 4 else "corrupt"
    return "no error"


@pytest.mark.parametrize("early", [False, True])
def test_size_mismatch_raises(early):
    sent = multiprocessing.get_context("fork").Event()
    assert run_ranks(size_mismatch, 2, early, sent, timeout=60) == ["sent", "mismatch"]


def killed_peer(comm):
    t = comm.transport
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if comm.rank == 0:
            t.irecv(np.zeros(8, np.uint8), 1, 1).wait(15)
        else:
            t.window.fence(time.monotonic() + 15)
    except PeerLost as exc:
        return exc.peer, round(time.monotonic() - start, 3)
    return None


def test_killed_rank_raises_peer_lost_and_leaves_nothing():
    outcomes = run_ranks(killed_peer, 3, timeout=60, expect_errors=True)
    assert outcomes[1].error_type == "ProcessDied"
    for o in (outcomes[0], outcomes[2]):
        assert o.ok and o.value is not None, str(o)
        peer, seconds = o.value
        assert peer == 1 and seconds < 5
    assert not _left_by(harness.last_job, 3)


def aborting_peer(comm):
    t = comm.transport
    if comm.rank == 0:
        t.abort("disk full")
        return "aborted"
    try:
        t.irecv(np.zeros(1, np.uint8), 0, 1).wait(15)
    except PeerLost as exc:
        return "disk full" in str(exc)
    return False


def test_abort_reaches_peers_with_its_reason():
    assert run_ranks(aborting_peer, 2, timeout=60) == ["aborted", True]


def abort_while_a_peer_is_in_init(comm, flag: str):
    """Rank 1 aborts in its first call while rank 0 still waits for rank 2
    in a point-to-point exchange before any call (as in ``init``'s): rank
    0's wait ends with rank 2's message, and its first call raises rank 1's
    error. Ranks 1 and 2 stay until rank 0 is done (the file ``flag``)."""
    from collectives.transports.shm.layout import Q_ABORT
    t, deadline = comm.transport, time.monotonic() + 30

    def until_rank_0_is_done(outcome: str) -> str:
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "rank 0 never finished"
            os.sched_yield()
        return outcome

    if comm.rank == 1:
        t.abort("rank 1: allgather #1: it broke", seq=1)
        return until_rank_0_is_done("aborted")
    while not t._segs[1].q[Q_ABORT]:
        assert time.monotonic() < deadline, "rank 1 never aborted"
        os.sched_yield()
    if comm.rank == 2:
        t.isend(np.arange(4, dtype=np.float64), 0, 7).wait(15)
        return until_rank_0_is_done("sent")
    try:
        got = np.zeros(4)
        t.irecv(got, 2, 7).wait(15)
        lost = t._lost_peer({2})  # the check every wait makes now and then
        t0 = time.monotonic()
        try:
            comm.allreduce(np.ones(1))
            first = "completed"
        except PeerLost as exc:
            first = str(exc)
        return got.tolist(), lost, first, time.monotonic() - t0
    finally:
        open(flag, "w").close()


def test_an_abort_in_a_call_waits_for_a_peer_still_in_init(tmp_path):
    got, lost, first, seconds = run_ranks(abort_while_a_peer_is_in_init, 3, str(tmp_path / "done"), timeout=60)[0]
    assert got == [0.0, 1.0, 2.0, 3.0] and lost is None, (got, lost)
    assert "rank 1" in first and "it broke" in first and seconds < 5, (first, seconds)


def window_and_alloc(comm):
    w, r, p = comm.transport.window, comm.rank, comm.size
    region = w.region(r)
    region[:8] = r + 1
    w.fence(time.monotonic() + 10)
    seen = [int(w.region(k)[0]) for k in range(p)]
    w.fence(time.monotonic() + 10)
    arr = comm.alloc(1000, np.float64)
    where = w.locate(arr)
    private = w.locate(np.zeros(10))
    return seen, where is not None and where[0] == r, private


def test_window_fence_regions_and_alloc_locate():
    for seen, located, private in run_ranks(window_and_alloc, 3, timeout=60):
        assert seen == [1, 2, 3] and located and private is None


def cross_memory(comm, compiled_moves: bool):
    """Each rank writes its rank into the next rank's private array and reads
    it back; a write to an unmapped address raises PeerLost, which names the
    kernel's reason. ``compiled_moves`` False: through ctypes, not the
    compiled extension."""
    from collectives.transports.shm import cma
    if not compiled_moves:
        cma._vm_move = None
    w, r, p = comm.transport.window, comm.rank, comm.size
    mine = np.full(1000, -1, np.int64)
    addrs = np.zeros(p, np.int64)
    addrs[r] = mine.ctypes.data
    comm.allgather(None, addrs)
    nxt, prev = (r + 1) % p, (r - 1) % p
    w.write(nxt, int(addrs[nxt]) + 8 * 10, np.full(5, r, np.int64))
    comm.barrier()
    got = np.zeros(5, np.int64)
    w.read(nxt, int(addrs[nxt]) + 8 * 10, got)
    try:
        w.write(nxt, 8, got)
        refused = ""
    except PeerLost as e:
        refused = str(e)
    comm.barrier()
    return "direct_access" in w.features, mine[10:15].tolist() == [prev] * 5, got.tolist() == [r] * 5, refused


@pytest.mark.parametrize("compiled_moves", [True, False])
def test_window_reads_and_writes_private_memory(compiled_moves):
    for r, (cma, written, read, refused) in enumerate(run_ranks(cross_memory, 3, compiled_moves, timeout=60)):
        assert cma and written and read
        assert f"rank {r}: cannot write 40 B to rank {(r + 1) % 3}'s memory (Bad address)" in refused, refused


def _at_place(raw: np.ndarray, place: int, n: int) -> np.ndarray:
    """``n`` bytes of ``raw`` starting ``place`` bytes into a page."""
    skip = (place - raw.ctypes.data) % PAGE
    return raw[skip:skip + n]


def skewed_cross_memory(comm):
    """Writes into the next rank's memory and reads back, with the destination
    0, 1, 16, 31 and 32 bytes past the source's place in a page (1 to 31 go
    through the bounce buffer), over more than two bounce buffers' worth."""
    w, r, p = comm.transport.window, comm.rank, comm.size
    nxt, prev = (r + 1) % p, (r - 1) % p
    n = 2 * BOUNCE_BYTES + 1234
    raw = np.zeros(n + 2 * PAGE, np.uint8)
    addrs = np.zeros(p, np.int64)
    addrs[r] = raw.ctypes.data
    comm.allgather(None, addrs)
    pattern = (np.arange(n) * 7 % 251).astype(np.uint8)
    bad = []
    for skew in (0, 1, 16, 31, 32):
        src = _at_place(np.zeros(n + PAGE, np.uint8), 100, n)
        src[:] = pattern + r
        theirs = int(addrs[nxt]) + (100 + skew - int(addrs[nxt])) % PAGE
        if skewed(src.ctypes.data, theirs) != (0 < skew < 32):
            bad.append(f"skewed() wrong at {skew}")
        w.write(nxt, theirs, src)
        comm.barrier()
        if not np.array_equal(_at_place(raw, 100 + skew, n), pattern + prev):
            bad.append(f"write skewed {skew}")
        got = _at_place(np.zeros(n + PAGE, np.uint8), 100 + 2 * skew, n)
        w.read(nxt, theirs, got)
        if not np.array_equal(got, pattern + r):
            bad.append(f"read skewed {skew}")
        comm.barrier()
    return bad


def test_window_moves_skewed_private_memory():
    assert run_ranks(skewed_cross_memory, 3, timeout=60) == [[]] * 3


def _private_buffer(nbytes: int, huge: bool) -> np.ndarray:
    """A written private buffer that starts at a huge page's start, with or without huge pages."""
    m = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    raw = np.frombuffer(m, np.uint8)
    skip = (-raw.ctypes.data) % HUGE_PAGE
    buf = raw[skip:skip + nbytes]
    buf[:] = 1
    return buf


def _huge_pages_work() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            enabled = "[never]" not in f.read()
    except OSError:
        return False
    probe = _private_buffer(2 * HUGE_PAGE, True)
    return enabled and huge_pages(probe.ctypes.data, probe.nbytes) is not None


def test_huge_pages_tells_buffers_apart():
    small = _private_buffer(4 * HUGE_PAGE, False)
    assert huge_pages(small.ctypes.data, small.nbytes) in (False, None)
    assert huge_pages(small.ctypes.data, HUGE_PAGE - PAGE) is False  # no whole huge page inside
    if not _huge_pages_work():
        pytest.skip("no transparent huge pages, or a kernel without PAGEMAP_SCAN")
    large = _private_buffer(4 * HUGE_PAGE, True)
    assert huge_pages(large.ctypes.data, large.nbytes) is True
    assert huge_pages(large.ctypes.data + 16, large.nbytes - 16) is True  # the interior counts


def paths_by_page_size(comm):
    """8 MiB allreduces, each rank's buffer with huge pages or not: the direct
    path (reads through cross-memory attach) only when every buffer has them."""
    window, r = comm.transport.window, comm.rank
    reads = []
    real_read = window.read

    def counted_read(*args):
        reads.append(1)
        return real_read(*args)

    window.read = counted_read
    out = []
    for huge in ((True, True), (True, False), (False, False)):
        x = _private_buffer(8 << 20, huge[r]).view(np.float32)
        x[:] = r + 1
        del reads[:]
        comm.allreduce(x, algorithm="shared_window")
        out.append((bool(reads), bool(np.all(x == 3))))
    window.read = real_read
    return out


def test_direct_allreduce_only_from_huge_pages(monkeypatch):
    monkeypatch.delenv("COLLECTIVES_WINDOW_DIRECT_BYTES", raising=False)
    monkeypatch.setenv("COLLECTIVES_SHM_CMA", "1")
    if not _huge_pages_work():
        pytest.skip("no transparent huge pages, or a kernel without PAGEMAP_SCAN")
    for got in run_ranks(paths_by_page_size, 2, timeout=60):
        assert got == [(True, True), (False, True), (False, True)]


def test_rendezvous_timeout_leaves_nothing():
    job = "lonely" + secrets.token_hex(4)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout):
        SharedMemoryTransport.open(0, 2, job=job, timeout=0.5, options={})
    assert time.monotonic() - start < 5
    assert not os.path.exists(segment_path(job, 0))


def test_window_halves_hold_half_the_window_bytes():
    """A window of W bytes takes messages of W/2 in one step (its header is extra)."""
    from collectives.algorithms.window.state import WindowState
    from collectives.algorithms.window.tuning import PIECE_BYTES

    job = "halves" + secrets.token_hex(4)
    t = SharedMemoryTransport.open(0, 1, job=job, timeout=5,
                                   options={"shm_window_bytes": 2 * PIECE_BYTES, "shm_alloc_bytes": 1 << 20})
    try:
        assert WindowState(t.window, 1).half >= PIECE_BYTES
    finally:
        t.close()


def test_single_rank_open_close_is_idempotent():
    job = "solo" + secrets.token_hex(4)
    small = {"shm_window_bytes": 1 << 16, "shm_alloc_bytes": 1 << 20}
    t = SharedMemoryTransport.open(0, 1, job=job, timeout=5, options=small)
    buf = np.zeros(3, np.uint8)
    t.waitall([t.isend(np.arange(3, dtype=np.uint8), 0, 2), t.irecv(buf, 0, 2)], 5)
    assert buf.tolist() == [0, 1, 2]
    assert not os.path.exists(segment_path(job, 0))
    t.close()
    t.close()


def window_collectives(comm):
    """Every shared-window collective on private and comm.alloc buffers, small to large."""
    p, r, bad = comm.size, comm.rank, []
    for use_alloc in (False, True):
        for n in (250, 25_003, 800_001):
            def buffer(count):
                arr = comm.alloc(count, np.float32) if use_alloc else np.empty(count, np.float32)
                return arr

            x = buffer(n)
            x[...] = np.arange(n) % 7 + r
            comm.allreduce(x, "sum", algorithm="shared_window")
            if not np.array_equal(x, (np.arange(n) % 7) * p + p * (p - 1) / 2):
                bad.append(f"allreduce n={n} alloc={use_alloc}")
            root = p - 1
            y = buffer(n)
            y[...] = np.arange(n) if r == root else -1
            comm.bcast(y, root, algorithm="shared_window")
            if not np.array_equal(y, np.arange(n, dtype=np.float32)):
                bad.append(f"bcast n={n} alloc={use_alloc}")
            g = buffer(n * p)
            g[...] = -1
            g[r * n:(r + 1) * n] = r
            comm.allgather(None, g, algorithm="shared_window")
            if not np.array_equal(g, np.repeat(np.arange(p, dtype=np.float32), n)):
                bad.append(f"allgather n={n} alloc={use_alloc}")
            s, out = buffer(n * p), np.zeros(n, np.float32)
            s[...] = np.arange(n * p) % 5
            comm.reduce_scatter(s, out, "max", algorithm="shared_window")
            if not np.array_equal(out, (np.arange(r * n, (r + 1) * n) % 5).astype(np.float32)):
                bad.append(f"reduce_scatter n={n} alloc={use_alloc}")
    return bad


@pytest.mark.parametrize("cma", ["1", "0"])
def test_window_collectives_private_and_shared_buffers(cma, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_CMA", cma)
    monkeypatch.setenv("COLLECTIVES_SHM_WINDOW_BYTES", str(1 << 20))
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(2 << 20))  # the largest read directly
    for bad in run_ranks(window_collectives, 3, timeout=120):
        assert not bad


def test_peer_checks_from_several_threads_at_once():
    """Waits of one transport may run in several threads (the torch backend
    waits in its own): the peer watch answers them all at once, never
    raising (a poll object taken by two threads at once raises
    "concurrent poll() invocation", which aborted a rank), and each sees a
    peer die."""
    import subprocess
    import sys
    import threading

    from collectives.transports.shm.liveness import PeerWatch

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    watch = PeerWatch({1: child.pid})
    start, errors, seen = threading.Barrier(8), [], []

    def ask(calls: int) -> None:
        start.wait(timeout=30)
        try:
            for _ in range(calls):
                if watch.dead():
                    seen.append("dead too early")
                    return
        except Exception as exc:  # noqa: BLE001  (the failure this test is about)
            errors.append(f"{type(exc).__name__}: {exc}")

    try:
        threads = [threading.Thread(target=ask, args=(20000,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and not seen, (errors[:3], seen[:3])
        child.stdin.close()
        child.wait(timeout=30)
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(watch.dead())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert answers == [{1}] * 8, answers
    finally:
        watch.close()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def _shared_mappings_of(job: str) -> list[str]:
    """This process's shared mappings of ``job``'s segment files."""
    names = {os.path.basename(segment_path(job, r)) for r in range(64)}
    with open("/proc/self/maps") as f:  # address perms offset dev inode path [(deleted)]
        return [line.strip() for line in f
                if " rw-s " in line and len(line.split()) > 5 and os.path.basename(line.split()[5]) in names]


def closed_communicators_unmap(comm, rounds: int) -> list[str]:
    """Communicators made and closed in turn, each after calls that leave
    what the window algorithms keep (views, compiled calls, prepared calls,
    calls from C, two steps, pieces, a nonblocking call): once closed, none
    of its memory stays mapped, without waiting for the garbage collector."""
    import gc

    from collectives.bench.faults import fresh

    gc.disable()
    bad = []
    try:
        for t in range(rounds):
            c = fresh(f"unmap{t}", 30.0)
            job = c.transport._job
            for n in (8, 5_000, 100_000, 700_000):
                x = np.ones(n, np.float32)
                for _ in range(3):
                    c.allreduce(x)
                    c.allreduce(x, out=np.empty_like(x))
                    c.bcast(x, 0)
                    c.reduce(x, c.size - 1)
                    c.allgather(x[:n // 4], np.empty(n // 4 * c.size, np.float32))
                    c.alltoall(np.ones(n // 4 * c.size, np.float32), np.empty(n // 4 * c.size, np.float32))
                c.iallreduce(x).wait()
            if not _shared_mappings_of(job):
                bad.append(f"round {t}: no mapping of its own segments seen while it was open")
            c.close()
            left = _shared_mappings_of(job)
            if left:
                bad.append(f"round {t}: {len(left)} mappings left after close: {left[:2]}")
    finally:
        gc.enable()
    return bad


@pytest.mark.parametrize("p", [2, 3])
def test_a_closed_communicator_leaves_nothing_mapped(p):
    for r, bad in enumerate(run_ranks(closed_communicators_unmap, p, 4, timeout=120)):
        assert not bad, f"rank {r}: {bad[:3]}"


def _race_rank(rank: int, size: int, job: str, options: dict, out) -> None:
    t = SharedMemoryTransport.open(rank, size, job=job, timeout=20, options=options)
    try:
        out.put((rank, t.cma_from, t.cores, dict(t.copy_race)))
    finally:
        t.close()


@pytest.mark.parametrize("p,settings", [(2, (None, None)), (3, (None, None, None)), (2, ("1", "0")),
                                        (2, ("0", "1")), (3, (None, "0", "0"))])
def test_the_copy_race_is_one_answer_on_every_rank(p, settings):
    """Every rank takes rank 0's answer: its setting, else the race it ran
    with rank 1; a peer's setting does not count."""
    from collectives.transports.shm.copy_race import NEVER, RACE_SIZES
    job = "race" + secrets.token_hex(4)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_race_rank, daemon=True,
                         args=(r, p, job, {} if s is None else {"shm_cma_faster": s}, out))
             for r, s in enumerate(settings)]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0, f"a rank exited with {proc.exitcode}"
    assert time.monotonic() - start < 60
    answers = {cma_from for _, cma_from, _, _ in got}
    assert len(answers) == 1, f"ranks disagree: {got}"
    timed = [times for _, _, _, times in got if times]
    if settings[0] is not None:
        assert answers == {0 if settings[0] == "1" else NEVER} and not timed
    else:  # rank 0 raced, and only rank 0 keeps the times
        assert len(timed) == 1 and got[0][3] == timed[0] and sorted(timed[0]) == list(RACE_SIZES)
        wins = [t["read_ns"] < t["copy_in_ns"] + t["copy_out_ns"] for t in timed[0].values()]
        assert all(t[k] > 0 for t in timed[0].values() for k in ("copy_in_ns", "copy_out_ns", "read_ns"))
        # from the smallest size from which the read won at every size raced
        want = next((0 if i == 0 else RACE_SIZES[i] for i in range(len(wins)) if all(wins[i:])), NEVER)
        assert answers == {want}, (timed[0], answers)


def test_the_race_answers_from_where_the_read_won_at_every_larger_size():
    from collectives.transports.shm.copy_race import NEVER, answer

    sizes = [256 << 10, 1 << 20]
    assert answer(sizes, [True, True]) == 0
    assert answer(sizes, [False, True]) == 1 << 20
    assert answer(sizes, [True, False]) == NEVER
    assert answer(sizes, [False, False]) == NEVER
    assert answer([256 << 10], [True]) == 0 and answer([256 << 10], [False]) == NEVER


def _racer_who_dies(rank: int, size: int, job: str, out) -> None:
    """Rank 1 exits when rank 0 asks it to race (before the first round); the others report."""
    from collectives.transports.shm import copy_race

    if rank == 1:
        copy_race._writer = lambda *args: os._exit(3)
    start = time.monotonic()
    try:
        t = SharedMemoryTransport.open(rank, size, job=job, timeout=20, options={})
    except Exception as exc:  # noqa: BLE001 - the outcome is the test's
        out.put((rank, type(exc).__name__, str(exc), time.monotonic() - start))
    else:
        out.put((rank, "ok", "", time.monotonic() - start))
        t.close()


def test_a_rank_lost_in_the_copy_race_fails_every_rank_and_leaves_nothing():
    job = "racedies" + secrets.token_hex(4)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_racer_who_dies, args=(r, 3, job, out), daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    got = sorted(out.get(timeout=60) for _ in range(2))
    for proc in procs:
        proc.join(30)
    assert procs[1].exitcode == 3
    for rank, outcome, message, took in got:
        assert outcome == "PeerLost", f"rank {rank}: {outcome}: {message}"
        assert took < 10, f"rank {rank} took {took:.1f} s"
    assert re.search(rf"rank 0: rank 1 \(pid \d+\) died, in the shared-memory rendezvous of job '{job}'",
                     got[0][2]), got[0]
    assert not _left_by(job, 3)
