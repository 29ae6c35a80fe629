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
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

HOSTS = 4
SUBNET = "10.77.0"
MASTER_PORT = 29517
RANK_DEADLINE = 240.0
RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_rank_main.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@dataclass
class Hosts:
    """Namespaces making up one simulated cluster."""

    prefix: str
    switch: str
    names: list[str] = field(default_factory=list)

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def limit(self, i: int, rate: str = "50mbit") -> None:
        """Limit host ``i``'s link both ways with a token bucket."""
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "50ms"]
        _ip("netns", "exec", self.names[i], "tc", "qdisc", "add", "dev", "eth0", *tbf)
        _ip("netns", "exec", self.switch, "tc", "qdisc", "add", "dev", self._port(i), *tbf)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down (its switch port and its own end)."""
        _ip("-n", self.switch, "link", "set", self._port(i), "down")
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def _port(self, i: int) -> str:
        return f"{self.prefix}p{i}"


def _build(hosts: Hosts, count: int) -> None:
    _ip("netns", "add", hosts.switch)
    _ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", hosts.switch, "link", "set", "br0", "up")
    for i in range(count):
        ns = f"{hosts.prefix}h{i}"
        _ip("netns", "add", ns)
        hosts.names.append(ns)
        port = hosts._port(i)
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", hosts.switch)
        _ip("-n", hosts.switch, "link", "set", port, "master", "br0")
        _ip("-n", hosts.switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{hosts.address(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _teardown(hosts: Hosts) -> None:
    """Delete every namespace of ``hosts`` (their links go with them)."""
    for ns in [*hosts.names, hosts.switch]:
        _ip("netns", "del", ns, check=False)


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root to include multi-host tests)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    return None


@pytest.fixture
def hosts():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    prefix = f"cz{secrets.token_hex(2)}"  # short: interface names hold 15 characters
    built = Hosts(prefix, f"{prefix}sw")
    try:
        try:
            _build(built, HOSTS)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            pytest.skip(f"cannot build network namespaces here: {detail.strip()}")
        yield built
    finally:
        _teardown(built)


def _rank_env(rank: int, size: int, master: str, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": master,
                "MASTER_PORT": str(MASTER_PORT), "COLLECTIVES_SECRET": secret, "PYTHONUNBUFFERED": "1"})
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _start(hosts: Hosts, placement: list[int], extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start one rank per entry of ``placement`` (its host index)."""
    size, secret = len(placement), secrets.token_hex(16)
    master = hosts.address(placement[0])
    procs = []
    try:
        for rank, host in enumerate(placement):
            cmd = ["ip", "netns", "exec", hosts.names[host], sys.executable, RANK_MAIN]
            env = {**_rank_env(rank, size, master, secret), **(extra_env or {})}
            procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    except BaseException:
        _stop(procs)
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
                _stop(procs)
                out, _ = p.communicate()
                out += f"\n(killed after {deadline:.0f}s)"
            outputs.append(out)
    finally:
        _stop(procs)
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
    the grace period and scheduling slack), and the cut-off rank fails too."""
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
        time.sleep(0.5)  # allreduces in flight
        hosts.cut(2)
        cut_at = time.time()
    except BaseException:
        _stop(procs)
        raise
    results = _collect(procs, 90)
    for res in results[:2]:
        assert res["error"] == "PeerLost", res
        assert res["at"] - cut_at <= heartbeat + 4.0, (res, cut_at)
    assert results[2]["error"] in ("PeerLost", "CollectiveTimeout"), results[2]
