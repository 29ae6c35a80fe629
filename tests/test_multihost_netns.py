"""Several "hosts" on one machine: network namespaces joined by a bridge.

Each host is a namespace with one veth link (``eth0``, 10.77.0.x/24) whose
other end is a port of a bridge that lives in a namespace of its own, so
nothing is added to the machine's own network. Ranks run in different
namespaces over the ZeroMQ transport with torchrun's environment and check
every collective and algorithm against numpy; then the same with one host's
link limited by a token bucket (``tc ... tbf rate 50mbit``), and one host's
link cut in the middle of a stream of allreduces. The namespaces
are named per run and removed after each test, even when it fails.

Needs root and kernel support for namespaces, veth and bridges; skips with
the reason otherwise.
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
from launched import suite_settings

from collectives.bench.netns import Hosts, hosts as make_hosts, rank_environment, start_rank, stop, unavailable

HOSTS = 4
RANK_DEADLINE = 240.0
RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_rank_main.py")


@pytest.fixture
def hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with make_hosts(HOSTS) as built:
            yield built
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"cannot build network namespaces here: {detail.strip()}")


def _start(hosts: Hosts, placement: list[int], extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start one rank per entry of ``placement`` (its host index)."""
    size, secret = len(placement), secrets.token_hex(16)
    master = hosts.address(placement[0])
    procs = []
    try:
        for rank, host in enumerate(placement):
            env = {**rank_environment(rank, size, master, secret), **suite_settings(), **(extra_env or {})}
            procs.append(start_rank(hosts, host, [sys.executable, RANK_MAIN], env))
    except BaseException:
        stop(procs)
        raise
    return procs


def _collect(procs: list[subprocess.Popen], deadline: float) -> list[dict]:
    """Every rank's ``RESULT``; ranks still running at ``deadline`` seconds are
    killed, and any failure fails the test with each rank's output."""
    outputs = []
    try:
        end = time.monotonic() + deadline
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop(procs)
                out, _ = p.communicate()
                out += f"\n(killed after {deadline:.0f}s)"
            outputs.append(out)
    finally:
        stop(procs)
    results = []
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            report = "\n".join(f"--- rank {r} (status {q.returncode}):\n{o[-3000:]}"
                               for r, (q, o) in enumerate(zip(procs, outputs)))
            pytest.fail(f"rank {rank} failed\n{report}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def run_across(hosts: Hosts, placement: list[int], deadline: float = RANK_DEADLINE) -> list[dict]:
    """Run one rank per entry of ``placement`` (its host index) and return their results."""
    return _collect(_start(hosts, placement), deadline)


def _assert_all_correct(hosts: Hosts, placement: list[int], results: list[dict]) -> None:
    for rank, res in enumerate(results):
        want = hosts.address(placement[rank])
        assert res["endpoint"].startswith(f"tcp://{want}:"), (rank, res["endpoint"])
    failures = [f"rank {r}: {f}" for r, res in enumerate(results)
                for fs in res["failures"].values() for f in fs]
    assert not failures, "\n".join(failures[:40])


def test_every_collective_across_four_hosts(hosts):
    placement = list(range(HOSTS))
    _assert_all_correct(hosts, placement, run_across(hosts, placement))


def test_three_hosts_with_two_ranks_sharing_one(hosts):
    placement = [0, 1, 2, 1]  # rank 3 shares host 1 with rank 1
    _assert_all_correct(hosts, placement, run_across(hosts, placement))


def test_every_collective_with_one_slow_link(hosts):
    hosts.limit(2)
    placement = list(range(HOSTS))
    _assert_all_correct(hosts, placement, run_across(hosts, placement))


def test_cut_link_becomes_peer_lost_on_every_surviving_rank(hosts, tmp_path):
    """Host 2's link goes down in the middle of a stream of allreduces: the
    ranks on hosts 0 and 1 raise PeerLost within the heartbeat timeout (plus
    the grace period and scheduling slack), saying that nothing came from
    rank 2 (a cut link, not a dead process), and the cut-off rank fails too."""
    heartbeat = 2.0
    ready = str(tmp_path / "ready")
    placement = [0, 1, 2]
    procs = _start(hosts, placement, {"NETNS_READY_FILE": ready, "NETNS_HEARTBEAT": str(heartbeat)})
    try:
        end = time.monotonic() + 90
        while not all(os.path.exists(f"{ready}.{r}") for r in range(len(placement))):
            if time.monotonic() > end or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        hosts.cut(2)  # every rank has finished an allreduce and is in its loop of them
        cut_at = time.time()
    except BaseException:
        stop(procs)
        raise
    results = _collect(procs, 90)
    for res in results[:2]:
        assert res["error"] == "PeerLost", res
        assert re.search(r"no traffic from rank 2 \(host [^)]*\) for 2 s: the link is cut", res["message"]), res
        assert "died" not in res["message"], res
        assert res["at"] - cut_at <= heartbeat + 4.0, (res, cut_at)
    assert results[2]["error"] in ("PeerLost", "CollectiveTimeout"), results[2]
