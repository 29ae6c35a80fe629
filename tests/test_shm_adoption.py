"""Buffers used again and again move into the shared pool in place
(``transports.shm.pages.Adoptions``): same addresses, same contents, pages
shared with the other ranks; freed buffers are noticed; collectives on such
buffers give the right results, alone and mixed with private buffers."""

from __future__ import annotations

import ctypes
import os
import secrets
import time

import numpy as np
import pytest

from collectives import MismatchedCollective
from collectives.bench.faults import guarded, intact
from collectives.transports.shm import PAGE, SharedMemoryTransport
from harness import run_ranks


def _solo(**options):
    job = "adopt" + secrets.token_hex(4)
    return SharedMemoryTransport.open(0, 1, job=job, timeout=5, options={"shm_window_bytes": 1 << 16, **options})


def _works() -> bool:
    t = _solo()
    try:
        return t.window._adoptions.works
    finally:
        t.close()


pytestmark = pytest.mark.skipif(not _works(), reason="this kernel cannot map a shared pool's pages a second time")


def _maps_a_file(lo: int, hi: int) -> bool:
    """Whether [lo, hi) is one shared mapping of a segment's file (adopted pages)."""
    try:
        if not os.readlink(f"/proc/self/map_files/{lo:x}-{hi:x}").startswith("/dev/shm/"):
            return False
    except OSError:
        return False
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            if span == f"{lo:x}-{hi:x}":
                return perms.endswith("s")
    return False


def _bounds(x: np.ndarray) -> tuple[int, int]:
    a = x.ctypes.data
    return -(-a // PAGE) * PAGE, (a + x.nbytes) // PAGE * PAGE


def test_a_buffer_seen_again_moves_into_the_pool_in_place():
    t = _solo()
    try:
        w = t.window
        x = np.random.default_rng(1).random(3 << 18)  # 6 MiB of float64 at malloc's place in a page
        before, address = x.copy(), x.ctypes.data
        assert w.shared_part(x, adopt=True) is None  # seen once: not worth the copy yet
        off, lo, hi = w.shared_part(x, adopt=True)
        assert x.ctypes.data == address and np.array_equal(x, before)
        assert (address + lo) % PAGE == 0 and (address + hi) % PAGE == 0 and hi - lo > x.nbytes - 2 * PAGE
        assert _maps_a_file(*_bounds(x))
        pool = w.allocation(0)
        assert np.array_equal(pool[off + lo:off + hi], x.view(np.uint8)[lo:hi])
        x[lo // 8 + 5] = -1.0  # the same memory, seen from both sides
        assert pool[off + lo + 40:off + lo + 48].view(np.float64)[0] == -1.0
        pool[off + hi - 8:off + hi].view(np.float64)[0] = -2.0
        assert x[hi // 8 - 1] == -2.0
        if lo >= 8:
            assert w.shared_part(x[:lo // 8]) is None  # wholly in the first, partial page: private
        assert w.shared_part(x[1000:]) == (off + 8000, 0, hi - 8000)  # a view: the part it shares
        x[:] = 3.0
        assert np.all(x == 3.0)
    finally:
        t.close()
    assert np.all(x == 3.0) and not _maps_a_file(*_bounds(x))  # private again on close, contents kept


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mapped(nbytes: int, at: int = 0) -> np.ndarray:
    """``nbytes`` of fresh private memory from mmap (at ``at`` when given, in its place), 16 bytes in, as malloc does."""
    flags = 0x02 | 0x20 | (0x10 if at else 0)  # MAP_PRIVATE | MAP_ANONYMOUS (| MAP_FIXED)
    base = _libc.mmap(at or None, nbytes + PAGE, 3, flags, -1, 0)
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(base + 16), np.uint8)


def test_freed_memory_is_noticed_and_blocks_return_once_unmapped():
    t = _solo()
    try:
        w, free = t.window, lambda: sum(n for _, n in t._pool._free)
        empty = free()
        x = _mapped(2 << 20)
        x[:] = 5
        w.shared_part(x, adopt=True)
        assert w.shared_part(x, adopt=True) is not None and free() < empty
        base = x.ctypes.data - 16
        y = _mapped(2 << 20, at=base)  # x freed, fresh private memory in its place
        y[:] = 6
        assert y.ctypes.data == x.ctypes.data
        assert all(w.shared_part(y, adopt=True) is None for _ in range(3))  # noticed; never again here
        assert np.all(y == 6)
        z = np.ones(3 << 20, np.uint8)  # the next adoption returns the block nothing maps
        w.shared_part(z, adopt=True)
        assert w.shared_part(z, adopt=True) is not None
        lo, hi = _bounds(z)
        assert free() == empty - (hi - lo + PAGE)  # and its guard page
        _libc.munmap(base, (2 << 20) + PAGE)
    finally:
        t.close()


def test_a_new_buffer_where_a_long_used_one_was_is_adopted_again():
    t = _solo()
    try:
        w = t.window
        x = _mapped(2 << 20)
        for _ in range(2 + 4):  # adopted, then used in 4 more calls
            w.shared_part(x, adopt=True)
        base = x.ctypes.data - 16
        y = _mapped(2 << 20, at=base)  # the next phase's buffer, in the same place
        y[:] = 9
        assert w.shared_part(y, adopt=True) is None  # seen once
        assert w.shared_part(y, adopt=True) is not None and np.all(y == 9)
        _libc.munmap(base, (2 << 20) + PAGE)
    finally:
        t.close()


def test_a_forked_child_gets_private_copies():
    t = _solo()
    try:
        x = np.full(1 << 20, 1.0, np.float32)
        t.window.shared_part(x, adopt=True)
        assert t.window.shared_part(x, adopt=True) is not None
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own memory, with the parent's contents
            ok = bool(np.all(x == 1.0)) and not _maps_a_file(*_bounds(x))
            x[:] = 2.0
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        assert np.all(x == 1.0) and _maps_a_file(*_bounds(x))
    finally:
        t.close()


def test_file_mappings_and_turned_off_adoption_stay_private(tmp_path):
    t = _solo()
    try:
        path = tmp_path / "data"
        path.write_bytes(b"\1" * (4 << 20))
        m = np.memmap(path, np.uint8, "r+")
        for _ in range(3):
            assert t.window.shared_part(m, adopt=True) is None
        m[:] = 7
        m.flush()
        assert path.read_bytes()[:4] == b"\7" * 4  # still the file's pages
    finally:
        t.close()
    off = _solo(shm_adopt=0)
    try:
        x = np.ones(2 << 20, np.float32)
        assert all(off.window.shared_part(x, adopt=True) is None for _ in range(3))
    finally:
        off.close()


def _at_place(n: int, dtype, place: int) -> np.ndarray:
    raw = np.zeros(n * np.dtype(dtype).itemsize + 2 * PAGE, np.uint8)
    skip = (place - raw.ctypes.data) % PAGE
    return raw[skip:skip + n * np.dtype(dtype).itemsize].view(dtype)


def repeated_collectives(comm, n: int):
    """Allreduce, reduce_scatter and allgather, each on buffers used again at
    several places in a page: right results every call, and the buffers adopted."""
    r, p = comm.rank, comm.size
    adopted, bad = [], []
    for dtype in ("float32", "int64", "float16"):
        for place in (0, 16, 2048 + 8 * r):
            x = _at_place(n, dtype, place)
            for call in range(3):
                x[:] = (np.arange(n) % 7 + r + call).astype(dtype)
                comm.allreduce(x, algorithm="shared_window")
                want = (np.arange(n) % 7 * p + sum(range(p)) + p * call).astype(dtype)
                if not np.array_equal(x, want):
                    bad.append(("allreduce", dtype, place, call))
            adopted.append((dtype, place, comm.transport.window.shared_part(x)))
    send, recv = _at_place(n // p * p, "float32", 16), np.zeros(n // p, np.float32)
    gathered = _at_place(n // p * p, "float64", 0)
    for call in range(3):
        send[:] = np.arange(send.size) + r + call
        comm.reduce_scatter(send, recv, algorithm="shared_window")
        lo = r * (n // p)
        if not np.array_equal(recv, (np.arange(lo, lo + n // p) * p + sum(range(p)) + p * call).astype(np.float32)):
            bad.append(("reduce_scatter", call))
        gathered[:] = -1
        gathered[r * (n // p):(r + 1) * (n // p)] = r + call
        comm.allgather(gathered[r * (n // p):(r + 1) * (n // p)].copy(), gathered, algorithm="shared_window")
        if not np.array_equal(gathered, np.repeat(np.arange(p, dtype=np.float64) + call, n // p)):
            bad.append(("allgather", call))
    return bad, adopted


@pytest.mark.parametrize("p", [2, 3])
def test_collectives_on_adopted_buffers(p, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(1 << 20))
    for bad, adopted in run_ranks(repeated_collectives, p, (1 << 20) + 37, timeout=120):
        assert bad == []
        assert [(d, at) for d, at, part in adopted if part is None] == []


def mixed_and_freed(comm, n: int):
    """Rank 0 reuses its buffer (adopted); rank 1 gets fresh private memory at
    the same place for every call, as after a free and a malloc: right results."""
    x = _mapped(n * 4).view(np.float32)
    base = x.ctypes.data - 16
    bad = []
    for call in range(5):
        if comm.rank == 1:
            x = _mapped(n * 4, at=base).view(np.float32)
        x[:] = comm.rank + call
        comm.allreduce(x, algorithm="shared_window")
        if not np.all(x == 1 + 2 * call):
            bad.append(call)
    return bad, comm.transport.window.shared_part(x) is not None


def test_one_rank_adopted_the_other_fresh_each_call(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(1 << 20))
    got = run_ranks(mixed_and_freed, 2, 3 << 20, timeout=60)
    assert [bad for bad, _ in got] == [[], []]
    assert got[0][1] and not got[1][1]



def default_allgather_then_mismatch(comm, n: int):
    """Allgather of ``n`` float32 in place at the default thresholds: the
    buffer used again is adopted (the direct path publishes it) and every
    call is right; then the last rank passes a larger buffer: every rank
    raises, and no byte past any buffer changes."""
    r, p = comm.rank, comm.size
    raw, x = guarded(n, "float32", -1)
    bad = []
    for call in range(4):
        x[:] = -1
        x[r * (n // p):(r + 1) * (n // p)] = r + call
        comm.allgather(None, x)
        if not np.array_equal(x, np.repeat(np.arange(p, dtype=np.float32) + call, n // p)):
            bad.append(call)
    adopted = comm.transport.window.shared_part(x) is not None
    m = n + p if r == p - 1 else n
    raw2, y = (raw, x) if m == n else guarded(m, "float32", 7)
    t0 = time.monotonic()
    try:
        comm.allgather(None, y, timeout=10)
        outcome = "ok"
    except MismatchedCollective as exc:
        outcome = str(exc)
    return bad, adopted, outcome, time.monotonic() - t0, intact([raw, raw2], [n, m])


#: Past every span of the direct compiled calls: the pool's direct path at its own default sizes.
NO_COMPILED_DIRECT = str(1 << 50)


def test_allgather_reads_adopted_buffers_directly_at_four_ranks_by_default(monkeypatch):
    """4 ranks share 2 cores here: allgather takes the pool's direct path
    from 4 MiB (where the direct compiled call does not take it first)."""
    monkeypatch.delenv("COLLECTIVES_WINDOW_DIRECT_BYTES", raising=False)
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", NO_COMPILED_DIRECT)
    n = (4 << 20) // 4
    got = run_ranks(default_allgather_then_mismatch, 4, n, timeout=120, comm_timeout=20)
    for r, (bad, adopted, outcome, took, guards) in enumerate(got):
        assert bad == [] and guards, (r, bad, guards)
        assert adopted, f"rank {r}: the buffer was not adopted (the direct path did not run)"
        assert outcome == (f"rank {r}: allgather #5: rank 3 has float32 x {n + 4}, ranks 0, 1, 2 have "
                           f"float32 x {n}"), (r, outcome)
        assert took < 10, (r, took)


def default_alltoall(comm, n: int):
    """Alltoall of ``n`` float32 at the default thresholds, the same buffers
    each call: right every call, and the send buffer adopted (the direct
    path publishes it)."""
    r, p = comm.rank, comm.size
    send, recv = np.empty(n, np.float32), np.empty(n, np.float32)
    b = n // p
    bad = []
    for call in range(4):
        send[:] = np.repeat(np.arange(p, dtype=np.float32) * 100 + r + call, b)
        comm.alltoall(send, recv)
        if not np.array_equal(recv, np.repeat(np.arange(p, dtype=np.float32) + r * 100 + call, b)):
            bad.append(call)
    return bad, comm.transport.window.shared_part(send) is not None


def test_alltoall_reads_directly_from_2_mib_at_four_ranks_by_default(monkeypatch):
    """The pool's direct path (where the direct compiled call does not take it first)."""
    monkeypatch.delenv("COLLECTIVES_WINDOW_DIRECT_BYTES", raising=False)
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", NO_COMPILED_DIRECT)
    for r, (bad, adopted) in enumerate(run_ranks(default_alltoall, 4, (2 << 20) // 4, timeout=120)):
        assert bad == [] and adopted, (r, bad, adopted)
