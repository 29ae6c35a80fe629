"""`collectives run --nnodes N`: one launcher per node, one job.

Real launchers, real ranks, real sockets. Two groups of tests:

* on this host, several launchers meeting on 127.0.0.1 (they run
  everywhere): ranks and their environment, uneven nodes, a node that never
  arrives, a rank killed on one node, signals, ``--on-failure continue``,
  the job secret (given, generated, wrong, on one node only, a stranger),
  what the rendezvous traffic shows (read through a relay between the
  launchers);
* across network namespaces (root and iproute2, skipped otherwise): one
  launcher per "host" (``ip netns exec NS collectives run ...``), the ranks
  on TCP between hosts.

Every launcher runs under a hard deadline; every failure test checks every
launcher's status, the time it took and what its message names.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
from launched import LAUNCH_NAMES, environment_without

from collectives.bench.netns import hosts as make_hosts, unavailable
from collectives.launcher import free_port

DEADLINE = 120.0  # a whole job, on a busy two-core machine
JOIN = 3.0  # --join-timeout of the tests about nodes that never arrive
SLACK = 6.0  # for a launcher to notice, say so and stop its ranks (the grace period is 3 s)

# Every collective against numpy, then one line: RESULT {...}
CHECK_SCRIPT = """\
import json, os
import numpy as np
import collectives

comm = collectives.init(timeout=60)
r, p, n = comm.rank, comm.size, 6
fails = []

def data(k):
    return np.arange(n * p, dtype=np.float64) + 1000.0 * k

def check(name, got, want):
    if not np.array_equal(got, want):
        fails.append(f"{name}: got {got[:8]}, want {want[:8]}")

every = np.concatenate([data(k) for k in range(p)])
total = sum(data(k) for k in range(p))
x = data(r); comm.allreduce(x); check("allreduce", x, total)
x = data(r); comm.allreduce(x, op="max"); check("allreduce max", x, data(p - 1))
x = data(r); comm.bcast(x, root=p - 1); check("bcast", x, data(p - 1))
x = data(r); comm.reduce(x, root=1)
if r == 1:
    check("reduce", x, total)
got = np.empty(n * p * p); comm.allgather(data(r), got); check("allgather", got, every)
got = np.empty(n * p * p); comm.gather(data(r), got, root=p - 1)
if r == p - 1:
    check("gather", got, every)
got = np.empty(n); comm.scatter(data(0), got, root=0); check("scatter", got, data(0)[r * n:(r + 1) * n])
got = np.empty(n); comm.reduce_scatter(data(r), got); check("reduce_scatter", got, total[r * n:(r + 1) * n])
send = np.concatenate([np.full(n, 100.0 * r + j) for j in range(p)])
got = np.empty(n * p); comm.alltoall(send, got)
check("alltoall", got, np.concatenate([np.full(n, 100.0 * i + r) for i in range(p)]))
comm.barrier()
names = ("COLLECTIVES_NNODES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
         "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "COLLECTIVES_LOCAL", "COLLECTIVES_JOB", "COLLECTIVES_SECRET")
print("RESULT " + json.dumps({"rank": r, "size": p, "fails": fails, "transport": comm.transport.name,
                              "endpoint": getattr(comm.transport, "endpoint", ""),
                              "env": {k: os.environ.get(k) for k in names}}), flush=True)
comm.close()
"""

# Says it is up (with its pid), waits until every rank is, then: rank KILLED
# kills itself, rank FAILS exits with status 3, the others wait a minute
# (or, with FINISH set, finish).
WAIT_SCRIPT = """\
import os, signal, sys, time
import collectives
comm = collectives.init(timeout=60)
print("up", comm.rank, os.getpid(), flush=True)
comm.barrier()
if comm.rank == int(os.environ.get("KILLED", "-1")):
    os.kill(os.getpid(), signal.SIGKILL)
if comm.rank == int(os.environ.get("FAILS", "-1")):
    sys.exit(3)
if os.environ.get("FINISH"):
    time.sleep(1.0)
    print("finished", comm.rank, flush=True)
    sys.exit(0)
time.sleep(60)
"""


@dataclass
class Ended:
    """One launcher's end."""

    node: int
    status: int | None
    out: str
    err: str
    seconds: float

    def __str__(self) -> str:
        return (f"--- node {self.node}: status {self.status} after {self.seconds:.1f}s\n"
                f"stdout:\n{self.out[-3000:]}\nstderr:\n{self.err[-3000:]}")


def _environment(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    env = environment_without(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_", "SLURM_"),
                              LAUNCH_NAMES + ("NODE_RANK", "GROUP_RANK"))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _launcher(nnodes: int, node: int, port: int, nprocs: int, script: str, *, addr: str = "127.0.0.1",
              join: float = 60.0, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "collectives.cli", "run", "--nnodes", str(nnodes), "--node-rank", str(node),
            "--master-addr", addr, "--master-port", str(port), "--join-timeout", str(join), "-n", str(nprocs),
            *extra, script]


class Launchers:
    """Launchers started by a test, each ended (killed at the deadline) by :meth:`finish`."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}

    def start(self, node: int, argv: list[str], env: dict[str, str], netns: str | None = None) -> subprocess.Popen:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.procs[node] = subprocess.Popen([*prefix, *argv], env=env, text=True, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
        self.started[node] = time.monotonic()
        return self.procs[node]

    def finish(self, deadline: float = DEADLINE) -> dict[int, Ended]:
        end = time.monotonic() + deadline
        ended = {}
        for node, p in self.procs.items():
            try:
                out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                out, err = p.communicate()
                err += f"\n(killed by the test after {deadline:.0f}s)"
            ended[node] = Ended(node, p.returncode, out, err, time.monotonic() - self.started[node])
        return ended

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def launchers():
    started = Launchers()
    yield started
    started.kill()


def _report(ended: dict[int, Ended]) -> str:
    return "\n".join(str(e) for e in ended.values())


def _results(ended: dict[int, Ended]) -> list[dict]:
    """Every rank's RESULT, in rank order; fails the test unless every launcher succeeded."""
    assert all(e.status == 0 for e in ended.values()), _report(ended)
    results = [json.loads(line.split("RESULT ", 1)[1]) for e in ended.values()
               for line in e.out.splitlines() if "RESULT " in line]
    return sorted(results, key=lambda res: res["rank"])


def _assert_job(results: list[dict], counts: list[int], master: str, launcher_port: int) -> None:
    """Every rank ran every collective right, with the environment of its place."""
    size = sum(counts)
    assert [res["rank"] for res in results] == list(range(size)), results
    placement = [(node, local) for node, k in enumerate(counts) for local in range(k)]
    jobs, secrets_, ports = set(), set(), set()
    for res in results:
        env, (node, local) = res["env"], placement[res["rank"]]
        assert res["fails"] == [], res
        assert res["transport"] == "zmq", res
        assert env["RANK"] == str(res["rank"]) and env["WORLD_SIZE"] == str(size), res
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(local), str(counts[node])), res
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(node), res
        assert env["MASTER_ADDR"] == master and env["COLLECTIVES_LOCAL"] == "0", res
        jobs.add(env["COLLECTIVES_JOB"])
        secrets_.add(env["COLLECTIVES_SECRET"])
        ports.add(env["MASTER_PORT"])
    assert len(jobs) == len(secrets_) == len(ports) == 1, results
    assert ports != {str(launcher_port)}, "the transports' rendezvous must not use the launchers' port"


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def _pids(ended: dict[int, Ended]) -> list[int]:
    return [int(m.group(1)) for e in ended.values() for m in re.finditer(r"\] up \d+ (\d+)", e.out)]


# -- on this host -------------------------------------------------------------------

@pytest.mark.parametrize("counts", [[2, 2], [2, 1]], ids=["2+2", "2+1"])
def test_two_launchers_on_one_host_run_every_collective(launchers, tmp_path, counts):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    for node in reversed(range(len(counts))):  # node 1 first: it waits for node 0
        launchers.start(node, _launcher(len(counts), node, port, counts[node], script), _environment())
    ended = launchers.finish()
    _assert_job(_results(ended), counts, "127.0.0.1", port)
    last = sum(counts) - 1
    mine = f"ranks 2 to {last}" if last > 2 else "rank 2"
    assert "node 1 of 2 (" in ended[1].err and f"{mine} of {sum(counts)}, job" in ended[1].err, _report(ended)


def test_node_that_never_arrives_is_named_by_the_one_that_did(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    launchers.start(0, _launcher(2, 0, port, 2, script, join=JOIN), _environment())
    ended = launchers.finish()
    assert ended[0].status == 1, _report(ended)
    assert ended[0].seconds < JOIN + SLACK, _report(ended)
    assert re.search(rf"node 0: node 1 of 2 did not join within {JOIN:g}s \(node 0's launcher listened on "
                     rf"port {port}; node 0 joined\)", ended[0].err), _report(ended)
    assert "RESULT" not in ended[0].out and "[rank" not in ended[0].out, "no rank starts without every node"


def test_missing_middle_node_is_named_on_every_node_that_came(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    launchers.start(2, _launcher(3, 2, port, 1, script, join=JOIN + 30), _environment())
    launchers.start(0, _launcher(3, 0, port, 1, script, join=JOIN), _environment())
    ended = launchers.finish()
    for node in (0, 2):
        assert ended[node].status == 1, _report(ended)
        assert "node 1 of 3 did not join" in ended[node].err, _report(ended)
        assert "[rank" not in ended[node].out, _report(ended)
    assert ended[0].seconds < JOIN + SLACK and ended[2].seconds < JOIN + SLACK + 5, _report(ended)
    assert "nodes 0, 2 joined" in ended[2].err, _report(ended)


def test_node_zero_that_never_arrives_is_named(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    launchers.start(1, _launcher(2, 1, port, 1, script, join=JOIN), _environment())
    ended = launchers.finish()
    assert ended[1].status == 1 and ended[1].seconds < JOIN + SLACK, _report(ended)
    assert re.search(rf"node 1: node 0's launcher at 127\.0\.0\.1:{port} did not answer within {JOIN:g}s "
                     r"\(Connection refused\)", ended[1].err), _report(ended)


def test_rank_killed_on_one_node_stops_every_node(launchers, tmp_path):
    """Rank 3 (node 1) kills itself once every rank is up: both launchers
    stop their ranks and exit with 128 + SIGKILL, naming the rank and its node."""
    script, port = _write(tmp_path, "wait.py", WAIT_SCRIPT), free_port()
    env = _environment(KILLED="3")
    for node in (1, 0):
        launchers.start(node, _launcher(2, node, port, 2, script), env)
    ended = launchers.finish()
    pids = _pids(ended)
    assert len(pids) == 4, _report(ended)
    for node in (0, 1):
        assert ended[node].status == 128 + signal.SIGKILL, _report(ended)
        assert re.search(r"rank 3 on node 1 \(host [^)]+\) was killed by SIGKILL", ended[node].err), _report(ended)
        assert ended[node].seconds < 45, _report(ended)  # the ranks' start, then a stop (not their minute)
    assert not [p for p in pids if _alive(p)], "every rank is stopped"


def test_signal_to_one_launcher_stops_every_node(launchers, tmp_path):
    script, port = _write(tmp_path, "wait.py", WAIT_SCRIPT), free_port()
    for node in (1, 0):
        launchers.start(node, _launcher(2, node, port, 1, script), _environment())
    _wait_for_line(launchers.procs[1], "] up 1 ", 60.0)
    sent = time.monotonic()
    launchers.procs[1].send_signal(signal.SIGTERM)
    ended = launchers.finish()
    for node in (0, 1):
        assert ended[node].status == 128 + signal.SIGTERM, _report(ended)
        assert "the launcher of node 1 (host" in ended[node].err and "got SIGTERM" in ended[node].err, _report(ended)
    assert time.monotonic() - sent < 3 * SLACK, _report(ended)
    assert not [p for p in _pids(ended) if _alive(p)]


def test_launcher_killed_on_one_node_stops_every_node(launchers, tmp_path):
    """Node 1's launcher dies (SIGKILL): its ranks die with it, node 0 sees
    its connection close, stops its own ranks and exits with 1, naming node 1."""
    script, port = _write(tmp_path, "wait.py", WAIT_SCRIPT), free_port()
    for node in (1, 0):
        launchers.start(node, _launcher(2, node, port, 1, script), _environment())
    _wait_for_line(launchers.procs[1], "] up 1 ", 60.0)
    killed = time.monotonic()
    launchers.procs[1].kill()
    ended = launchers.finish()
    assert ended[1].status == -signal.SIGKILL, _report(ended)
    assert ended[0].status == 1 and time.monotonic() - killed < 2 * SLACK, _report(ended)
    assert re.search(r"the launcher of node 1 \(host [^)]+\) is gone \(its connection closed\); the job ends "
                     r"with status 1", ended[0].err), _report(ended)
    assert not [p for p in _pids(ended) if _alive(p)], "every rank is stopped"


def _wait_for_line(proc: subprocess.Popen, text: str, seconds: float) -> str:
    """Read ``proc``'s stdout until a line holds ``text`` (at most ``seconds``)."""
    end, seen = time.monotonic() + seconds, ""
    while time.monotonic() < end:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            seen += line
            if text in line:
                return seen
            if not line:
                break
    pytest.fail(f"no line with {text!r} within {seconds}s; saw:\n{seen}")


def test_on_failure_continue_lets_every_node_finish(launchers, tmp_path):
    script, port = _write(tmp_path, "wait.py", WAIT_SCRIPT), free_port()
    env = _environment(FAILS="2", FINISH="1")
    for node in (1, 0):
        launchers.start(node, _launcher(2, node, port, 2, script, extra=("--on-failure", "continue")), env)
    ended = launchers.finish()
    for node in (0, 1):
        assert ended[node].status == 3, _report(ended)
    finished = {int(m) for e in ended.values() for m in re.findall(r"finished (\d+)", e.out)}
    assert finished == {0, 1, 3}, _report(ended)
    assert re.search(r"rank 2 on node 1 \(host [^)]+\) exited with status 3; the other ranks go on", ended[0].err)
    assert "1 rank failed, the first: rank 2 on node 1" in ended[1].err, _report(ended)


def test_given_secret_reaches_every_rank_and_never_the_wire(launchers, tmp_path):
    """With COLLECTIVES_SECRET on every node, what crosses the network (read
    through a relay between the launchers) holds neither the secret nor
    anything the ranks could join with; without it, the generated secret
    crosses in the clear (as the docs warn)."""
    script = _write(tmp_path, "check.py", CHECK_SCRIPT)
    given = "s3cret-" + secrets.token_hex(12)
    for secret in (given, None):
        port = free_port()
        with Relay(port) as relay:
            env = _environment(**({"COLLECTIVES_SECRET": secret} if secret else {}))
            started = Launchers()
            try:
                started.start(1, _launcher(2, 1, relay.port, 1, script), env)
                started.start(0, _launcher(2, 0, port, 1, script), env)
                ended = started.finish()
            finally:
                started.kill()
        results = _results(ended)
        _assert_job(results, [1, 1], "127.0.0.1", port)
        used = results[0]["env"]["COLLECTIVES_SECRET"]
        if secret:
            assert used == given and given.encode() not in relay.seen, relay.seen
        else:
            assert len(used) == 32 and used.encode() in relay.seen


def test_wrong_secret_is_refused_and_named_on_both_nodes(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    launchers.start(0, _launcher(2, 0, port, 1, script, join=JOIN + 3), _environment(COLLECTIVES_SECRET="right"))
    launchers.start(1, _launcher(2, 1, port, 1, script, join=JOIN + 3), _environment(COLLECTIVES_SECRET="wrong"))
    ended = launchers.finish()
    assert ended[1].status == 1 and ended[1].seconds < JOIN + 3 + SLACK, _report(ended)
    assert "node 0 refused this node: wrong job secret" in ended[1].err, _report(ended)
    assert ended[0].status == 1 and ended[0].seconds < JOIN + 3 + SLACK, _report(ended)
    assert re.search(r"node 1 of 2 did not join .*refused a connection from 127\.0\.0\.1: wrong job secret",
                     ended[0].err), _report(ended)
    assert "[rank" not in ended[0].out + ended[1].out


def test_secret_on_one_node_only_is_refused(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    launchers.start(0, _launcher(2, 0, port, 1, script, join=JOIN), _environment(COLLECTIVES_SECRET="given"))
    launchers.start(1, _launcher(2, 1, port, 1, script, join=JOIN), _environment())
    ended = launchers.finish()
    assert ended[1].status == 1 and ended[1].seconds < JOIN + SLACK, _report(ended)
    assert "COLLECTIVES_SECRET is set on node 0 and not on this node" in ended[1].err, _report(ended)
    assert ended[0].status == 1 and "node 1 of 2 did not join" in ended[0].err, _report(ended)


def test_stranger_without_the_secret_cannot_join_nor_spoil_the_job(launchers, tmp_path):
    """A connection that claims node 1 with a made-up proof is refused;
    then the real node 1 joins and the job runs."""
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    env = _environment(COLLECTIVES_SECRET=secrets.token_hex(16))
    launchers.start(0, _launcher(2, 0, port, 1, script), env)
    answer = _pose_as_node_1(port)
    assert answer["type"] == "error" and "wrong job secret" in answer["message"], answer
    launchers.start(1, _launcher(2, 1, port, 1, script), env)
    ended = launchers.finish()
    _assert_job(_results(ended), [1, 1], "127.0.0.1", port)
    assert "refused a node's launcher from 127.0.0.1: wrong job secret" in ended[0].err


def _pose_as_node_1(port: int) -> dict:
    """Join node 0's launcher as node 1 with a made-up proof; node 0's answer."""
    end = time.monotonic() + 60
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < end, "node 0's launcher did not start listening"
            time.sleep(0.1)
    with sock, sock.makefile("rwb") as f:
        hello = json.loads(f.readline())
        assert hello["type"] == "hello" and hello["auth"] is True, hello
        f.write(json.dumps({"type": "join", "node_rank": 1, "nnodes": 2, "host": "stranger", "nprocs": 1,
                            "nonce": "00", "auth": True, "mac": "00" * 32}).encode() + b"\n")
        f.flush()
        return json.loads(f.readline())


def test_bad_node_options_are_refused_at_once(tmp_path):
    script = _write(tmp_path, "check.py", CHECK_SCRIPT)
    res = subprocess.run(_launcher(2, 2, free_port(), 1, script), capture_output=True, text=True, timeout=60,
                         env=_environment())
    assert res.returncode == 2 and "--node-rank 2 is not one of 0 to 1" in res.stderr, res.stderr
    res = subprocess.run(_launcher(2, 0, 1, 1, script), capture_output=True, text=True, timeout=60,
                         env=_environment(COLLECTIVES_NNODES="x"))
    assert res.returncode == 2 and "COLLECTIVES_NNODES='x'" in res.stderr, res.stderr


def test_port_taken_on_node_zero_is_said(tmp_path):
    script = _write(tmp_path, "check.py", CHECK_SCRIPT)
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        res = subprocess.run(_launcher(2, 0, port, 1, script), capture_output=True, text=True, timeout=60,
                             env=_environment())
    assert res.returncode == 1 and f"node 0 cannot listen on port {port}" in res.stderr, res.stderr


def test_node_options_from_the_environment_are_not_passed_to_the_ranks(launchers, tmp_path):
    script, port = _write(tmp_path, "check.py", CHECK_SCRIPT), free_port()
    for node in (1, 0):
        env = _environment(COLLECTIVES_NNODES="2", COLLECTIVES_NODE_RANK=str(node),
                           COLLECTIVES_MASTER_ADDR="127.0.0.1", COLLECTIVES_MASTER_PORT=str(port))
        launchers.start(node, [sys.executable, "-m", "collectives.cli", "run", "-n", "1", script], env)
    results = _results(launchers.finish())
    _assert_job(results, [1, 1], "127.0.0.1", port)
    assert all(res["env"]["COLLECTIVES_NNODES"] is None for res in results), results


class Relay:
    """A TCP relay from a port of its own to ``target`` on 127.0.0.1 that keeps
    every byte going either way in ``seen`` (what the network shows)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen = b""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "Relay":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.server.close()

    def _serve(self) -> None:
        self.server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except socket.timeout:
                continue
            upstream = self._connect()
            if upstream is None:
                client.close()
                return
            self._pipe(client, upstream)

    def _connect(self) -> socket.socket | None:
        """A connection to the target, once it listens (at most a minute)."""
        end = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < end:
            try:
                return socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                time.sleep(0.05)
        return None

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        """Copy both ways until either side closes (or the relay stops)."""
        with a, b:
            while not self._stop.is_set():
                for src in select.select([a, b], [], [], 0.2)[0]:
                    data = src.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        self.seen += data
                    (b if src is a else a).sendall(data)


# -- across network namespaces ------------------------------------------------------

@pytest.fixture
def netns_hosts(request):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with make_hosts(request.param) as built:
            yield built
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"cannot build network namespaces here: {detail.strip()}")


@pytest.mark.parametrize("netns_hosts,counts", [(2, [2, 2]), (3, [2, 2, 2]), (2, [2, 1])],
                         indirect=["netns_hosts"], ids=["2x2", "3x2", "2+1"])
def test_launchers_in_namespaces_run_every_collective(netns_hosts, launchers, tmp_path, counts):
    script, port, master = _write(tmp_path, "check.py", CHECK_SCRIPT), 29400, netns_hosts.address(0)
    env = _environment(COLLECTIVES_SECRET=secrets.token_hex(16))
    for node in reversed(range(len(counts))):
        launchers.start(node, _launcher(len(counts), node, port, counts[node], script, addr=master), env,
                        netns=netns_hosts.names[node])
    results = _results(launchers.finish())
    _assert_job(results, counts, master, port)
    placement = [node for node, k in enumerate(counts) for _ in range(k)]
    for res in results:  # each rank listens on its own host's address
        assert res["endpoint"].startswith(f"tcp://{netns_hosts.address(placement[res['rank']])}:"), res


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_node_that_never_arrives_in_namespaces(netns_hosts, launchers, tmp_path):
    script, master = _write(tmp_path, "check.py", CHECK_SCRIPT), netns_hosts.address(0)
    launchers.start(0, _launcher(2, 0, 29400, 2, script, addr=master, join=JOIN), _environment(),
                    netns=netns_hosts.names[0])
    ended = launchers.finish()
    assert ended[0].status == 1 and ended[0].seconds < JOIN + SLACK, _report(ended)
    assert "node 1 of 2 did not join within 3s" in ended[0].err, _report(ended)


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_rank_killed_in_one_namespace_stops_every_node(netns_hosts, launchers, tmp_path):
    script, master = _write(tmp_path, "wait.py", WAIT_SCRIPT), netns_hosts.address(0)
    env = _environment(KILLED="1")
    for node in (1, 0):
        launchers.start(node, _launcher(2, node, 29400, 2, script, addr=master), env, netns=netns_hosts.names[node])
    ended = launchers.finish()
    pids = _pids(ended)
    assert len(pids) == 4, _report(ended)
    for node in (0, 1):
        assert ended[node].status == 128 + signal.SIGKILL, _report(ended)
        assert re.search(r"rank 1 on node 0 \(host [^)]+\) was killed by SIGKILL", ended[node].err), _report(ended)
        assert ended[node].seconds < 45, _report(ended)
    assert not [p for p in pids if _alive(p)], "every rank is stopped"
