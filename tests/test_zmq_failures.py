"""Dead, hung, aborting and unreachable peers over the ZeroMQ/TCP transport.

Real processes over loopback (and, for a cut link, over a veth pair
between two network namespaces). Every test checks every rank's outcome,
the time it took (bounds generous: the machine is shared) and what the
message names:

* a rank killed with SIGKILL during a 64 MiB allreduce or a stream of
  small ones: every survivor raises PeerLost naming the killed rank, its
  host and pid, as soon as its connections end (never an IndexError,
  never blaming a survivor);
* a rank stopped with SIGSTOP: every survivor raises CollectiveTimeout
  within the timeout and a second, all with the same verdict naming the
  stopped rank (no circular blame), and the stopped rank raises too once
  it runs again;
* ranks that wait for each other in a call none of them can finish: the
  verdict says every rank has arrived;
* ranks that disagree on a rooted call's root: MismatchedCollective on
  every rank in that call, at once, naming the ranks and their roots;
* an abort reaches a waiting peer at once with the aborting rank's kind
  of error, spares calls the aborting rank completed, and every later
  operation raises it again; what the aborting rank sent before it
  aborted is still delivered;
* a link cut between two namespaces (no reset; heartbeats stop) is told
  apart from a dead process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from launched import LAUNCH_NAMES, environment_without

import collectives
from collectives import CollectiveError, signature
from collectives.errors import abort_reason
from harness import run_ranks

FAULT_TIMEOUT = 6.0
HANG_TIMEOUT = 3.0
KINDS = ("CollectiveTimeout", "MismatchedCollective", "BadArgument", "PeerLost")


def _died(victim: int) -> re.Pattern:
    return re.compile(rf"rank {victim} \(host [^,()]+, pid \d+\) died or closed its connection")


def _kill_self(kill_file: str) -> None:
    """Write the time, then SIGKILL this process (from a timer thread, mid-call)."""
    with open(kill_file, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


# -- a killed rank -----------------------------------------------------------------


def allreduce_until_killed(comm, victim: int, nbytes: int, delay: float, kill_file: str):
    """Allreduce ``nbytes`` in a loop after a one-element one (every rank has
    arrived); the victim kills itself ``delay`` seconds after that. Returns
    (error kind, its peer, seconds of the failing call, when it was raised,
    message)."""
    first, buf = np.ones(1, np.float32), np.ones(nbytes // 4, np.float32)
    end = time.monotonic() + 60
    calls = 0
    while time.monotonic() < end:
        start = time.monotonic()
        try:
            comm.allreduce(buf if calls else first)
        except Exception as exc:  # IndexError included: reported, not raised
            return type(exc).__name__, getattr(exc, "peer", None), time.monotonic() - start, time.time(), str(exc)
        if calls == 0 and comm.rank == victim:
            threading.Timer(delay, _kill_self, (kill_file,)).start()
        calls += 1
    return "completed", None, 0.0, time.time(), ""


def _check_killed(outcomes, victim: int, kill_file: str) -> None:
    assert outcomes[victim].error_type == "ProcessDied", str(outcomes[victim])
    with open(kill_file) as f:
        killed_at = float(f.read())
    pattern = _died(victim)
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, str(o)
        kind, peer, took, at, message = o.value
        assert kind == "PeerLost", f"rank {o.rank}: {kind}: {message}"
        assert pattern.search(message), f"rank {o.rank} does not name rank {victim} as dead: {message}"
        assert at - killed_at <= FAULT_TIMEOUT + 1.0, f"rank {o.rank} raised {at - killed_at:.2f}s after the kill"
        assert took <= FAULT_TIMEOUT + 3.0, f"rank {o.rank}'s call took {took:.2f}s"


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8])
@pytest.mark.parametrize("p,victim", [(2, 1), (4, 2)])
def test_a_rank_killed_during_a_64_mib_allreduce_is_named_by_every_survivor(p, victim, delay):
    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        outcomes = run_ranks(allreduce_until_killed, p, victim, 64 << 20, delay, kill_file, transport="zmq",
                             timeout=120, comm_timeout=FAULT_TIMEOUT, expect_errors=True)
        _check_killed(outcomes, victim, kill_file)


@pytest.mark.parametrize("delay", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("p,victim", [(2, 0), (4, 3)])
def test_a_rank_killed_during_small_allreduces_is_named_by_every_survivor(p, victim, delay):
    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        outcomes = run_ranks(allreduce_until_killed, p, victim, 1024, delay, kill_file, transport="zmq",
                             timeout=90, comm_timeout=FAULT_TIMEOUT, expect_errors=True)
        _check_killed(outcomes, victim, kill_file)


@pytest.mark.parametrize("p,victim", [(2, 1), (3, 0)])
def test_a_killed_rank_is_named_over_zeromq_sockets_alone(monkeypatch, p, victim):
    monkeypatch.setenv("COLLECTIVES_ZMQ_LANES", "0")
    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        outcomes = run_ranks(allreduce_until_killed, p, victim, 1024, 0.05, kill_file, transport="zmq",
                             timeout=90, comm_timeout=FAULT_TIMEOUT, expect_errors=True)
        _check_killed(outcomes, victim, kill_file)


# -- a stopped rank ----------------------------------------------------------------


def allreduce_until_stopped(comm, victim: int, nbytes: int, during: bool, pid_file: str, done_dir: str):
    """Allreduce in a loop; after three calls the victim stops itself
    (SIGSTOP) before the next, or ``during`` it. Survivors mark ``done_dir``
    once they raised. Returns (error kind, seconds of the failing call, message)."""
    buf = np.ones(nbytes // 4, np.float32)
    end = time.monotonic() + 60
    outcome, calls = ("completed", 0.0, ""), 0
    while time.monotonic() < end:
        if calls == 3 and comm.rank == victim:
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            if during:
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()
            else:
                os.kill(os.getpid(), signal.SIGSTOP)  # runs again when the test continues it
        start = time.monotonic()
        try:
            comm.allreduce(buf)
        except Exception as exc:
            outcome = (type(exc).__name__, time.monotonic() - start, str(exc))
            break
        calls += 1
    if comm.rank != victim:
        open(os.path.join(done_dir, str(comm.rank)), "w").close()
    return outcome


def _run_with_a_stopped_rank(fn, p: int, *args) -> list:
    """Run ``fn(comm, *args, pid_file, done_dir)`` on ``p`` ranks; continue the
    stopped rank (SIGCONT) once every other rank has marked ``done_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        pid_file, done_dir = os.path.join(tmp, "pid"), os.path.join(tmp, "done")
        os.mkdir(done_dir)
        result: dict = {}
        runner = threading.Thread(target=lambda: result.setdefault("outcomes", run_ranks(
            fn, p, *args, pid_file, done_dir, transport="zmq", timeout=120, comm_timeout=HANG_TIMEOUT,
            expect_errors=True)))
        runner.start()
        deadline = time.monotonic() + 100
        try:
            while time.monotonic() < deadline and runner.is_alive():
                if os.path.exists(pid_file) and len(os.listdir(done_dir)) >= p - 1:
                    break
                time.sleep(0.05)  # polls for the ranks' marks; orders nothing
        finally:
            if os.path.exists(pid_file):
                with open(pid_file) as f, contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(f.read()), signal.SIGCONT)
            runner.join(130)
    assert "outcomes" in result, "the ranks did not finish"
    return result["outcomes"]


def _verdict(message: str) -> str:
    assert "verdict: " in message, message
    return message[message.index("verdict: "):]


def _check_one_verdict(outcomes, victim: int, victim_in_call: bool = False) -> str:
    """Every survivor raised CollectiveTimeout in time with one verdict naming
    only ``victim``; so did the stopped rank once it ran again (no rank
    completes a call another saw fail), unless it was stopped inside a call
    (``victim_in_call``), whose own deadline may then pass first. Returns
    the verdict."""
    verdicts = []
    for o in outcomes:
        assert o.ok, str(o)
        kind, took, message = o.value
        if o.rank == victim and victim_in_call:
            assert kind in KINDS, f"the stopped rank {victim}: {kind}: {message}"
            continue
        assert kind == "CollectiveTimeout", f"rank {o.rank}: {kind}: {message}"
        if o.rank != victim:
            assert took <= HANG_TIMEOUT + 3.0, f"rank {o.rank} took {took:.2f}s"
        verdicts.append(_verdict(message))
    assert len(set(verdicts)) == 1, "ranks disagree:\n" + "\n".join(verdicts)
    late = re.findall(r"(rank \d+) \(host [^)]*\)(?: and (rank \d+) \(host [^)]*\))* ha(?:s|ve) not arrived",
                      verdicts[0])
    assert late and [r for r in late[0] if r] == [f"rank {victim}"], verdicts[0]
    return verdicts[0]


@pytest.mark.parametrize("victim", [0, 2])
def test_a_stopped_rank_is_named_by_one_verdict_on_every_survivor(victim):
    outcomes = _run_with_a_stopped_rank(allreduce_until_stopped, 4, victim, 4096, False)
    verdict = _check_one_verdict(outcomes, victim)
    assert "no answer" in verdict, verdict


def test_a_rank_stopped_during_a_large_allreduce_is_named_by_one_verdict():
    outcomes = _run_with_a_stopped_rank(allreduce_until_stopped, 4, 1, 16 << 20, True)
    _check_one_verdict(outcomes, 1, victim_in_call=True)


def test_a_stopped_rank_is_named_over_zeromq_sockets_alone(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_ZMQ_LANES", "0")
    outcomes = _run_with_a_stopped_rank(allreduce_until_stopped, 3, 2, 4096, False)
    _check_one_verdict(outcomes, 2)


def roots_disagree(comm, collective: str, roots: list[int]):
    """Rank r takes ``roots[r]`` for the root of ``collective``: the ranks that
    take another root than the others would only wait (or only send) in a
    pattern of their own; the signature check every rooted call over
    messages starts with finds it in that call, on every rank. Returns (error
    kind, seconds, message, the kind the next call raises)."""
    x = np.zeros(16, np.float32)
    comm.allreduce(x)
    root = roots[comm.rank]
    out = np.zeros(16 * comm.size, np.float32)
    start = time.monotonic()
    try:
        if collective == "bcast":
            comm.bcast(x, root=root)
        elif collective == "reduce":
            comm.reduce(x, root=root)
        elif collective == "gather":
            comm.gather(x, out if comm.rank == root else None, root=root)
        else:
            comm.scatter(out if comm.rank == root else None, x, root=root)
        outcome = ("completed", time.monotonic() - start, "")
    except CollectiveError as exc:
        outcome = (type(exc).__name__, time.monotonic() - start, str(exc))
    try:
        comm.allreduce(x)
        after = "completed"
    except CollectiveError as exc:
        after = type(exc).__name__
    return (*outcome, after)


#: (ranks, each rank's root, what every message says): two ranks that both
#: take themselves for the root (both would only send), ranks that each wait
#: for another (nobody sends), and one rank alone with another root.
ROOT_CASES = [(2, [0, 1], "root: rank 0 has 0, rank 1 has 1"),
              (3, [1, 0, 0], "root: rank 0 has 1, ranks 1, 2 have 0"),
              (4, [0, 0, 3, 0], "root: rank 2 has 3, ranks 0, 1, 3 have 0")]
PROMPT = 1.5  # seconds; the communicator's timeout is 20 times that


@pytest.mark.parametrize("collective", ["bcast", "reduce", "gather", "scatter"])
@pytest.mark.parametrize("p,roots,said", ROOT_CASES, ids=[f"p{c[0]}" for c in ROOT_CASES])
def test_ranks_that_disagree_on_the_root_get_the_mismatch_in_that_call(collective, p, roots, said):
    outcomes = run_ranks(roots_disagree, p, collective, roots, transport="zmq", timeout=60,
                         comm_timeout=20 * PROMPT)
    for rank, (kind, took, message, after) in enumerate(outcomes):
        assert kind == "MismatchedCollective", f"rank {rank}: {kind}: {message}"
        assert took <= PROMPT, f"rank {rank} took {took:.2f}s: {message}"
        assert f"{collective} #2" in message and said in message, f"rank {rank}: {message}"
        assert after == "MismatchedCollective", f"rank {rank}: the next call: {after}"


def _check_same_verdict(outcomes, kind: str) -> str:
    verdicts = []
    for o in outcomes:
        assert o.ok, str(o)
        got, took, message = o.value
        assert got == kind, f"rank {o.rank}: {got}: {message}"
        assert took <= HANG_TIMEOUT + 3.0, f"rank {o.rank} took {took:.2f}s"
        verdicts.append(_verdict(message))
    assert len(set(verdicts)) == 1, verdicts
    return verdicts[0]


def wait_for_each_other(comm):
    """Every rank waits for a message of call #5 from the next; nobody sends."""
    t, r, p = comm.transport, comm.rank, comm.size
    sig = signature.with_seq(signature.make("allgather", "ring", None, None, np.dtype(np.float32), 4), 5)
    start = time.monotonic()
    try:
        t.irecv(np.zeros(4, np.float32), (r + 1) % p, 2 * 5 + 1, sig).wait(HANG_TIMEOUT)
    except CollectiveError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "completed", time.monotonic() - start, ""


def test_ranks_waiting_on_each_other_get_a_verdict_that_everyone_arrived():
    outcomes = run_ranks(wait_for_each_other, 3, transport="zmq", timeout=60, expect_errors=True)
    verdict = _check_same_verdict(outcomes, "CollectiveTimeout")
    assert "every rank has arrived" in verdict, verdict
    assert re.search(r"rank 0 in allgather #5 for [\d.]+ s, waiting for rank 1; rank 1 in allgather #5 "
                     r"for [\d.]+ s, waiting for rank 2; rank 2 in allgather #5 for [\d.]+ s, waiting for rank 0",
                     verdict), verdict


# -- aborts ------------------------------------------------------------------------


def abort_while_peer_waits(comm, kind: str):
    """Rank 0 sends a message of call #4, then aborts with an error of
    ``kind``, sparing call #4, once rank 1 waits for a message that never
    comes. Rank 1 raises that kind at once, still takes call #4's message,
    and every later operation on either rank raises it again."""
    t = comm.transport
    sig4 = signature.with_seq(signature.make("bcast", "binomial", None, 0, np.dtype(np.uint8), 8), 4)
    if comm.rank == 0:
        t.isend(np.arange(8, dtype=np.uint8), 1, 2 * 4 + 1, sig4).wait(20)
        t.isend(np.zeros(1, np.uint8), 1, 2).wait(20)  # after call #4's message on the stream
        t.irecv(np.zeros(1, np.uint8), 1, 2).wait(20)  # rank 1 is about to wait
        error = getattr(collectives, kind)("rank 0 gives up")
        at = time.time()
        t.abort(abort_reason(error), 5)
        return at, None, None, _later_ops(t, 1)
    t.irecv(np.zeros(1, np.uint8), 0, 2).wait(20)  # call #4's message has arrived
    waiting = t.irecv(np.zeros(8, np.uint8), 0, 10)  # never sent
    t.isend(np.zeros(1, np.uint8), 0, 2).wait(20)
    try:
        waiting.wait(20)
        first = ("received",)
    except CollectiveError as exc:
        first = (type(exc).__name__, exc.origin, str(exc))
    at = time.time()
    earlier = np.zeros(8, np.uint8)
    t.irecv(earlier, 0, 2 * 4 + 1, sig4).wait(5)  # call #4 completed on rank 0: it may finish here
    return at, first, earlier.tolist(), _later_ops(t, 0)


def _later_ops(t, peer: int) -> list:
    said = []
    for op in (lambda: t.isend(np.zeros(2, np.uint8), peer, 2 * 5 + 1),
               lambda: t.irecv(np.zeros(2, np.uint8), peer, 2 * 6 + 1),
               lambda: t.isend(np.zeros(2, np.uint8), peer, 8)):
        try:
            op()
            said.append("no error")
        except CollectiveError as exc:
            said.append((type(exc).__name__, "gives up" in str(exc)))
    return said


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_reaches_a_waiting_peer_at_once_with_its_kind(kind):
    (aborted_at, _, _, later0), (raised_at, first, earlier, later1) = run_ranks(
        abort_while_peer_waits, 2, kind, transport="zmq", timeout=60)
    assert first[0] == kind and first[1] == 0 and "rank 0 aborted" in first[2] and "gives up" in first[2], first
    assert raised_at - aborted_at < 0.5, f"raised {raised_at - aborted_at:.3f}s after the abort"
    assert earlier == list(range(8)), "a call the aborting rank completed could not finish"
    assert later0 == later1 == [(kind, True)] * 3, (later0, later1)


def receive_after_the_sender_aborted(comm, nbytes: int):
    """Rank 0 sends ``nbytes`` on a point-to-point tag, then aborts. Rank 1
    learns of the abort first (a collective receive raises it), then posts
    the receive for what rank 0 sent before aborting: it is delivered
    whole (as a slower rank's part of setting up a communicator is), and a
    receive of something rank 0 never sent raises the abort."""
    t = comm.transport
    payload = ((np.arange(nbytes, dtype=np.int64) * 7 + 3) % 251).astype(np.uint8)
    if comm.rank == 0:
        t.isend(payload, 1, 2).wait(20)
        t.abort(abort_reason(collectives.MismatchedCollective("rank 0 gives up")))
        return None
    start = time.monotonic()
    try:
        t.irecv(np.zeros(8, np.uint8), 0, 2 * 3 + 1).wait(20)  # never sent
        told = "received"
    except CollectiveError as exc:
        told = type(exc).__name__
    got = np.zeros(nbytes, np.uint8)
    t.irecv(got, 0, 2).wait(20)
    try:
        t.irecv(np.zeros(8, np.uint8), 0, 4).wait(20)  # never sent
        after = "received"
    except CollectiveError as exc:
        after = (type(exc).__name__, "gives up" in str(exc))
    return told, bool(np.array_equal(got, payload)), after, time.monotonic() - start


@pytest.mark.parametrize("nbytes", [8, 64 * 1024])
def test_what_a_rank_sent_before_aborting_is_still_delivered(nbytes):
    _, (told, intact, after, took) = run_ranks(receive_after_the_sender_aborted, 2, nbytes,
                                               transport="zmq", timeout=60)
    assert told == "MismatchedCollective", told
    assert intact, "the message sent before the abort was not delivered whole"
    assert after == ("MismatchedCollective", True), after
    assert took < 10, f"took {took:.2f}s"


# -- a cut link between two network namespaces -----------------------------------------

RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_rank_main.py")
SUBNET = "10.78.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _namespaces_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


@pytest.fixture
def two_hosts():
    """Two namespaces joined by one veth pair (``eth0`` in each): host i is
    ``names[i]`` at ``10.78.0.{i+1}``; removed afterwards, also on failure."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    prefix = f"cw{secrets.token_hex(3)}"
    names = [f"{prefix}a", f"{prefix}b"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
        _ip("-n", names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", names[1])
        for i, ns in enumerate(names):
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for ns in names:
            _ip("netns", "del", ns, check=False)
        pytest.skip(f"cannot build network namespaces here: {(getattr(exc, 'stderr', '') or str(exc)).strip()}")
    try:
        yield names
    finally:
        for ns in names:
            _ip("netns", "del", ns, check=False)


def _start_rank(ns: str, rank: int, size: int, port: int, secret: str, extra: dict[str, str]) -> subprocess.Popen:
    env = environment_without(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_"), LAUNCH_NAMES)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": f"{SUBNET}.1",
                "MASTER_PORT": str(port), "COLLECTIVES_SECRET": secret, "PYTHONUNBUFFERED": "1", **extra})
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, RANK_MAIN], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def test_a_cut_link_is_told_apart_from_a_dead_process(two_hosts, tmp_path):
    """Ranks 0 and 1 on host a, rank 2 on host b; host b's link goes down
    mid-stream (no reset): ranks 0 and 1 raise PeerLost saying that nothing
    came from rank 2 for the heartbeat timeout, the link being cut, within
    that timeout and a few seconds; rank 2 fails too."""
    heartbeat = 2.0
    ready = str(tmp_path / "ready")
    placement = [0, 0, 1]
    port, secret = 20000 + secrets.randbelow(20000), secrets.token_hex(16)
    extra = {"NETNS_READY_FILE": ready, "NETNS_HEARTBEAT": str(heartbeat)}
    procs = [_start_rank(two_hosts[h], r, len(placement), port, secret, extra) for r, h in enumerate(placement)]
    try:
        end = time.monotonic() + 60
        while not all(os.path.exists(f"{ready}.{r}") for r in range(len(placement))):
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)  # polls for the ranks' marks; orders nothing
        _ip("-n", two_hosts[1], "link", "set", "eth0", "down")
        cut_at = time.time()
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        _stop(procs)
    results = []
    for rank, out in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no result:\n{out[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    for res in results[:2]:
        assert res["error"] == "PeerLost", res
        assert re.search(r"no traffic from rank 2 \(host [^)]*\) for 2 s: the link is cut", res["message"]), res
        assert "died" not in res["message"], res
        assert res["at"] - cut_at <= heartbeat + 4.0, (res, cut_at)
    assert results[2]["error"] in ("PeerLost", "CollectiveTimeout"), results[2]
    assert "link is cut" in results[2]["message"] or "not arrived" in results[2]["message"], results[2]
