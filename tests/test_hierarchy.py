"""Hierarchical communicators on one machine: "hosts" by ``COLLECTIVES_HOST_ID``.

Real processes over the ZeroMQ/TCP transport between every pair of ranks
and shared memory among the ranks given the same host id: the topology
init discovers, every collective and every hierarchical algorithm against
numpy (even hosts, uneven hosts with ranks interleaved between hosts), the
v-variants, nonblocking calls; and misuse: calls mismatched between ranks
of one host and of different hosts (different local ranks), a bad argument
on one rank (every rank raises BadArgument, and the communicator goes on),
a killed rank and a hung one (every rank raises within the timeout and a
few seconds). Also the topology's arithmetic, the setting that turns it
off, and ``collectives explain --hosts``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import harness
from collectives.cost_models.hierarchy import Shape
from collectives.hierarchy.topology import Topology
from collectives.launcher import rank_environment
from reference import data, dtype_of, reduced

TIMEOUT = 8.0  # the communicators' timeout in the failure tests
SLACK = 5.0  # a busy two-core machine: noticing, aborting, scheduling
HIER = ("hierarchical", "hierarchical_one_round")
FLAT = {"allreduce": "ring", "bcast": "binomial", "reduce": "binomial", "allgather": "ring", "gather": "binomial",
        "scatter": "linear", "reduce_scatter": "ring", "alltoall": "pairwise", "barrier": "dissemination"}


def on_hosts(monkeypatch, placement: list[int]) -> None:
    """Make :func:`harness.run_ranks` start rank r on "host" ``placement[r]``."""
    def environment(rank: int, size: int, **kwargs):
        env = rank_environment(rank, size, **kwargs)
        env["COLLECTIVES_HOST_ID"] = f"host{placement[rank]}"
        env.pop("COLLECTIVES_HIERARCHY", None)
        return env
    monkeypatch.setattr(harness, "rank_environment", environment)


def run(monkeypatch, placement: list[int], fn, *args, **kwargs):
    on_hosts(monkeypatch, placement)
    kwargs.setdefault("timeout", 120.0)
    return harness.run_ranks(fn, len(placement), *args, transport="zmq", **kwargs)


# ------------------------------------------------------------ the checks ranks run


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.dtype.kind in "fc" or got.dtype == dtype_of("bfloat16"):
        return bool(np.allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=1e-2, atol=1e-2))
    return bool(np.array_equal(got, want))


def every_collective(comm, algorithms: dict[str, list[str]], count: int = 5, cases=(("float32", "sum"),),
                     salt: int = 0) -> list[str]:
    """Run every collective with each of ``algorithms[collective]``; the
    failures against numpy (empty when all is well)."""
    p, r = comm.size, comm.rank
    fails: list[str] = []

    def check(what: str, got, want) -> None:
        if not _close(np.asarray(got), np.asarray(want)):
            fails.append(f"rank {r}: {what}: got {np.asarray(got)[:6]}, want {np.asarray(want)[:6]}")

    vcounts = [(3 * i + count) % 7 for i in range(p)]  # uneven, zeros included
    vdispls = np.concatenate([[0], np.cumsum(vcounts)])
    for dtype, op in cases:
        dt = dtype_of(dtype)
        mine = data(r, count * p, dtype, op, salt)
        everyone = [data(k, count * p, dtype, op, salt) for k in range(p)]
        total = reduced(p, count * p, dtype, op, salt)
        blocks = [data(k, count, dtype, "sum", salt) for k in range(p)]
        for a in algorithms.get("allreduce", []):
            x = mine.copy(); comm.allreduce(x, op=op, algorithm=a); check(f"allreduce {a} {dtype} {op}", x, total)
        for a in algorithms.get("reduce", []):
            x = mine.copy(); comm.reduce(x, root=p - 1, op=op, algorithm=a)
            check(f"reduce {a} {dtype} {op}", x, total if r == p - 1 else mine)
        for a in algorithms.get("reduce_scatter", []):
            got = np.zeros(count, dt); comm.reduce_scatter(mine, got, op=op, algorithm=a)
            check(f"reduce_scatter {a} {dtype} {op}", got, total[r * count:(r + 1) * count])
            vsend = mine[:sum(vcounts)]
            got = np.zeros(vcounts[r], dt); comm.reduce_scatterv(vsend, got, vcounts, op=op, algorithm=a)
            check(f"reduce_scatterv {a} {dtype} {op}", got, total[vdispls[r]:vdispls[r + 1]])
        if op != "sum":
            continue
        for a in algorithms.get("bcast", []):
            x = everyone[1 % p].copy() if r == 1 % p else np.zeros(count * p, dt)
            comm.bcast(x, root=1 % p, algorithm=a); check(f"bcast {a} {dtype}", x, everyone[1 % p])
        for a in algorithms.get("allgather", []):
            got = np.zeros(count * p, dt); comm.allgather(blocks[r], got, algorithm=a)
            check(f"allgather {a} {dtype}", got, np.concatenate(blocks))
            vbuf = np.zeros(sum(vcounts), dt); vmine = mine[:vcounts[r]]
            comm.allgatherv(vmine, vbuf, vcounts, algorithm=a)
            check(f"allgatherv {a} {dtype}", vbuf, np.concatenate([everyone[k][:vcounts[k]] for k in range(p)]))
        for a in algorithms.get("gather", []):
            got = np.zeros(count * p, dt) if r == 0 else None
            comm.gather(blocks[r], got, root=0, algorithm=a)
            if r == 0:
                check(f"gather {a} {dtype}", got, np.concatenate(blocks))
            got = np.zeros(sum(vcounts), dt) if r == p - 1 else None
            comm.gatherv(mine[:vcounts[r]], got, vcounts, root=p - 1, algorithm=a)
            if r == p - 1:
                check(f"gatherv {a} {dtype}", got, np.concatenate([everyone[k][:vcounts[k]] for k in range(p)]))
        for a in algorithms.get("scatter", []):
            got = np.zeros(count, dt)
            comm.scatter(everyone[p - 1] if r == p - 1 else None, got, root=p - 1, algorithm=a)
            check(f"scatter {a} {dtype}", got, everyone[p - 1][r * count:(r + 1) * count])
            got = np.zeros(vcounts[r], dt)
            comm.scatterv(everyone[0][:sum(vcounts)] if r == 0 else None, got, vcounts, root=0, algorithm=a)
            check(f"scatterv {a} {dtype}", got, everyone[0][vdispls[r]:vdispls[r + 1]])
        for a in algorithms.get("alltoall", []):
            got = np.zeros(count * p, dt); comm.alltoall(mine, got, algorithm=a)
            want = np.concatenate([everyone[k][r * count:(r + 1) * count] for k in range(p)])
            check(f"alltoall {a} {dtype}", got, want)
        for a in algorithms.get("barrier", []):
            comm.barrier(algorithm=a)
    return fails


def _all(collectives_algorithms) -> dict[str, list[str]]:
    return {c: list(a) for c, a in collectives_algorithms.items()}


EVERY = {c: ["auto", FLAT[c], *([n for n in HIER if not (c == "barrier" and n != "hierarchical")])] for c in FLAT}


def check_every_collective(comm, count: int, cases) -> dict:
    return {"repr": repr(comm), "topology": str(getattr(comm, "topology", None)),
            "fails": every_collective(comm, EVERY, count, cases)}


# ------------------------------------------------------------------- the tests


def test_topology_of_interleaved_uneven_hosts():
    records = [{"id": "a", "name": "A", "cores": 4}, {"id": "b", "name": "B", "cores": 2},
               {"id": "a", "name": "A", "cores": 4}, {"id": "b", "name": "B", "cores": 2},
               {"id": "a", "name": "A", "cores": 4}]
    t = Topology.from_records(records, rank=3)
    assert t.hosts == ((0, 2, 4), (1, 3)) and t.names == ("A", "B") and t.cores == (4, 2)
    assert (t.node, t.local_rank, t.local_size) == (1, 1, 2)
    assert t.slices == 2 and t.uneven and t.hierarchical and not t.contiguous
    assert t.group(1) == (2, 3) and t.dependents(0, 0) == (0, 2) and t.dependents(1, 0) == (0,)
    assert t.slot_order() == [0, 4, 1, 2, 3]
    assert t.shape() == "3+2" and "node 1: B, ranks 1, 3" in t.describe()
    assert Shape.parse("2x4").sizes == (4, 4) and Shape.parse("2+1").sizes == (2, 1)


def test_host_identity_is_overridable_and_otherwise_machine_wide(monkeypatch):
    from collectives.hierarchy.topology import host_identity

    monkeypatch.delenv("COLLECTIVES_HOST_ID", raising=False)
    auto, _ = host_identity()
    assert auto.startswith("auto:") and host_identity()[0] == auto
    monkeypatch.setenv("COLLECTIVES_HOST_ID", "rack1-node7")
    assert host_identity() == ("id:rack1-node7", "rack1-node7")


@pytest.mark.parametrize("placement", [[0, 0, 1, 1], [0, 1, 0]], ids=["2x2", "2+1-interleaved"])
def test_every_collective_and_algorithm_against_numpy(monkeypatch, placement):
    cases = (("float32", "sum"), ("int64", "max"), ("float16", "avg"))
    results = run(monkeypatch, placement, check_every_collective, 5, cases)
    assert "HierarchicalCommunicator" in results[0]["repr"], results[0]
    fails = [f for res in results for f in res["fails"]]
    assert not fails, "\n".join(fails[:30])


def test_setting_off_keeps_the_flat_communicator(monkeypatch):
    def flat(comm):
        x = np.ones(4, np.float32) * comm.rank
        comm.allreduce(x)
        return repr(comm), x.tolist()
    monkeypatch.setenv("COLLECTIVES_HIERARCHY", "off")
    on_hosts(monkeypatch, [0, 0, 1, 1])
    original = harness.rank_environment

    def environment(rank, size, **kwargs):
        env = original(rank, size, **kwargs)
        env["COLLECTIVES_HIERARCHY"] = "off"
        return env
    monkeypatch.setattr(harness, "rank_environment", environment)
    results = harness.run_ranks(flat, 4, transport="zmq", timeout=60.0)
    assert all(r.startswith("Communicator(") and x == [6.0] * 4 for r, x in results), results


def nonblocking_and_topology(comm):
    x = np.arange(6, dtype=np.float64) + comm.rank
    h = comm.iallreduce(x, algorithm="hierarchical")
    y = np.full(3, float(comm.rank))
    g = comm.iallgather(y, np.empty(3 * comm.size), algorithm="hierarchical_one_round")
    h.wait(timeout=20)
    got = g.wait(timeout=20)
    t = comm.topology
    said = comm.explain("allreduce", 16 << 20).table()
    return x.tolist(), got.tolist(), (t.node, t.local_rank, t.local_size, t.hosts), said


def test_nonblocking_calls_and_the_topology_property(monkeypatch):
    results = run(monkeypatch, [0, 1, 1, 0], nonblocking_and_topology)
    p = 4
    for rank, (x, got, (node, local, size, hosts), said) in enumerate(results):
        assert "node 0: host0, ranks 0, 3" in said and "node 1: host1, ranks 1-2" in said, said
        assert f"this rank: {rank}" in said and "cores" in said and "choice: " in said, said
        assert x == [sum(i + r for r in range(p)) for i in range(6)]
        assert got == [float(r) for r in range(p) for _ in range(3)]
        assert hosts == ((0, 3), (1, 2)) and node == (0 if rank in (0, 3) else 1)
        assert local == (0 if rank in (0, 1) else 1) and size == 2


# ---------------------------------------------------------------- misuse


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def mismatched(comm, case: str, algorithm: str):
    """One good call, then ranks disagree: on host 1's local rank 1 (``rank3``), or all of host 1 (``host1``)."""
    comm.allreduce(np.ones(8, np.float32), algorithm=algorithm)
    odd = comm.rank == 3 or (case.endswith("host1") and comm.rank == 2)
    kind = case.split(":")[0]
    x = np.ones(9 if (odd and kind == "count") else 8, np.float64 if (odd and kind == "dtype") else np.float32)
    if kind == "collective" and odd:
        return _timed(lambda: comm.bcast(x, root=0, algorithm="binomial"))
    if kind == "root":
        return _timed(lambda: comm.bcast(x, root=1 if odd else 0, algorithm=algorithm))
    return _timed(lambda: comm.allreduce(x, op="max" if (odd and kind == "op") else "sum", algorithm=algorithm))


@pytest.mark.parametrize("case,algorithm", [
    ("dtype:rank3", "hierarchical"), ("count:rank3", "hierarchical_one_round"), ("op:rank3", "auto"),
    ("collective:rank3", "hierarchical"), ("root:rank3", "hierarchical"), ("dtype:host1", "hierarchical"),
    ("count:host1", "auto")])
def test_a_call_mismatched_between_hosts_is_an_error_on_every_rank(monkeypatch, case, algorithm):
    outcomes = run(monkeypatch, [0, 0, 1, 1], mismatched, case, algorithm, comm_timeout=TIMEOUT)
    field = {"dtype": "float64", "count": "x 9", "op": "max", "collective": "bcast", "root": "root"}[case.split(":")[0]]
    for rank, (kind, message, took) in enumerate(outcomes):
        assert kind == "MismatchedCollective", (rank, kind, message)
        assert re.search(r"(allreduce|bcast|call) #2\b", message), (rank, message)
        assert "rank 3" in message or "ranks 2, 3" in message, (rank, message)
        assert field in message, (rank, message)
        assert took < TIMEOUT + SLACK, (rank, took, message)


def refused(comm, algorithm: str, collective: str):
    """Rank 3 (host 1, local rank 1) passes a read-only buffer; then a good call."""
    r, p = comm.rank, comm.size
    if collective == "allreduce":
        x = np.ones(8, np.float32)
        x.flags.writeable = r != 3
        first = _timed(lambda: comm.allreduce(x, algorithm=algorithm))
    else:  # gather: the root's receive buffer is too small
        recv = np.zeros(3 * p - (1 if r == 0 else 0), np.float32) if r == 0 else None
        first = _timed(lambda: comm.gather(np.ones(3, np.float32), recv, root=0, algorithm=algorithm))
    y = np.full(4, float(r))
    second = _timed(lambda: comm.allreduce(y, algorithm=algorithm))
    return first, second, y.tolist()


@pytest.mark.parametrize("algorithm,collective", [("hierarchical", "allreduce"),
                                                  ("hierarchical_one_round", "allreduce"),
                                                  ("auto", "gather"), ("hierarchical", "gather")])
def test_bad_arguments_on_one_rank_are_an_error_on_every_rank_and_the_communicator_goes_on(
        monkeypatch, algorithm, collective):
    outcomes = run(monkeypatch, [0, 0, 1, 1], refused, algorithm, collective, comm_timeout=TIMEOUT)
    refuser = 3 if collective == "allreduce" else 0
    for rank, ((kind, message, took), (after, said, _), y) in enumerate(outcomes):
        assert kind == "BadArgument", (rank, kind, message)
        assert f"rank {refuser} refused it" in message or rank == refuser, (rank, message)
        assert re.search(rf"{collective} #1\b", message), (rank, message)
        assert took < TIMEOUT, (rank, took)
        assert after is None and y == [6.0] * 4, (rank, after, said, y)


def test_bad_arguments_in_a_flat_call_are_an_error_on_every_rank(monkeypatch):
    outcomes = run(monkeypatch, [0, 0, 1, 1], refused, "ring", "allreduce", comm_timeout=TIMEOUT)
    for rank, ((kind, message, took), _, _) in enumerate(outcomes):
        assert kind == "BadArgument" and "rank 3" in message, (rank, kind, message)
        assert took < TIMEOUT + SLACK, (rank, took)


def killed(comm, victim: int):
    """Hierarchical allreduces of 4 MiB until rank ``victim`` kills itself
    right after a barrier. The barrier counts among the survivors' calls: a
    rank may leave a barrier before its last messages reach the others, so
    the victim's death can fail their barrier as well as a later call."""
    x = np.ones(1 << 20, np.float32)
    comm.allreduce(x, algorithm="hierarchical")
    if comm.rank == victim:
        comm.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    return _timed(lambda: [comm.barrier()] + [comm.allreduce(x, algorithm="hierarchical") for _ in range(1000)])


@pytest.mark.parametrize("victim", [3, 0])
def test_a_killed_rank_is_an_error_on_every_survivor(monkeypatch, victim):
    outcomes = run(monkeypatch, [0, 0, 1, 1], killed, victim, comm_timeout=TIMEOUT, expect_errors=True)
    for o in outcomes:
        if o.rank == victim:
            assert not o.ok and o.error_type == "ProcessDied", o
            continue
        assert o.ok, o
        kind, message, took = o.value
        assert kind == "PeerLost", (o.rank, kind, message)
        assert f"rank {victim}" in message, (o.rank, message)
        assert took < TIMEOUT + SLACK, (o.rank, took, message)


def killed_then_shrunk(comm, victim: int):
    """Rank ``victim`` dies between calls; the survivors shrink and sum over the rest."""
    from collectives import PeerLost

    x = np.ones(1 << 16, np.float32)
    comm.allreduce(x, algorithm="hierarchical")
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            comm.allreduce(x, algorithm="hierarchical")
    except PeerLost:
        pass
    start = time.monotonic()
    new = comm.shrink()
    took = time.monotonic() - start
    y = np.full(8, float(new.original_ranks[new.rank] + 1), np.float32)
    new.allreduce(y)
    new.close()
    return type(new).__name__, new.size, new.original_ranks, float(y[0]), took


def test_the_survivors_of_a_killed_rank_shrink_to_a_flat_communicator(monkeypatch):
    outcomes = run(monkeypatch, [0, 0, 1, 1], killed_then_shrunk, 2, comm_timeout=TIMEOUT, expect_errors=True)
    assert not outcomes[2].ok and outcomes[2].error_type == "ProcessDied", outcomes[2]
    for o in (outcomes[0], outcomes[1], outcomes[3]):
        assert o.ok, o
        kind, size, original, total, took = o.value
        assert (kind, size, original, total) == ("Communicator", 3, [0, 1, 3], 1.0 + 2.0 + 4.0), o.value
        assert took < TIMEOUT + SLACK, took


def hung(comm, sleeper: int, done: str):
    """Rank ``sleeper`` comes to the call only once every other rank has raised (said by a file each)."""
    comm.barrier()
    others = [r for r in range(comm.size) if r != sleeper]
    if comm.rank == sleeper:
        end = time.monotonic() + 60
        while not all(os.path.exists(f"{done}.{r}") for r in others) and time.monotonic() < end:
            time.sleep(0.05)
    outcome = _timed(lambda: comm.allreduce(np.ones(64, np.float32), algorithm="hierarchical"))
    open(f"{done}.{comm.rank}", "w").close()
    return outcome


def test_a_hung_rank_is_a_timeout_on_every_other_rank(monkeypatch, tmp_path):
    timeout = 4.0
    outcomes = run(monkeypatch, [0, 0, 1, 1], hung, 2, str(tmp_path / "raised"), comm_timeout=timeout)
    for rank, (kind, message, took) in enumerate(outcomes):
        if rank == 2:  # comes to an aborted communicator
            assert kind == "CollectiveTimeout" and took < 1.0, (kind, message, took)
            continue
        assert kind == "CollectiveTimeout", (rank, kind, message)
        assert "rank 2" in message and "allreduce #2" in message, (rank, message)
        assert timeout - 0.5 < took < timeout + SLACK, (rank, took, message)


def test_explain_shows_the_topology_and_the_choice():
    out = subprocess.run([sys.executable, "-m", "collectives.cli", "explain", "allreduce", "--bytes", "16M",
                          "--hosts", "2x2", "--transport", "zmq"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 hosts" in out.stdout and "hierarchical" in out.stdout and "ring" in out.stdout, out.stdout
    assert re.search(r"choice: \S+", out.stdout), out.stdout
