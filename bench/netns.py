"""Several "hosts" on one machine: network namespaces joined by a bridge.

Each host is a namespace with one veth link (``eth0``, 10.77.0.x/24) whose
other end is a port of a bridge living in a namespace of its own, so nothing
is added to the machine's own network. The multi-host tests use
:func:`hosts` and :func:`start_rank`; from the command line, the same
sweep as ``collectives bench`` runs with one rank per namespace, over our
ZeroMQ transport and over torch's Gloo, alternately, and prints both::

    python -m collectives.bench.netns -n 4 --sizes 8,1K,64K,1M,16M [--rate 1gbit] [--repeat 3]

Needs root, iproute2 (``ip``, ``tc``) and kernel support for namespaces,
veth and bridges (:func:`unavailable` says why not). The namespaces are
removed on the way out, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

__all__ = ["Hosts", "hosts", "unavailable", "rank_environment", "start_rank", "stop", "main"]

SUBNET = "10.77.0"
MASTER_PORT = 29517


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@dataclass
class Hosts:
    """Namespaces making up one simulated cluster (``names[i]`` is host i)."""

    prefix: str
    switch: str
    names: list[str] = field(default_factory=list)

    def address(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{SUBNET}.{i + 1}"

    def limit(self, i: int, rate: str = "50mbit") -> None:
        """Limit host ``i``'s link both ways with a token bucket (``tc ... tbf``)."""
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "50ms"]
        _ip("netns", "exec", self.names[i], "tc", "qdisc", "add", "dev", "eth0", *tbf)
        _ip("netns", "exec", self.switch, "tc", "qdisc", "add", "dev", self._port(i), *tbf)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down (its switch port and its own end)."""
        _ip("-n", self.switch, "link", "set", self._port(i), "down")
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def _port(self, i: int) -> str:
        return f"{self.prefix}p{i}"

    def build(self, count: int) -> None:
        """Create the switch and ``count`` hosts (raises CalledProcessError)."""
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(count):
            ns = f"{self.prefix}h{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            port = self._port(i)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Delete every namespace (their links go with them)."""
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns, check=False)


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    return None


@contextlib.contextmanager
def hosts(count: int) -> Iterator[Hosts]:
    """``count`` hosts, removed on exit (also on errors)."""
    prefix = f"cz{secrets.token_hex(2)}"  # short: interface names hold 15 characters
    built = Hosts(prefix, f"{prefix}sw")
    try:
        built.build(count)
        yield built
    finally:
        built.teardown()


def rank_environment(rank: int, size: int, master: str, secret: str, port: int = MASTER_PORT) -> dict[str, str]:
    """torchrun's variables for one rank (none of this shell's launcher
    variables); Gloo is told to use the namespace's ``eth0``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": master,
                "MASTER_PORT": str(port), "COLLECTIVES_SECRET": secret, "PYTHONUNBUFFERED": "1",
                "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return env


def start_rank(hosts: Hosts, host: int, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """Run ``argv`` in host ``host``'s namespace (in a session of its own)."""
    return subprocess.Popen(["ip", "netns", "exec", hosts.names[host], *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """Kill every process group of ``procs`` still running and reap them."""
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


def _sweep(hosts: Hosts, peer: str, ns: argparse.Namespace, out: str, port: int) -> list[dict]:
    """One sweep of ``peer`` with rank i on host i (rendezvous on ``port``); rank 0's rows."""
    argv = [sys.executable, "-m", "collectives.bench.sweep", "--peer", peer, "--transport", "zmq",
            "--collectives", ns.collective, "--sizes", ",".join(map(str, ns.size_list)),
            "--algorithm", ns.algorithm if peer == "ours" else "auto", "--out", out]
    secret = secrets.token_hex(16)
    procs = [start_rank(hosts, r, argv, rank_environment(r, ns.nprocs, hosts.address(0), secret, port))
             for r in range(ns.nprocs)]
    try:
        end = time.monotonic() + ns.timeout
        outputs = [p.communicate(timeout=max(1.0, end - time.monotonic()))[0] for p in procs]
    finally:
        stop(procs)
    if any(p.returncode for p in procs) or not os.path.exists(out):
        raise RuntimeError(f"the {peer} sweep failed:\n" + "\n".join(o[-2000:] for o in outputs))
    with open(out) as f:
        return json.load(f)["rows"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collectives.bench.netns``: our ZeroMQ transport and Gloo, one rank per namespace."""
    from .cli import parse_sizes

    ap = argparse.ArgumentParser(prog="python -m collectives.bench.netns", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=4, help="hosts, one rank each")
    ap.add_argument("collective", nargs="?", default="allreduce")
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M")
    ap.add_argument("--algorithm", default="auto", help="our algorithm(s): auto, all or a comma list")
    ap.add_argument("--rate", default=None, help="limit every host's link (tc tbf rate, e.g. 1gbit)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the two sweeps this many times")
    ap.add_argument("--no-gloo", action="store_true", help="only our transport")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per sweep")
    ns = ap.parse_args(argv)
    why = unavailable()
    if why:
        print(f"collectives bench netns: {why}", file=sys.stderr)
        return 2
    ns.size_list = parse_sizes(ns.sizes)
    peers = ["ours"] + ([] if ns.no_gloo else ["gloo"])
    times: dict[tuple[str, str, int], list[float]] = {}
    chosen: dict[int, str] = {}
    with hosts(ns.nprocs) as built, tempfile.TemporaryDirectory() as tmp:
        if ns.rate:
            for i in range(ns.nprocs):
                built.limit(i, ns.rate)
        for round_ in range(ns.repeat):
            for k, peer in enumerate(peers):
                out = os.path.join(tmp, f"{peer}-{round_}.json")
                for row in _sweep(built, peer, ns, out, MASTER_PORT + 2 * round_ + k):
                    if row["wrong"]:
                        print(f"wrong results: {row}", file=sys.stderr)
                        return 3
                    label = "gloo" if peer != "ours" else row["algorithm"].split(":")[0]  # auto:ring -> auto
                    times.setdefault((label, row["mode"], row["size"]), []).append(row["time_us"])
                    if row["algorithm"].startswith("auto:"):
                        chosen[row["size"]] = row["algorithm"].split(":", 1)[1]
    labels = list(dict.fromkeys(k[0] for k in times))
    print(f"# {ns.collective}, {ns.nprocs} hosts (network namespaces on a bridge"
          f"{', links limited to ' + ns.rate if ns.rate else ''}), one rank each, ZeroMQ/TCP vs Gloo; "
          f"time (us) = median over iterations of the max over ranks, median of {ns.repeat} rounds")
    print("#   size(B)" + "".join(f" {lab:>18s}" for lab in labels)
          + ("" if ns.no_gloo else "  best/gloo") + "  auto chose")
    for size in ns.size_list:
        med = {lab: statistics.median(times[(lab, "inplace", size)]) for lab in labels
               if (lab, "inplace", size) in times}
        line = f"  {size:>9d}" + "".join(f" {med.get(lab, float('nan')):>18.1f}" for lab in labels)
        if "gloo" in med:
            ours = [v for lab, v in med.items() if lab != "gloo"]
            line += f"  {min(ours) / med['gloo']:9.2f}"
        print(line + f"  {chosen.get(size, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
