"""The ZeroMQ/TCP transport on real processes over loopback.

Point-to-point (sizes, tags, order, mismatches), every collective and
algorithm against numpy for p = 1..5, rendezvous through a torch store,
and faults: a killed rank, an abort, strangers knocking on a rank's port.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
import zmq

from collectives import CollectiveTimeout, MismatchedCollective, PeerLost
from collectives.transports.zmq import wire as zmq_transport
from harness import run_ranks
from test_collectives import CHECKS

WORLD_SIZES = [1, 2, 3, 4, 5]


def _pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


# -- point-to-point ----------------------------------------------------------


def ring_exchange(comm):
    t, p, r = comm.transport, comm.size, comm.rank
    results = []
    for n in (0, 1, 8, 70_000, 9 * (1 << 20) + 13):  # the last one spans three segments
        into = np.zeros(n, np.uint8)
        reqs = [t.irecv(into, (r - 1) % p, 3), t.isend(_pattern(n, r), (r + 1) % p, 3)]
        t.waitall(reqs, 20)
        results.append(bool(np.array_equal(into, _pattern(n, (r - 1) % p))))
    mine = np.zeros(5, np.uint8)
    t.waitall([t.isend(_pattern(5, 1), r, 4), t.irecv(mine, r, 4)], 5)
    results.append(bool(np.array_equal(mine, _pattern(5, 1))))
    return all(results)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_ring_of_sizes_zero_to_segmented_and_self(p):
    assert all(run_ranks(ring_exchange, p, transport="zmq", timeout=60))


def many_tags_out_of_order(comm):
    """Point-to-point tags (even: a collective's tags are odd, see the
    execution's tag space) received in reverse order of sending, after all
    have arrived: a last message, sent after them, is received first, and
    messages between two ranks keep their order."""
    t = comm.transport
    sizes = [0, 1, 15, 65_535, 65_536, 300_000, 5_000_000]
    last = 2 * len(sizes) + 2
    if comm.rank == 0:
        reqs = [t.isend(_pattern(n, tag), 1, 2 * tag) for tag, n in enumerate(sizes)]
        reqs += [t.isend(np.full(3, i, np.int32), 1, 2 * len(sizes)) for i in range(3)]
        reqs.append(t.isend(np.ones(1, np.uint8), 1, last))
        t.waitall(reqs, 20)
        return True
    t.irecv(np.zeros(1, np.uint8), 0, last).wait(20)  # everything else has arrived before its receive is posted
    bufs = {tag: np.zeros(n, np.uint8) for tag, n in enumerate(sizes)}
    reqs = [t.irecv(bufs[tag], 0, 2 * tag) for tag in reversed(range(len(sizes)))]
    fifo = [np.zeros(3, np.int32) for _ in range(3)]
    reqs += [t.irecv(b, 0, 2 * len(sizes)) for b in fifo]
    t.waitall(reqs, 20)
    ok = all(np.array_equal(bufs[tag], _pattern(n, tag)) for tag, n in enumerate(sizes))
    return ok and [int(b[0]) for b in fifo] == [0, 1, 2]


def test_unexpected_messages_many_tags_fifo_per_tag():
    assert run_ranks(many_tags_out_of_order, 2, transport="zmq", timeout=60) == [True, True]


def size_mismatch(comm, early: bool, n: int):
    """Rank 0 sends n bytes where rank 1 expects n + 2; with ``early``, the
    message has arrived before the receive is posted (a marker sent after
    it is received first: messages between two ranks keep their order)."""
    t = comm.transport
    if comm.rank == 0:
        t.isend(np.zeros(n, np.uint8), 1, 5).wait(10)
        t.isend(np.ones(1, np.uint8), 1, 8).wait(10)
        t.isend(np.ones(4, np.uint8), 1, 6).wait(10)
        return "sent"
    marker = t.irecv(np.zeros(1, np.uint8), 0, 8)
    if early:
        marker.wait(10)
    try:
        t.irecv(np.zeros(n + 2, np.uint8), 0, 5).wait(10)
    except MismatchedCollective:
        after = np.zeros(4, np.uint8)
        t.irecv(after, 0, 6).wait(10)
        return "mismatch" if after.sum() == 4 else "corrupt"
    return "no error"


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("n", [10, 6_000_000])
def test_size_mismatch_raises_and_stream_stays_usable(early, n):
    assert run_ranks(size_mismatch, 2, early, n, transport="zmq", timeout=60) == ["sent", "mismatch"]


def receive_times_out(comm):
    t, peer = comm.transport, 1 - comm.rank
    try:
        t.irecv(np.zeros(4, np.uint8), peer, 76).wait(0.3)  # a point-to-point tag (even): no abort
    except CollectiveTimeout:
        # neither closes (a goodbye would make the other's wait raise PeerLost) before both timed out
        t.waitall([t.isend(np.ones(1, np.uint8), peer, 78), t.irecv(np.zeros(1, np.uint8), peer, 78)], 10)
        return "timeout"
    return "received"


def receive_from_closed_peer(comm):
    if comm.rank == 0:
        return "closed"  # the harness closes rank 0's communicator now
    start = time.monotonic()
    try:
        comm.transport.irecv(np.zeros(4, np.uint8), 0, 77).wait(15)
    except PeerLost as exc:
        return exc.peer, time.monotonic() - start < 5
    return "received"


def test_receive_from_a_peer_that_closed_raises_peer_lost():
    assert run_ranks(receive_from_closed_peer, 2, transport="zmq", timeout=30) == ["closed", (0, True)]


def close_after_peer(comm, closed):
    """Rank 0 closes while rank 1 drives nothing (its goodbye waits, unread, in
    rank 1's socket); then rank 1 closes."""
    t = comm.transport
    if comm.rank == 0:
        comm.close()
        closed.set()
        return None
    assert closed.wait(20)
    start = time.monotonic()
    comm.close()
    return sorted(t._said_bye), time.monotonic() - start


def test_the_later_of_two_closing_ranks_hears_the_goodbye_and_does_not_linger():
    """The goodbye rank 1 sends cannot reach rank 0 (closed): rank 1 hears rank
    0's goodbye as it closes, so that socket does not linger (1 s) for it."""
    closed = multiprocessing.get_context("fork").Event()
    first, (heard, took) = run_ranks(close_after_peer, 2, closed, transport="zmq", timeout=30)
    assert first is None and heard == [0]
    assert took < 1.0, f"rank 1's close took {took:.2f} s: it waited for its socket to rank 0 to linger"


def test_receive_without_sender_times_out():
    assert run_ranks(receive_times_out, 2, transport="zmq", timeout=30) == ["timeout", "timeout"]


def listens_on(comm):
    return comm.transport.endpoint


def test_interface_name_chooses_the_listening_address(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_SOCKET_IFNAME", "lo")
    endpoints = run_ranks(listens_on, 2, transport="zmq", timeout=30)
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints


def with_torch_store(port: int):
    import datetime

    import collectives
    from torch.distributed import TCPStore

    rank = int(os.environ["RANK"])
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=20))
    comm = collectives.init(transport="zmq", store=store, timeout=20)
    buf = np.full(5, rank + 1.0)
    comm.transport.waitall([comm.transport.isend(buf.copy(), 1 - rank, 1),
                            comm.transport.irecv(buf, 1 - rank, 1)], 10)
    comm.close()
    return float(buf[0])


def torch_store_rank(comm, port: int):
    return with_torch_store(port)


def test_rendezvous_through_a_torch_store():
    pytest.importorskip("torch.distributed")
    from collectives.launcher import free_port

    port = free_port()
    # the harness's own communicator is shm; the zmq one rendezvous in the torch store
    assert run_ranks(torch_store_rank, 2, port, transport="shm", timeout=60) == [2.0, 1.0]


# -- every collective and algorithm -------------------------------------------


def check_everything(comm):
    return {name: check(comm) for name, check in CHECKS.items()}


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_every_collective_and_algorithm_against_numpy(p):
    results = run_ranks(check_everything, p, transport="zmq", timeout=240, comm_timeout=60)
    failures = [f"rank {r}: {f}" for r, per in enumerate(results) for fs in per.values() for f in fs]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("p", [2, 3])
def test_every_collective_over_zeromq_sockets_alone(monkeypatch, p):
    monkeypatch.setenv("COLLECTIVES_ZMQ_LANES", "0")  # the data on ZeroMQ's own sockets, not the TCP lanes
    results = run_ranks(check_everything, p, transport="zmq", timeout=240, comm_timeout=60)
    failures = [f"rank {r}: {f}" for r, per in enumerate(results) for fs in per.values() for f in fs]
    assert not failures, "\n".join(failures[:40])


# -- faults --------------------------------------------------------------------

FAULT_TIMEOUT = 6.0


def killed_during_allreduce(comm, victim: int):
    comm.barrier()
    if comm.rank == victim:  # the others are at the allreduce, in it or about to start it
        os.kill(os.getpid(), signal.SIGKILL)
    buf = np.ones(1 << 20, np.float32)
    start = time.monotonic()
    try:
        comm.allreduce(buf, "sum", timeout=FAULT_TIMEOUT)
    except PeerLost as exc:
        return "PeerLost", exc.peer, time.monotonic() - start, str(exc)
    except Exception as exc:
        return type(exc).__name__, None, time.monotonic() - start, str(exc)
    return "completed", None, time.monotonic() - start, ""


@pytest.mark.parametrize("p,victim", [(2, 1), (4, 2)])
def test_killed_rank_raises_peer_lost_everywhere_within_timeout(p, victim):
    outcomes = run_ranks(killed_during_allreduce, p, victim, transport="zmq", timeout=60,
                         comm_timeout=FAULT_TIMEOUT, expect_errors=True)
    assert outcomes[victim].error_type == "ProcessDied"
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, str(o)
        kind, peer, elapsed, message = o.value
        assert kind == "PeerLost", f"rank {o.rank}: {kind}: {message}"
        assert elapsed <= FAULT_TIMEOUT + 1.0, f"rank {o.rank} took {elapsed:.2f}s"
        assert peer is not None and f"rank {victim}" in message or peer == victim, message


def aborted_peer(comm):
    t = comm.transport
    if comm.rank == 0:
        t.irecv(np.zeros(1, np.uint8), 1, 2).wait(10)  # rank 1 has posted its receive
        t.abort("rank 0 gives up")
        return "aborted"
    start = time.monotonic()
    try:
        waiting = t.irecv(np.zeros(4, np.uint8), 0, 1)
        t.isend(np.ones(1, np.uint8), 0, 2)
        waiting.wait(20)
    except PeerLost as exc:
        return exc.peer, "gives up" in str(exc), time.monotonic() - start < 5
    return "received"


def test_abort_reaches_a_waiting_peer_at_once():
    assert run_ranks(aborted_peer, 2, transport="zmq", timeout=60) == ["aborted", (0, True, True)]


def allreduce_loop_while_strangers_knock(comm, endpoint_file: str, seconds: float):
    """Allreduce until the stranger has finished knocking (the test writes
    ``endpoint_file + ".done"``), ``seconds`` at most."""
    if comm.rank == 0:
        with open(endpoint_file + ".tmp", "w") as f:
            f.write(comm.transport.endpoint)
        os.replace(endpoint_file + ".tmp", endpoint_file)
    end = time.monotonic() + seconds
    rounds = bad = 0
    while True:
        buf = np.full(1000, comm.rank + 1, np.int64)
        comm.allreduce(buf, "sum")
        rounds += 1
        bad += int(not np.all(buf == comm.size * (comm.size + 1) // 2))
        going = comm.rank != 0 or (not os.path.exists(endpoint_file + ".done") and time.monotonic() < end)
        flag = np.array([going], np.int32)
        comm.allreduce(flag, "min")  # every rank stops after the same round
        if not flag[0]:
            break
    refused = comm.transport._zap.refused if comm.rank == 0 else 0
    return rounds, bad, refused


#: The events that end a stranger's handshake with rank 0, whatever rank 0 decides.
_HANDSHAKE_DONE = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)


def _knock(endpoint: str) -> None:
    """Connect to ``endpoint`` the ways a stranger would: garbage, no credentials, a wrong
    secret; what it sends looks like data, an abort and a status query of rank 0's."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(4096))
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):  # until rank 0 has read the garbage and hung up
                pass
        except OSError:  # it hung up already
            pass
    ctx = zmq.Context()
    try:
        for password in (None, b"not-the-secret"):
            d = ctx.socket(zmq.DEALER)
            d.linger = 0
            d.sndtimeo = 5000  # a send with no connection left fails (zmq.Again) rather than waits
            d.routing_id = b"0"  # pretends to be rank 0
            if password is not None:
                d.plain_username, d.plain_password = b"collectives", password
            monitor = d.get_monitor_socket(_HANDSHAKE_DONE)
            d.connect(endpoint)
            try:
                d.send(zmq_transport.HEADER.pack(zmq_transport.KIND_DATA, 3, 4, 0, 0, 0, 0) + b"junk")
                d.send(zmq_transport.HEADER.pack(zmq_transport.KIND_ABORT, -1, 0, 0, 0, 0, 0)
                       + b"PeerLost\x1fa stranger says stop")
                d.send(zmq_transport.HEADER.pack(zmq_transport.KIND_QUERY, 1, 0, 0, 0, 0, 0))
            except zmq.Again:  # rank 0 refused the handshake before these were queued: no pipe is left
                pass
            monitor.poll(5000)  # until rank 0 has decided on this handshake (5 s at most)
            d.disable_monitor()
            monitor.close(0)
            d.close(0)
    finally:
        ctx.destroy(linger=0)  # closes what an error left open (term() would wait for it)


def test_strangers_are_refused_and_the_collective_goes_on():
    with tempfile.TemporaryDirectory() as tmp:
        endpoint_file = os.path.join(tmp, "endpoint")
        result: dict = {}
        runner = threading.Thread(target=lambda: result.setdefault(
            "value", run_ranks(allreduce_loop_while_strangers_knock, 2, endpoint_file, 45.0,
                               transport="zmq", timeout=60)))
        runner.start()
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(endpoint_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(endpoint_file) as f:
                _knock(f.read())
        finally:
            open(endpoint_file + ".done", "w").close()  # the ranks stop once the knocking is over
            runner.join(timeout=70)
    assert "value" in result, "the ranks did not finish"
    (rounds0, bad0, refused), (rounds1, bad1, _) = result["value"]
    assert rounds0 == rounds1 > 0 and bad0 == bad1 == 0
    assert refused >= 2, f"only {refused} refusals were logged"


def encrypted_exchange(comm, port: int):
    from collectives.transports.zmq import ZmqTransport

    r = comm.rank
    options = {"secret": "s3cret", "auth": "curve", "master_addr": "127.0.0.1", "master_port": port}
    with ZmqTransport.open(r, 2, job="curve-test", timeout=20, options=options) as t:
        out, into = _pattern(5_000_000, r), np.zeros(5_000_000, np.uint8)
        t.waitall([t.irecv(into, 1 - r, 1), t.isend(out, 1 - r, 1)], 20)
        ok = bool(np.array_equal(into, _pattern(5_000_000, 1 - r)))
        # both have received before either says goodbye
        t.waitall([t.irecv(np.zeros(1, np.uint8), 1 - r, 2), t.isend(np.ones(1, np.uint8), 1 - r, 2)], 20)
        return ok


def test_curve_authentication_and_encryption():
    from collectives.launcher import free_port

    assert run_ranks(encrypted_exchange, 2, free_port(), transport="zmq", timeout=60) == [True, True]
