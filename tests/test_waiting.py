"""Waiting: the backoff's phases, futex sleeps and wake-ups, and shared-memory
ranks that block (not spin) through long waits yet wake when their peer writes."""

from __future__ import annotations

import mmap
import resource
import threading
import time

import numpy as np
import pytest

from collectives import CollectiveTimeout
from collectives.waiting import HAVE_FUTEX, Backoff, futex_wait, futex_wake
from harness import run_ranks

needs_futex = pytest.mark.skipif(not HAVE_FUTEX, reason="no futex syscall on this platform")


def _shared_word() -> tuple[mmap.mmap, np.ndarray, int]:
    mm = mmap.mmap(-1, 4096)
    word = np.frombuffer(mm, np.int32, 1)
    return mm, word, word.ctypes.data


@needs_futex
def test_futex_wait_returns_at_once_when_the_word_changed():
    mm, word, addr = _shared_word()
    word[0] = 5
    t0 = time.monotonic()
    futex_wait(addr, 4, 10.0)  # expects 4, holds 5: no sleep at all
    assert time.monotonic() - t0 < 5.0
    del word
    mm.close()


@needs_futex
def test_futex_wake_ends_a_long_block():
    mm, word, addr = _shared_word()
    word[0] = 1
    done = threading.Event()

    def sleeper():
        futex_wait(addr, 1, 30.0)
        done.set()

    th = threading.Thread(target=sleeper, daemon=True)
    th.start()
    time.sleep(0.2)
    assert not done.is_set()  # really blocked
    word[0] = 0
    futex_wake(addr)
    assert done.wait(10.0), "the wake-up did not end the block"
    th.join(5)
    del word
    mm.close()


def test_futex_wait_times_out():
    mm, word, addr = _shared_word()
    word[0] = 1
    t0 = time.monotonic()
    futex_wait(addr, 1, 0.05)
    assert time.monotonic() - t0 >= 0.04
    del word
    mm.close()


def test_backoff_phases_spin_then_yield_for_a_while_then_block():
    calls: list[float] = []
    b = Backoff(time.monotonic() + 30, "test", spins=3, yields=2, yield_time=0.05, first_sleep=1e-3,
                max_sleep=1.0)
    for _ in range(5):  # 3 spins, 2 counted yields: no block yet
        b.pause(calls.append)
    assert calls == []
    t0 = time.monotonic()
    while not calls:
        b.pause(calls.append)
    assert time.monotonic() - t0 >= 0.04  # kept yielding for yield_time
    assert calls[0] == pytest.approx(1e-3)
    b.pause(calls.append)
    assert calls[1] == pytest.approx(1.5e-3)  # blocks grow like sleeps


def test_backoff_block_is_bounded_by_the_deadline():
    calls: list[float] = []
    b = Backoff(time.monotonic() + 0.01, "the test wait", spins=0, yields=0, first_sleep=5.0)
    with pytest.raises(CollectiveTimeout, match="the test wait timed out"):
        for _ in range(1000):
            b.pause(lambda s: (calls.append(s), time.sleep(s)))
    assert calls and max(calls) <= 0.011


def late_sender(comm, delay):
    """Rank 1 sends after ``delay`` s; rank 0 waits for it (long enough to block)."""
    t = comm.transport
    got = np.zeros(1000, np.float64)
    if comm.rank == 1:
        time.sleep(delay)
        t.isend(np.arange(1000, dtype=np.float64), 0, 3).wait(10)
        comm.barrier()
        return True
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    t.irecv(got, 1, 3).wait(10)
    waited = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    comm.barrier()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return bool(np.array_equal(got, np.arange(1000))), waited, cpu


@needs_futex
def test_a_long_receive_blocks_instead_of_burning_the_core():
    ok, waited, cpu = run_ranks(late_sender, 2, 1.0, timeout=60)[0]
    assert ok and waited >= 0.9
    assert cpu < 0.6 * waited  # mostly asleep, not spinning or yielding


def late_fence(comm, delay):
    """Every rank but the last enters the window fence ``delay`` s early."""
    w = comm.transport.window
    if comm.rank == comm.size - 1:
        time.sleep(delay)
    t0 = time.monotonic()
    w.fence(time.monotonic() + 10)
    w.fence(time.monotonic() + 10)
    return time.monotonic() - t0


@pytest.mark.parametrize("p", [2, 4])
def test_ranks_asleep_in_a_fence_wake_when_the_last_arrives(p):
    waits = run_ranks(late_fence, p, 0.5, timeout=60)
    assert all(w < 8 for w in waits)  # nobody waited for its deadline
    assert max(waits[:-1]) >= 0.4


def fence_with_long_blocks(comm, delay):
    """As :func:`late_fence`, with blocks bounded only at 5 s: a rank that is
    not rung sleeps through the whole bound."""
    import collectives.transports.shm.waking as waking

    waking.BLOCK_FIRST = waking.BLOCK_MAX = 5.0
    comm.transport._yield = 0.0  # block at once
    return late_fence(comm, delay)


def receive_with_long_blocks(comm, delay):
    import collectives.transports.shm.waking as waking

    waking.BLOCK_FIRST = waking.BLOCK_MAX = 5.0
    comm.transport._yield = 0.0
    return late_sender(comm, delay)


@needs_futex
@pytest.mark.parametrize("p", [2, 3])
def test_the_writer_rings_a_blocked_fence(monkeypatch, p):
    monkeypatch.setenv("COLLECTIVES_SHM_YIELD_US", "0")  # every wait blocks at once
    waits = run_ranks(fence_with_long_blocks, p, 0.3, timeout=60)
    assert max(waits) < 3.0  # woken by the last rank's epoch, not by the 5 s bound


@needs_futex
def test_the_sender_rings_a_blocked_receiver(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SHM_YIELD_US", "0")
    ok, waited, _ = run_ranks(receive_with_long_blocks, 2, 0.3, timeout=60)[0]
    assert ok and waited < 3.0
