"""Signatures over the ZeroMQ/TCP transport, on real processes over loopback.

Every message carries its call's signature; a receive whose signature
differs fails with MismatchedCollective naming the field (BadArgument for
a call its root refused), even when the byte counts agree, and the
message's bytes are dropped, never written into the buffer, with the
stream kept in step. A peer that moved on to another call fails a pending
receive (out of step). Checked on the direct lanes and on ZeroMQ's own
sockets, for a receive posted before the message arrives and after, for
one frame and for many segments, and for a rank sending to itself.

The end-to-end tests through the Communicator need the communicator to
pass each call's signature down (``CallContext.sig``); they are skipped,
saying so, until it does.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from collectives import BadArgument, CollectiveError, MismatchedCollective, signature
from harness import run_ranks

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
COUNT = 4

#: case: (sender's signature, receiver's signature, words the error must contain)
CASES = {
    "dtype": (signature.make("allreduce", "ring", "sum", None, F32, COUNT),
              signature.make("allreduce", "ring", "sum", None, I32, COUNT), ["float32", "int32"]),
    "op": (signature.make("allreduce", "ring", "sum", None, F32, COUNT),
           signature.make("allreduce", "ring", "max", None, F32, COUNT), ["op:", "sum", "max"]),
    "collective": (signature.make("allreduce", "ring", "sum", None, F32, COUNT),
                   signature.make("bcast", "binomial", None, 0, F32, COUNT), ["collective:", "allreduce", "bcast"]),
}
SEQ = 5
NOTE = 2  # an even (point-to-point) tag for ordering the two ranks


def _tag(seq: int) -> int:
    return 2 * seq + 1


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * 13 + seed) % 251).astype(np.uint8)


def _note(t, peer: int) -> None:
    t.isend(np.zeros(1, np.uint8), peer, NOTE).wait(20)


def _await_note(t, peer: int) -> None:
    t.irecv(np.zeros(1, np.uint8), peer, NOTE).wait(20)


def _outcome(req, into: np.ndarray, after_req, after: np.ndarray, nbytes: int):
    """(error kind and text or None, buffer untouched, next message intact)."""
    try:
        req.wait(30)
        error = None
    except CollectiveError as exc:
        error = (type(exc).__name__, str(exc))
    untouched = bool(np.all(into == 7))
    after_req.wait(30)
    return error, untouched, bool(np.array_equal(after, _payload(nbytes, 2)))


def mismatch_between_ranks(comm, case: str, early: bool, nbytes: int):
    """Rank 0 sends call #SEQ with one signature and call #SEQ+1 with the
    agreed one; rank 1 receives #SEQ with another signature (the error and
    an untouched buffer), then #SEQ+1 (the right bytes)."""
    t = comm.transport
    theirs, mine, _ = CASES[case]
    second = signature.with_seq(mine, SEQ + 1)
    if comm.rank == 0:
        if not early:
            _await_note(t, 1)  # the receive is posted
        reqs = [t.isend(_payload(nbytes, 1), 1, _tag(SEQ), signature.with_seq(theirs, SEQ)),
                t.isend(_payload(nbytes, 2), 1, _tag(SEQ + 1), second)]
        if early:
            _note(t, 1)  # after both on the same stream: they have arrived when it has
        t.waitall(reqs, 30)
        return None
    if early:
        _await_note(t, 0)
    into = np.full(nbytes, 7, np.uint8)
    req = t.irecv(into, 0, _tag(SEQ), signature.with_seq(mine, SEQ))
    if not early:
        _note(t, 0)
    after = np.zeros(nbytes, np.uint8)
    return _outcome(req, into, t.irecv(after, 0, _tag(SEQ + 1), second), after, nbytes)


def _check(outcome, case: str) -> None:
    error, untouched, next_ok = outcome
    assert error is not None, f"{case}: the mismatch was not detected"
    kind, message = error
    assert kind == "MismatchedCollective", message
    for word in CASES[case][2]:
        assert word in message, f"{case}: {word!r} not in {message!r}"
    assert untouched, f"{case}: the mismatched message was written into the receive buffer"
    assert next_ok, f"{case}: the next message was not received intact (stream out of step)"


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["lanes", "zeromq"])
@pytest.mark.parametrize("nbytes", [COUNT * 4, 9 * (1 << 20) + 16], ids=["small", "segmented"])
@pytest.mark.parametrize("early", [False, True], ids=["posted", "early"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_signature_with_equal_bytes_fails_the_receive_only(monkeypatch, case, early, nbytes, lanes):
    monkeypatch.setenv("COLLECTIVES_ZMQ_LANES", lanes)
    results = run_ranks(mismatch_between_ranks, 2, case, early, nbytes, transport="zmq", timeout=90)
    assert results[0] is None
    _check(results[1], case)


def mismatch_to_self(comm, case: str, early: bool):
    """The same with rank 0 as sender and receiver: its messages to itself
    arrive when sent (early) or fill a receive posted before."""
    if comm.rank != 0:
        return None
    t, nbytes = comm.transport, COUNT * 4
    theirs, mine, _ = CASES[case]
    second = signature.with_seq(mine, SEQ + 1)
    into, after = np.full(nbytes, 7, np.uint8), np.zeros(nbytes, np.uint8)

    def send():
        t.isend(_payload(nbytes, 1), 0, _tag(SEQ), signature.with_seq(theirs, SEQ)).wait(5)
        t.isend(_payload(nbytes, 2), 0, _tag(SEQ + 1), second).wait(5)

    if early:
        send()
    req = t.irecv(into, 0, _tag(SEQ), signature.with_seq(mine, SEQ))
    after_req = t.irecv(after, 0, _tag(SEQ + 1), second)
    if not early:
        send()
    return _outcome(req, into, after_req, after, nbytes)


@pytest.mark.parametrize("early", [False, True], ids=["posted", "early"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_ranks_own_messages_are_checked_too(case, early):
    results = run_ranks(mismatch_to_self, 2, case, early, transport="zmq", timeout=60)
    _check(results[0], case)


def refused_by_root(comm):
    t = comm.transport
    sig = signature.with_seq(signature.make("gather", "binomial", None, 0, F32, COUNT), SEQ)
    if comm.rank == 0:
        t.isend(np.zeros(COUNT, np.float32), 1, _tag(SEQ), signature.refused(sig)).wait(20)
        return None
    try:
        t.irecv(np.zeros(COUNT, np.float32), 0, _tag(SEQ), sig).wait(20)
    except BadArgument as exc:
        return str(exc)
    return "received"


def test_a_message_of_a_refused_call_raises_bad_argument():
    message = run_ranks(refused_by_root, 2, transport="zmq", timeout=60)[1]
    assert "refused by its root, rank 0" in message, message


def out_of_step(comm, early: bool):
    """Rank 0 skips call #SEQ and sends call #SEQ+1: rank 1's receive of
    #SEQ fails, whether posted before or after that message arrives; the
    message of #SEQ+1 is still received."""
    t = comm.transport
    sig = signature.make("bcast", "binomial", None, 0, F32, COUNT)
    if comm.rank == 0:
        if not early:
            _await_note(t, 1)
        t.isend(np.arange(COUNT, dtype=np.float32), 1, _tag(SEQ + 1), signature.with_seq(sig, SEQ + 1)).wait(20)
        if early:
            _note(t, 1)
        return None
    if early:
        _await_note(t, 0)
    start = time.monotonic()
    req = t.irecv(np.zeros(COUNT, np.float32), 0, _tag(SEQ), signature.with_seq(sig, SEQ))
    if not early:
        _note(t, 0)
    try:
        req.wait(20)
        return "received"
    except MismatchedCollective as exc:
        message, took = str(exc), time.monotonic() - start
    nxt = np.zeros(COUNT, np.float32)
    t.irecv(nxt, 0, _tag(SEQ + 1), signature.with_seq(sig, SEQ + 1)).wait(20)
    return message, took, nxt.tolist()


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["lanes", "zeromq"])
@pytest.mark.parametrize("early", [False, True], ids=["posted", "early"])
def test_a_peer_that_moved_to_another_call_fails_the_pending_receive(monkeypatch, early, lanes):
    monkeypatch.setenv("COLLECTIVES_ZMQ_LANES", lanes)
    message, took, nxt = run_ranks(out_of_step, 2, early, transport="zmq", timeout=60)[1]
    assert f"waits for a message of call #{SEQ} from rank 0" in message, message
    assert f"bcast #{SEQ + 1}" in message, message
    assert took < 10, f"detected after {took:.2f}s"
    assert nxt == [0.0, 1.0, 2.0, 3.0]


# -- end to end, through the Communicator -------------------------------------------


COMM_TIMEOUT = 5.0


def mismatched_calls(comm, case: str):
    x = np.arange(COUNT, dtype=np.float32)
    start = time.monotonic()
    try:
        if case == "dtype":
            comm.allreduce(x if comm.rank == 0 else x.astype(np.int32))
        elif case == "op":
            comm.allreduce(x, op="sum" if comm.rank == 0 else "max")
        else:
            if comm.rank == 0:
                comm.allreduce(x)
            else:
                comm.bcast(x, root=0)
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "completed", "", time.monotonic() - start


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_calls_with_equal_bytes_raise_on_every_rank(case, p):
    outcomes = run_ranks(mismatched_calls, p, case, transport="zmq", timeout=90, comm_timeout=COMM_TIMEOUT)
    for rank, (kind, message, took) in enumerate(outcomes):
        assert kind == "MismatchedCollective", f"rank {rank}: {kind}: {message}"
        assert took <= COMM_TIMEOUT + 3, f"rank {rank} took {took:.2f}s"
    words = CASES[case][2]
    assert any(all(w in message for w in words) for _, message, _ in outcomes), outcomes
