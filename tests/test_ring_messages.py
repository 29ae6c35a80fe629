"""Whole messages through the shared-memory rings, in C (``collectives/_rings.c``)
and in Python: the same bytes, the same checks (tag, size, signature), the
ring's end crossed, and blocking receives that wait in C a while and then as
any receive does."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

from collectives import BadArgument, MismatchedCollective, compiled, signature
from harness import run_ranks

needs_rings = pytest.mark.skipif(compiled.rings is None, reason="the rings' C extension is not built here")

RING = 64 * 1024  # the smallest ring the transport makes: its end comes round often
HEAD_I, TAIL_I, SLEEP_I = 0, 8, 16  # control words (each in a cache line of its own, as in a segment)


def _pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def _ring(size: int = RING):
    """A ring and its control words in this process (the sender's and the
    receiver's view are the same memory here)."""
    return bytearray(size), memoryview(bytearray(24 * 8)).cast("Q")


SIG = signature.make("bcast", "binomial", None, 0, np.dtype(np.uint8), 5)


@needs_rings
def test_put_and_take_cross_the_ring_end_with_every_header_offset():
    """Messages whose headers start at every 16-byte offset of the ring's last
    64 bytes (two of them run past its end) come out as they went in."""
    rings = compiled.rings
    ring, q = _ring()
    head = tail = 0
    starts = set()
    for i in range(4000):
        n = (i * 7) % 41
        starts.add(head % RING)
        new = rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, head, 2 + 2 * (i % 3), *SIG, _pattern(n, i))
        assert new == head + 48 + (n + 15) // 16 * 16 == q[HEAD_I]
        head = new
        got = np.zeros(n, np.uint8)
        tail = rings.take(ring, q, HEAD_I, TAIL_I, tail, 2 + 2 * (i % 3), *SIG, got, 0)
        assert tail == head == q[TAIL_I]
        assert np.array_equal(got, _pattern(n, i)), f"message {i} ({n} bytes) differs"
    assert {RING - 64, RING - 48, RING - 32, RING - 16} <= starts


@needs_rings
def test_take_refuses_another_message_and_leaves_it_whole():
    """-2 for a message of another tag, size or signature (the caller routes
    it and reports the disagreement); nothing is consumed; then the right
    receive takes it."""
    rings = compiled.rings
    ring, q = _ring()
    head = rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 6, *SIG, _pattern(20, 1))
    refused = signature.refused(SIG)
    other = signature.make("bcast", "binomial", None, 1, np.dtype(np.uint8), 5)
    for tag, n, sig in [(4, 20, SIG), (6, 21, SIG), (6, 19, SIG), (6, 20, other), (6, 20, refused)]:
        got = np.zeros(n, np.uint8)
        assert rings.take(ring, q, HEAD_I, TAIL_I, 0, tag, *sig, got, 0) == -2
        assert not got.any() and q[TAIL_I] == 0
    got = np.zeros(20, np.uint8)
    assert rings.take(ring, q, HEAD_I, TAIL_I, 0, 6, *SIG, got, 0) == head
    assert np.array_equal(got, _pattern(20, 1))


@needs_rings
def test_put_refuses_what_does_not_fit_and_take_what_has_not_arrived():
    rings = compiled.rings
    ring, q = _ring()
    assert rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 2, *SIG, np.zeros(RING, np.uint8)) == -1
    head = rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 2, *SIG, np.zeros(RING - 48, np.uint8))
    assert head == RING  # exactly full
    assert rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, head, 2, *SIG, np.zeros(0, np.uint8)) == -1
    q[HEAD_I] = 0  # as if nothing were published: a receive finds nothing, after its spin
    start = time.monotonic()
    assert rings.take(ring, q, HEAD_I, TAIL_I, 0, 2, *SIG, np.zeros(8, np.uint8), 2_000_000) == -1
    assert 0.0015 < time.monotonic() - start < 5.0
    q[HEAD_I] = 40  # a header not yet whole
    assert rings.take(ring, q, HEAD_I, TAIL_I, 0, 2, *SIG, np.zeros(8, np.uint8), 0) == -1


@needs_rings
def test_bad_rings_and_words_raise_instead_of_writing_anywhere():
    rings = compiled.rings
    ring, q = _ring()
    with pytest.raises(ValueError, match="power of two"):
        rings.put(bytearray(1000), q, HEAD_I, TAIL_I, SLEEP_I, 0, 2, *SIG, np.zeros(4, np.uint8))
    with pytest.raises(IndexError, match="control word"):
        rings.put(ring, q, HEAD_I, 24, SLEEP_I, 0, 2, *SIG, np.zeros(4, np.uint8))
    with pytest.raises(IndexError, match="control word"):
        rings.take(ring, q, -1, TAIL_I, 0, 2, *SIG, np.zeros(4, np.uint8), 0)
    with pytest.raises(ValueError, match="disagree"):
        rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, 2 * RING, 2, *SIG, np.zeros(4, np.uint8))
    with pytest.raises(BufferError):
        rings.take(ring, q, HEAD_I, TAIL_I, 0, 2, *SIG, b"read-only", 0)
    with pytest.raises(TypeError):
        rings.put(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 2, *SIG)
    assert not any(ring) and not any(q)


@needs_rings
@pytest.mark.parametrize("n", [0, 5, RING - 48, 3 * RING + 5, 1 << 20])
def test_streams_in_two_threads_move_any_size_through_a_smaller_ring(n):
    """send_stream and recv_stream at once (each lets go of the GIL): the
    message comes out whole through a ring of 64 KiB, its end crossed many
    times, a chunk at a time; both stop at the message's end."""
    import threading

    rings = compiled.rings
    ring, q = _ring()
    sender_q = memoryview(bytearray(24 * 8)).cast("Q")
    sent = _pattern(n, 9)
    got = np.zeros(n, np.uint8)
    ends = {}
    wire = 48 + (n + 15) // 16 * 16
    spin = 2_000_000_000  # no stop for want of room or data while the other thread runs

    def send():
        ends["head"] = rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 6, *SIG, sent, 0, 0, 4096, spin)

    def receive():
        ends["tail"] = rings.recv_stream(ring, q, HEAD_I, TAIL_I, 0, 6, *SIG, got, 0, sender_q, SLEEP_I, 4096, spin)

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert ends == {"head": wire, "tail": wire} and q[HEAD_I] == q[TAIL_I] == wire
    assert np.array_equal(got, sent)


@needs_rings
def test_streams_stop_when_nothing_comes_and_leave_another_message_alone():
    rings = compiled.rings
    ring, q = _ring()
    sender_q = memoryview(bytearray(24 * 8)).cast("Q")
    big = np.zeros(RING * 2, np.uint8)
    start = time.monotonic()
    head = rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 6, *SIG, big, 0, 0, 4096, 1_000_000)
    assert head == RING == q[HEAD_I] and time.monotonic() - start < 5  # full: it stops, the caller goes on
    for tag, n in [(8, RING * 2), (6, RING * 2 + 1)]:  # another tag, another size: nothing taken
        assert rings.recv_stream(ring, q, HEAD_I, TAIL_I, 0, tag, *SIG, np.zeros(n, np.uint8), 0, sender_q,
                                 SLEEP_I, 4096, 0) == -2
    assert q[TAIL_I] == 0
    got = np.zeros(RING * 2, np.uint8)
    tail = rings.recv_stream(ring, q, HEAD_I, TAIL_I, 0, 6, *SIG, got, 0, sender_q, SLEEP_I, 4096, 1_000_000)
    assert tail == RING == q[TAIL_I]  # all that was there, then nothing more came
    assert rings.recv_stream(ring, q, HEAD_I, TAIL_I, RING, 6, *SIG, got, RING, sender_q, SLEEP_I, 4096, 0) == RING
    # the rest of the message, a ring at a time: no header again, each side going on from where it stopped
    big[:] = _pattern(big.size, 4)
    end = 2 * RING + 48
    while q[TAIL_I] < end:
        head = rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, head, 6, *SIG, big, head, 0, 4096, 0)
        tail = rings.recv_stream(ring, q, HEAD_I, TAIL_I, tail, 6, *SIG, got, tail, sender_q, SLEEP_I, 4096, 0)
        assert tail == head == q[TAIL_I] == q[HEAD_I] <= end
    assert np.array_equal(got[RING - 48:], big[RING - 48:])  # what the first ring held was zeros then
    with pytest.raises(ValueError, match="bytes taken"):
        rings.recv_stream(ring, q, HEAD_I, TAIL_I, tail, 6, *SIG, got, 20, sender_q, SLEEP_I, 4096, 0)


@needs_rings
def test_a_send_stream_goes_on_from_where_a_message_stopped():
    """send_stream from ``sent`` wire bytes of the message already in the
    ring (the header among them): no second header, the payload from where
    it stopped; a ``sent`` that cannot be (inside the header, past the
    message) raises."""
    rings = compiled.rings
    ring, q = _ring()
    payload = _pattern(2 * RING, 5)
    assert rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, 0, 6, *SIG, payload, 0, 0, 4096, 0) == RING
    q[TAIL_I] = RING  # the receiver took all of it
    head = rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, RING, 6, *SIG, payload, RING, 0, 4096, 0)
    assert head == 2 * RING == q[HEAD_I]
    at = (48 + np.arange(RING - 48, 2 * RING - 48)) % RING  # where payload bytes RING-48 .. 2 RING-48 lie
    assert np.array_equal(np.frombuffer(ring, np.uint8)[at], payload[RING - 48:2 * RING - 48])
    fresh, fresh_q = _ring()  # a limit stops a call there, with room to spare and a long spin
    assert rings.send_stream(fresh, fresh_q, HEAD_I, TAIL_I, SLEEP_I, 0, 6, *SIG, payload, 0, 1000, 4096,
                             10_000_000) == 1000 == fresh_q[HEAD_I]
    for bad in (10, 2 * RING + 64):
        with pytest.raises(ValueError, match="bytes sent"):
            rings.send_stream(ring, q, HEAD_I, TAIL_I, SLEEP_I, head, 6, *SIG, payload, bad, 0, 4096, 0)


# ------------------------------------------------------------ between processes

def _sizes() -> list[int]:
    return [(i * 7) % 41 for i in range(3000)] + [RING // 2, 0, RING - 48, 1, RING + 5]


def across_the_ring_end(comm, blocking: bool):
    """Rank 0 sends every size (blocking sends or all at once), rank 1
    receives each in turn (blocking receives or irecv and wait)."""
    t, sizes = comm.transport, _sizes()
    in_c = t._put is not None and t._take is not None  # the path the test names
    if comm.rank == 0:
        if blocking:
            for i, n in enumerate(sizes):
                t.send(_pattern(n, i), 1, 2 + 2 * (i % 3), timeout=30)
        else:
            t.waitall([t.isend(_pattern(n, i), 1, 2 + 2 * (i % 3)) for i, n in enumerate(sizes)], 30)
        return in_c
    for i, n in enumerate(sizes):
        got = np.zeros(n, np.uint8)
        if blocking:
            t.recv(got, 0, 2 + 2 * (i % 3), timeout=30)
        else:
            t.irecv(got, 0, 2 + 2 * (i % 3)).wait(30)
        if not np.array_equal(got, _pattern(n, i)):
            return f"message {i} ({n} bytes) differs"
    return in_c


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
@pytest.mark.parametrize("blocking", [True, False], ids=["send-recv", "isend-irecv"])
def test_messages_across_the_ring_end(monkeypatch, compiled_path, blocking):
    if compiled_path and compiled.rings is None:
        pytest.skip("the rings' C extension is not built here")
    monkeypatch.setenv("COLLECTIVES_SHM_RING_BYTES", str(RING))
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    assert run_ranks(across_the_ring_end, 2, blocking, timeout=90) == [compiled_path, compiled_path]


OTHER_ROOT = signature.make("bcast", "binomial", None, 1, np.dtype(np.uint8), 5)


def blocking_receive_meets_a_disagreement(comm, what: str, n: int, sent):
    """Rank 0 sends n bytes with tag 6 (refused by their root when ``what``
    says so), then 4 bytes with tag 8; rank 1's blocking receive of the first
    disagrees in ``what``: its size, its signature (another root), or the
    sender refused the call. The second must still arrive whole."""
    t = comm.transport
    if comm.rank == 0:
        t.send(_pattern(n, 3), 1, 6, signature.refused(SIG) if what == "refused" else SIG, timeout=10)
        t.send(np.ones(4, np.uint8), 1, 8, timeout=10)
        sent.set()
        return "sent"
    assert sent.wait(10)  # both are in the ring before the receive
    got = np.zeros(n + 2 if what == "size" else n, np.uint8)
    start = time.monotonic()
    try:
        t.recv(got, 0, 6, OTHER_ROOT if what == "signature" else SIG, timeout=10)
    except (MismatchedCollective, BadArgument) as exc:
        took = time.monotonic() - start
        after = np.zeros(4, np.uint8)
        t.recv(after, 0, 8, timeout=10)
        return type(exc).__name__, str(exc), int(after.sum()), took, int(got.sum())
    return "no error"


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
@pytest.mark.parametrize("n", [10, 300_000], ids=["whole", "streamed"])
@pytest.mark.parametrize("what", ["size", "signature", "refused"])
def test_a_blocking_receive_that_disagrees_raises_and_the_stream_goes_on(monkeypatch, compiled_path, what, n):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    sent = multiprocessing.get_context("fork").Event()
    first, second = run_ranks(blocking_receive_meets_a_disagreement, 2, what, n, sent, timeout=60)
    assert first == "sent" and second != "no error"
    kind, message, after, took, written = second
    assert "rank 1" in message and "rank 0" in message
    if what == "size":
        assert kind == "MismatchedCollective" and f"expected {n + 2} bytes from rank 0, got {n}" in message
    elif what == "signature":
        assert kind == "MismatchedCollective" and "root: rank 0 has 0, rank 1 has 1" in message
    else:
        assert kind == "BadArgument" and "refused by its root, rank 0" in message
    assert after == 4 and written == 0 and took < 5


def both_send_large_then_receive(comm):
    """Both ranks make a blocking send of several rings' worth before either
    receives: neither may wait for the other (the rest of a send that does
    not fit is queued, and a waiting rank takes in what arrives)."""
    other, n = 1 - comm.rank, 9 * (1 << 20) + 13
    start = time.monotonic()
    comm.transport.send(_pattern(n, comm.rank), other, 4, timeout=30)
    got = np.zeros(n, np.uint8)
    comm.transport.recv(got, other, 4, timeout=30)
    return bool(np.array_equal(got, _pattern(n, other))), time.monotonic() - start


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
def test_blocking_sends_of_large_messages_both_ways_do_not_deadlock(monkeypatch, compiled_path):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    for same, took in run_ranks(both_send_large_then_receive, 2, timeout=90):
        assert same and took < 30


def posted_receives_waited_in_any_order(comm, order: str, sent):
    """Rank 1 posts three receives (two of tag 2, one of tag 4) before rank 0
    sends tag 4, a large tag 2 and a small tag 2, then waits for them one at
    a time in ``order``: a wait for the first receive posted of its tag takes
    its message at once, any other waits as before; either way each message
    meets its own receive (by tag, in order within a tag), then a receive of
    the wrong size fails and the stream goes on."""
    t = comm.transport
    big = 300_000
    if comm.rank == 0:
        assert sent.wait(10)  # every receive is posted first
        for n, tag in ((16, 4), (big, 2), (8, 2), (10, 6), (4, 8)):
            t.send(_pattern(n, tag + n), 1, tag, timeout=10)
        return "sent"
    bufs = {"a": np.zeros(big, np.uint8), "b": np.zeros(8, np.uint8), "c": np.zeros(16, np.uint8)}
    reqs = {"a": t.irecv(bufs["a"], 0, 2), "b": t.irecv(bufs["b"], 0, 2), "c": t.irecv(bufs["c"], 0, 4)}
    wrong = t.irecv(np.zeros(12, np.uint8), 0, 6)
    sent.set()
    for name in order:
        reqs[name].wait(10)
    same = all(np.array_equal(bufs[k], _pattern(n, tag + n)) for k, n, tag in (("a", big, 2), ("b", 8, 2),
                                                                               ("c", 16, 4)))
    try:
        wrong.wait(10)
        error = None
    except MismatchedCollective as exc:
        error = str(exc)
    after = np.zeros(4, np.uint8)
    t.irecv(after, 0, 8).wait(10)
    return same, error, bool(np.array_equal(after, _pattern(4, 12)))


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
@pytest.mark.parametrize("order", ["cab", "bac", "abc"])
def test_posted_receives_waited_for_in_any_order(monkeypatch, compiled_path, order):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    sent = multiprocessing.get_context("fork").Event()
    first, (same, error, after) = run_ranks(posted_receives_waited_in_any_order, 2, order, sent, timeout=60)
    assert first == "sent" and same and after
    assert error is not None and "expected 12 bytes from rank 0, got 10" in error


def nonblocking_large_both_ways(comm, first: str):
    """Both ranks start a send and a receive of several rings' worth, then
    wait for them one at a time (``first``: the send or the receive first):
    a wait for one request goes on with its message in C, and neither rank
    waits for the other for good."""
    t, other, n = comm.transport, 1 - comm.rank, 5 * (1 << 20) + 7
    got = np.zeros(n, np.uint8)
    start = time.monotonic()
    send = t.isend(_pattern(n, comm.rank), other, 2)
    recv = t.irecv(got, other, 2)
    for req in ((send, recv) if first == "send" else (recv, send)):
        req.wait(30)
    return bool(np.array_equal(got, _pattern(n, other))), time.monotonic() - start


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
@pytest.mark.parametrize("first", ["send", "receive"])
def test_nonblocking_large_messages_waited_for_one_at_a_time(monkeypatch, compiled_path, first):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    for same, took in run_ranks(nonblocking_large_both_ways, 2, first, timeout=90):
        assert same and took < 30


def send_recv_through_the_communicator(comm):
    """Blocking point-to-point through the communicator: tags kept apart,
    FIFO within one tag, dtypes and shapes kept, the buffer returned."""
    other = 1 - comm.rank
    if comm.rank == 0:
        comm.send(np.arange(6, dtype=np.float64).reshape(2, 3), other, tag=5)
        for i in range(3):
            comm.send(np.full(3, i, np.int32), other, tag=9)
        comm.send(np.array([1.5], np.float32), other, tag=7)
        back = comm.recv(np.zeros(2, np.int16), other, tag=0)
        return back.tolist()
    seven = comm.recv(np.zeros(1, np.float32), 0, tag=7)  # sent last: tags do not wait for each other
    fifo = [int(comm.recv(np.zeros(3, np.int32), 0, tag=9)[0]) for _ in range(3)]
    grid = np.zeros((2, 3))
    assert comm.recv(grid, 0, tag=5) is grid
    comm.send(np.array([-3, 4], np.int16), 0)
    return float(seven[0]), fifo, grid.ravel().tolist()


def _done_in_c(comm) -> tuple[int, int]:
    """(sends, receives) the communicator's compiled point-to-point did so far ((0, 0) without it)."""
    direct = comm._p2p_compiled
    return (0, 0) if direct is None else (direct.sends, direct.recvs)


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
def test_send_and_recv_through_the_communicator(monkeypatch, compiled_path):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    zero, one = run_ranks(lambda comm: (send_recv_through_the_communicator(comm), _done_in_c(comm),
                                        comm._p2p_compiled is not None), 2, timeout=60)
    assert zero[0] == [-3, 4] and one[0] == (1.5, [0, 1, 2], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert zero[2] == one[2] == (compiled.rings is not None and compiled_path)
    # rank 0's one-dimensional sends went in C, its 2-D array the Python way; rank 1's first
    # receive met another tag at the ring's head, so every receive of it took the Python path
    assert zero[1][0] == (4 if compiled_path else 0) and one[1] == ((1, 0) if compiled_path else (0, 0))


def compiled_p2p_keeps_order_and_checks(comm, events):
    """The communicator's send and recv where the C path must step aside:
    a send behind a queued nonblocking one, a receive behind a posted one,
    a receive of the wrong size, the transport's lock held by another
    thread, and a closed communicator; and where it must not. Returns what
    each rank saw, with how many calls of each step the C path did."""
    big_started, posted, sent4, taken, sent12 = events
    other, t = 1 - comm.rank, comm.transport
    seen = []

    def in_c(before: tuple[int, int]) -> tuple[int, int]:
        now = _done_in_c(comm)
        return now[0] - before[0], now[1] - before[1]
    if comm.rank == 0:
        req = comm.isend(_pattern(300_000, 1), 1, tag=2)  # more than the ring: the rest stays queued
        big_started.set()
        before = _done_in_c(comm)
        comm.send(np.full(4, 9, np.uint8), 1, tag=2)  # queued behind it, not beside it
        req.wait()
        seen.append(in_c(before))
        assert posted.wait(10)  # rank 1 took everything: the ring is empty
        before = _done_in_c(comm)
        comm.send(np.full(4, 1, np.uint8), 1, tag=4)
        comm.send(np.full(4, 2, np.uint8), 1, tag=4)
        sent4.set()
        comm.send(np.ones(10, np.uint8), 1, tag=6)
        comm.send(np.full(4, 8, np.uint8), 1, tag=8)
        seen.append(in_c(before))
        if comm._p2p_compiled is not None:  # another thread holds the transport's lock: nothing done here
            import threading
            held, release = threading.Event(), threading.Event()

            def hold():
                with t._lock:
                    held.set()
                    release.wait(10)
            holder = threading.Thread(target=hold)
            holder.start()
            assert held.wait(10)
            seen.append(comm._send_in_c(np.full(4, 5, np.uint8), 1, 10))
            release.set()
            holder.join(10)
        comm.send(np.full(4, 6, np.uint8), 1, tag=10)
        assert taken.wait(10)
        before = _done_in_c(comm)
        comm.send(np.full(4, 12, np.uint8), 1, tag=12)
        sent12.set()
        seen.append(in_c(before))
    else:
        assert big_started.wait(10)
        got = np.zeros(300_000, np.uint8)
        comm.recv(got, 0, tag=2)
        small = comm.recv(np.zeros(4, np.uint8), 0, tag=2)
        seen.append((bool(np.array_equal(got, _pattern(300_000, 1))), small.tolist()))
        first = comm.irecv(np.zeros(4, np.uint8), 0, tag=4)
        posted.set()
        assert sent4.wait(10)
        before = _done_in_c(comm)
        second = comm.recv(np.zeros(4, np.uint8), 0, tag=4)  # the posted receive takes the first message
        seen.append((first.wait(10).tolist(), second.tolist(), in_c(before)))
        start = time.monotonic()
        try:
            comm.recv(np.zeros(12, np.uint8), 0, tag=6)
            seen.append("no error")
        except MismatchedCollective as exc:
            seen.append((str(exc), time.monotonic() - start))
        seen.append((comm.recv(np.zeros(4, np.uint8), 0, tag=8).tolist(),
                     comm.recv(np.zeros(4, np.uint8), 0, tag=10).tolist()))
        taken.set()
        assert sent12.wait(10)  # whole at the ring's head, nothing before it
        before = _done_in_c(comm)
        seen.append((comm.recv(np.zeros(4, np.uint8), 0, tag=12).tolist(), in_c(before)))
    comm.barrier()
    comm.close()
    try:
        comm.send(np.zeros(1, np.uint8), other, tag=0)
        seen.append("sent on a closed communicator")
    except BadArgument as exc:
        seen.append(str(exc))
    return seen


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
def test_compiled_send_and_recv_step_aside_where_they_must(monkeypatch, compiled_path):
    if compiled_path and compiled.rings is None:
        pytest.skip("the rings' C extension is not built here")
    monkeypatch.setenv("COLLECTIVES_SHM_RING_BYTES", str(RING))
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    ctx = multiprocessing.get_context("fork")
    start = time.monotonic()
    zero, one = run_ranks(compiled_p2p_keeps_order_and_checks, 2, tuple(ctx.Event() for _ in range(5)),
                          timeout=60)
    assert time.monotonic() - start < 30
    c = 1 if compiled_path else 0
    # rank 0: the send behind the queued one went the Python way, the next four in C; a send while
    # another thread held the transport's lock did nothing; a send into an empty ring in C
    assert zero[:2] == [(0, 0), (4 * c, 0)] and zero[-2] == (c, 0)
    assert (zero[2] is False) if compiled_path else len(zero) == 4
    assert one[0] == (True, [9] * 4)  # FIFO within the tag, across the queued send
    assert one[1] == ([1] * 4, [2] * 4, (0, 0))  # behind a posted receive: the Python way
    message, took = one[2]
    assert "rank 1" in message and "expected 12 bytes from rank 0, got 10" in message and took < 5
    assert one[3] == ([8] * 4, [6] * 4)  # the stream goes on after the disagreement
    assert one[4] == ([12] * 4, (0, c))  # whole at the ring's head: in C
    for seen in (zero, one):
        assert "the communicator is closed" in seen[-1]


def bad_point_to_point_arguments(comm):
    """Each bad argument is refused on the rank that passed it, before
    anything is sent; the next good exchange still works."""
    other = 1 - comm.rank
    errors = []
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    for call in (lambda: comm.send(np.zeros(4), 2), lambda: comm.send(np.zeros(4), True),
                 lambda: comm.recv(np.zeros(4), -1), lambda: comm.send(np.zeros(4), other, tag=-1),
                 lambda: comm.send(np.zeros(4), other, tag=1.0), lambda: comm.recv(ro, other),
                 lambda: comm.recv(np.zeros((4, 4))[:, 0], other), lambda: comm.send(np.zeros(3, object), other)):
        try:
            call()
            errors.append(None)
        except BadArgument as exc:
            errors.append(str(exc))
    if comm.rank == 0:
        comm.send(np.full(4, 7, np.int64), other, tag=3)
        return errors
    return errors, comm.recv(np.zeros(4, np.int64), 0, tag=3).tolist()


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
def test_bad_point_to_point_arguments_are_refused_before_anything_is_sent(monkeypatch, compiled_path):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    start = time.monotonic()
    zero, (one, got) = run_ranks(bad_point_to_point_arguments, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert got == [7, 7, 7, 7]
    for errors in (zero, one):
        assert None not in errors, errors
        assert "out of range for 2 ranks" in errors[0] and "True" in errors[1] and "-1" in errors[2]
        assert "tag must be an integer" in errors[3] and "tag must be an integer" in errors[4]
        assert "read-only" in errors[5] and "not contiguous" in errors[6] and "unsupported dtype" in errors[7]


def _plan(seed: int, count: int = 400) -> list[tuple[int, int, str]]:
    """(tag, size, how it is sent) of each message: sizes from empty to more
    than a ring, three tags, blocking and nonblocking sends."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 8, 100, 1000, 4096, RING // 4 - 48, RING // 4, RING // 2, 3 * RING]
    return [(int(rng.integers(3)) * 2, int(rng.choice(sizes)) + int(rng.integers(3)) * 8,
             str(rng.choice(["send", "isend"]))) for _ in range(count)]


def mixed_paths_in_any_order(comm, seed: int):
    """Rank 0 sends the plan's messages in order, blocking or not; rank 1
    takes each tag's messages in order but the tags interleaved at random,
    each by a blocking receive or a nonblocking one waited at once or
    later. Every message must meet its own receive, whole."""
    plan, rng = _plan(seed), np.random.default_rng(seed + 1)
    if comm.rank == 0:
        pending = []
        for i, (tag, n, how) in enumerate(plan):
            data = _pattern(n, i)
            if how == "send":
                comm.send(data, 1, tag=tag)
            else:
                pending.append(comm.isend(data, 1, tag=tag))
        for req in pending:
            req.wait()
        return len(plan), _done_in_c(comm)
    by_tag = {tag: [i for i, (t, _, _) in enumerate(plan) if t == tag] for tag in (0, 2, 4)}
    later, bad = [], []
    while any(by_tag.values()):
        tag = int(rng.choice([t for t, left in by_tag.items() if left]))
        i = by_tag[tag].pop(0)
        got = np.zeros(plan[i][1], np.uint8)
        way = rng.integers(3)
        if way == 0:
            comm.recv(got, 0, tag=tag)
        else:
            req = comm.irecv(got, 0, tag=tag)
            if way == 1:
                req.wait()
            later.append((req, got, i))
        if way == 0 and not np.array_equal(got, _pattern(plan[i][1], i)):
            bad.append(i)
        if len(later) > 8 or not any(by_tag.values()):
            for req, buf, j in later:
                req.wait()
                if not np.array_equal(buf, _pattern(plan[j][1], j)):
                    bad.append(j)
            later = []
    return bad, _done_in_c(comm)


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
@pytest.mark.parametrize("seed", [1, 2])
def test_blocking_and_nonblocking_calls_of_every_size_in_any_order_of_tags(monkeypatch, compiled_path, seed):
    monkeypatch.setenv("COLLECTIVES_SHM_RING_BYTES", str(RING))
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    start = time.monotonic()
    (count, sent_in_c), (bad, got_in_c) = run_ranks(mixed_paths_in_any_order, 2, seed, timeout=120)
    assert bad == [] and count == 400 and time.monotonic() - start < 60
    if not compiled_path:
        assert sent_in_c == got_in_c == (0, 0)
    elif compiled.rings is not None:
        assert sent_in_c[0] > 0  # some sends took the compiled path


def nonblocking_calls_in_c(comm, sent, ready):
    """Nonblocking sends into an idle ring and receives of messages already
    there complete at once from C; a receive whose message differs, or that
    has one of its tag posted before it, takes the Python path and fails or
    waits as always. Rank 0 sends once rank 1 is past ``init`` (whose own
    receive would otherwise move the later messages aside, where only the
    Python path finds them)."""
    if comm.rank == 1:
        ready.set()
    if comm.rank == 0:
        assert ready.wait(10)
        handles = [comm.isend(np.full(3, i, np.int32), 1, tag=4) for i in range(3)]
        handles.append(comm.isend(np.ones(10, np.uint8), 1, tag=6))
        handles.append(comm.isend(np.full(2, 7.5), 1, tag=8))
        for h in handles:
            h.wait()
        sent.set()
        return _done_in_c(comm), [h.done() for h in handles]
    assert sent.wait(10)  # every message is in the ring, nothing ahead of it
    got = [comm.irecv(np.zeros(3, np.int32), 0, tag=4) for _ in range(3)]
    done_at_once = [h.done() for h in got]
    values = [int(h.wait()[0]) for h in got]
    wrong = comm.irecv(np.zeros(12, np.uint8), 0, tag=6)  # 10 bytes came: the Python path fails it
    start = time.monotonic()
    try:
        wrong.wait(5)
        error = "no error"
    except MismatchedCollective as exc:
        error = str(exc)
    took = time.monotonic() - start
    last = comm.irecv(np.zeros(2), 0, tag=8).wait(5).tolist()  # after the disagreement, the stream goes on
    return _done_in_c(comm), done_at_once, values, error, took, last


@pytest.mark.parametrize("compiled_path", [True, False], ids=["in C", "in Python"])
def test_nonblocking_sends_and_receives_complete_at_once_and_still_check(monkeypatch, compiled_path):
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if compiled_path else "0")
    ctx = multiprocessing.get_context("fork")
    (sent_in_c, sends_done), (got_in_c, done_at_once, values, error, took, last) = run_ranks(
        nonblocking_calls_in_c, 2, ctx.Event(), ctx.Event(), timeout=60)
    c = 1 if compiled_path and compiled.rings is not None else 0
    assert sent_in_c == (5 * c, 0) and sends_done == [True] * 5
    assert done_at_once == [True] * 3 and values == [0, 1, 2]  # the Python path takes them at once too
    # the three of tag 4 in C; the one that differs goes the Python way, which also routes the last
    # message (already in the ring) to the early messages, where its receive finds it
    assert got_in_c[1] == 3 * c
    assert "rank 1" in error and "expected 12 bytes from rank 0, got 10" in error and took < 5
    assert last == [7.5, 7.5]
