"""Hierarchical communicators across network namespaces, started by `collectives run --nnodes`.

One launcher per "host" (``ip netns exec NS collectives run --nnodes N
--node-rank K ...``), the hosts joined by veth pairs and a bridge
(:mod:`collectives.bench.netns`). Namespaces on one machine share
``/dev/shm``, so by itself init counts them as one host (they can share
memory); each launcher here is given ``COLLECTIVES_HOST_ID`` of its own, as
a job over real hosts would find them. Checked: every collective and every
hierarchical algorithm against numpy on 2 and 3 hosts of 2 ranks and on
uneven 2 + 1; results with one host's link limited by ``tc ... tbf``; a call
mismatched between ranks on different hosts (different local ranks); a bad
argument on one rank; a killed rank. Every launcher runs under a hard
deadline, and every failure test checks every rank's outcome, its time and
what it names.

Needs root and iproute2; skips, saying why, otherwise.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time

import pytest
from launched import LAUNCH_NAMES, environment_without

from collectives.bench.netns import hosts as make_hosts, unavailable

TESTS = os.path.dirname(os.path.abspath(__file__))
DEADLINE = 150.0  # one job, on a busy two-core machine
TIMEOUT = 8.0  # the communicators' timeout in the failure jobs
SLACK = 5.0

SCRIPT = """\
import json, os, sys
sys.path.insert(0, {tests!r})
import collectives
import test_hierarchy as th

mode = os.environ["HIER_MODE"]
comm = collectives.init(timeout=float(os.environ.get("HIER_TIMEOUT", "60")))
out = {{"rank": comm.rank, "repr": repr(comm), "transport": comm.transport.name,
        "endpoint": getattr(comm.transport, "endpoint", ""), "topology": str(getattr(comm, "topology", ""))}}
if mode == "every":
    out["fails"] = th.every_collective(comm, th.EVERY, int(os.environ.get("HIER_COUNT", "5")),
                                       (("float32", "sum"), ("int64", "max")))
elif mode == "mismatch":
    out["outcome"] = th.mismatched(comm, "dtype:rank3", "auto")
elif mode == "refused":
    out["outcome"] = th.refused(comm, "auto", "allreduce")
elif mode == "killed":
    out["outcome"] = th.killed(comm, 3)
print("RESULT " + json.dumps(out), flush=True)
comm.close()
"""


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


def _environment(node: int, **extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, host ``node``'s identity and ``extra``."""
    env = environment_without(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_", "SLURM_"),
                              LAUNCH_NAMES + ("NODE_RANK", "GROUP_RANK"))
    env.update({"PYTHONUNBUFFERED": "1", "COLLECTIVES_HOST_ID": f"netns-host{node}"}, **extra)
    return env


def run_job(hosts, counts: list[int], mode: str, *, extra: dict[str, str] | None = None,
            on_failure: str = "stop") -> tuple[list[dict], list[tuple[int, str]]]:
    """One `collectives run --nnodes` per namespace; every rank's RESULT (rank order) and every launcher's
    (status, stderr). Launchers still running at the deadline are killed."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(SCRIPT.format(tests=TESTS))
        secret, port, master = secrets.token_hex(16), 29400 + secrets.randbelow(500), hosts.address(0)
        procs = []
        try:
            for node in reversed(range(len(counts))):  # node 0 last: the others wait for it
                argv = [sys.executable, "-m", "collectives.cli", "run", "--nnodes", str(len(counts)),
                        "--node-rank", str(node), "--master-addr", master, "--master-port", str(port),
                        "--join-timeout", "60", "--on-failure", on_failure, "-n", str(counts[node]), script]
                env = _environment(node, COLLECTIVES_SECRET=secret, HIER_MODE=mode, **(extra or {}))
                procs.append(subprocess.Popen(["ip", "netns", "exec", hosts.names[node], *argv], env=env, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              start_new_session=True))
            end, ended = time.monotonic() + DEADLINE, []
            for p in procs:
                try:
                    out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill(procs)
                    out, err = p.communicate()
                    err += f"\n(killed by the test after {DEADLINE:.0f}s)"
                ended.append((p.returncode, out, err))
        finally:
            _kill(procs)
    results = [json.loads(line.split("RESULT ", 1)[1]) for _, out, _ in ended for line in out.splitlines()
               if "RESULT " in line]
    return sorted(results, key=lambda r: r["rank"]), [(status, out[-2000:] + err[-3000:]) for status, out, err in ended]


def _kill(procs) -> None:
    import signal

    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _report(launchers) -> str:
    return "\n".join(f"--- launcher (status {s}):\n{text}" for s, text in launchers)


@pytest.mark.parametrize("netns_hosts,counts", [(2, [2, 2]), (3, [2, 2, 2]), (2, [2, 1])],
                         indirect=["netns_hosts"], ids=["2x2", "3x2", "2+1"])
def test_every_collective_and_algorithm_across_hosts(netns_hosts, counts):
    results, launchers = run_job(netns_hosts, counts, "every")
    assert all(s == 0 for s, _ in launchers) and len(results) == sum(counts), _report(launchers)
    placement = [node for node, k in enumerate(counts) for _ in range(k)]
    for res in results:
        assert res["repr"].startswith("HierarchicalCommunicator(") and res["transport"] == "zmq", res
        assert res["endpoint"].startswith(f"tcp://{netns_hosts.address(placement[res['rank']])}:"), res
        assert not res["fails"], res["fails"][:20]


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_every_collective_with_one_link_limited(netns_hosts):
    netns_hosts.limit(1, "200mbit")
    results, launchers = run_job(netns_hosts, [2, 2], "every", extra={"HIER_COUNT": "40000"})
    assert all(s == 0 for s, _ in launchers) and len(results) == 4, _report(launchers)
    assert not [f for res in results for f in res["fails"]], [res["fails"][:10] for res in results]


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_a_call_mismatched_between_ranks_on_different_hosts(netns_hosts):
    """Rank 3 (host 1, local rank 1) calls with float64, the others float32 (rank 0: host 0, local rank 0)."""
    results, launchers = run_job(netns_hosts, [2, 2], "mismatch", extra={"HIER_TIMEOUT": str(TIMEOUT)})
    assert len(results) == 4, _report(launchers)
    for res in results:
        kind, message, took = res["outcome"]
        assert kind == "MismatchedCollective", res
        assert re.search(r"allreduce #2\b", message) and "rank 3" in message and "float64" in message, res
        assert took < TIMEOUT + SLACK, res


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_bad_arguments_on_one_rank_in_namespaces(netns_hosts):
    results, launchers = run_job(netns_hosts, [2, 2], "refused", extra={"HIER_TIMEOUT": str(TIMEOUT)})
    assert all(s == 0 for s, _ in launchers) and len(results) == 4, _report(launchers)
    for res in results:
        (kind, message, took), (after, _, _), y = res["outcome"]
        assert kind == "BadArgument" and "rank 3 refused it" in message and took < TIMEOUT, res
        assert after is None and y == [6.0] * 4, res


@pytest.mark.parametrize("netns_hosts", [2], indirect=True)
def test_a_killed_rank_in_one_namespace(netns_hosts):
    results, launchers = run_job(netns_hosts, [2, 2], "killed", extra={"HIER_TIMEOUT": str(TIMEOUT)},
                                 on_failure="continue")
    assert [res["rank"] for res in results] == [0, 1, 2], _report(launchers)
    for res in results:
        kind, message, took = res["outcome"]
        assert kind == "PeerLost" and "rank 3" in message and took < TIMEOUT + SLACK, res
    assert all(s == 128 + 9 for s, _ in launchers), _report(launchers)
