"""Hierarchical against flat TCP and torch's Gloo, across network namespaces.

Two "hosts" (network namespaces on a bridge, :mod:`collectives.bench.netns`)
with two ranks each, every host's link limited by a token bucket (``tc ...
tbf``, default 1 Gbit/s each way); one ``collectives run --nnodes 2`` per
host, each host with its own ``COLLECTIVES_HOST_ID``. Every rank opens three
communicators side by side: ours, hierarchical (shared memory within the
host, TCP between hosts); ours, flat (``COLLECTIVES_HIERARCHY=off``: TCP
between every pair of ranks); and torch's Gloo. Then, interleaved and
repeated in the same run:

1. allreduce at 16 and 64 MiB (float32 sum): hierarchical, flat, Gloo;
2. every collective at 8 B, 1 MiB and 16 MiB: flat, hierarchical
   (``auto``, which may still choose a flat algorithm; the table says
   which), Gloo.

Time of one call = the slowest rank's, calls separated by a barrier; each
figure is the median over calls, then the median over rounds. Ratios are
flat / hierarchical and Gloo / hierarchical (above 1: hierarchical is
faster)::

    sudo python -m collectives.bench.hierarchy [--rate 1gbit] [--repeat 3] [--json out.json]

Needs root, iproute2 and torch (``--no-gloo`` without it).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["main"]

ALL_COLLECTIVES = ("allreduce", "bcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
                   "barrier")
MIB = 1 << 20


# ------------------------------------------------------------------ in every rank


def _iterations(nbytes: int) -> int:
    """Timed calls per measurement (the same on every rank)."""
    return 30 if nbytes <= 64 << 10 else 10 if nbytes <= 2 * MIB else 3


def _count(collective: str, nbytes: int, p: int) -> int:
    """float32 elements of a call of about ``nbytes`` (a multiple of p where blocks need one)."""
    n = max(1, nbytes // 4)
    if collective in ("allgather", "gather", "scatter", "reduce_scatter", "alltoall"):
        n = max(p, n - n % p)
    return n


def _ours(comm, collective: str, n: int, algorithm: str) -> Callable[[], Any]:
    """One call of ``collective`` on ``comm`` with buffers made once."""
    p, r = comm.size, comm.rank
    a = np.ones(n, np.float32)
    b = np.empty(n, np.float32)
    small = np.ones(n // p if n >= p else 1, np.float32)
    calls = {
        "allreduce": lambda: comm.allreduce(a, algorithm=algorithm),
        "bcast": lambda: comm.bcast(a, root=0, algorithm=algorithm),
        "reduce": lambda: comm.reduce(a, root=0, algorithm=algorithm),
        "allgather": lambda: comm.allgather(small, b, algorithm=algorithm),
        "gather": lambda: comm.gather(small, b if r == 0 else None, root=0, algorithm=algorithm),
        "scatter": lambda: comm.scatter(a if r == 0 else None, small, root=0, algorithm=algorithm),
        "reduce_scatter": lambda: comm.reduce_scatter(a, small, algorithm=algorithm),
        "alltoall": lambda: comm.alltoall(a, b, algorithm=algorithm),
        "barrier": lambda: comm.barrier(algorithm=algorithm),
    }
    return calls[collective]


def _gloo(dist, torch, collective: str, n: int, p: int, r: int) -> Callable[[], Any]:
    a = torch.ones(n)
    b = torch.empty(n)
    small = torch.ones(n // p if n >= p else 1)
    calls = {
        "allreduce": lambda: dist.all_reduce(a),
        "bcast": lambda: dist.broadcast(a, 0),
        "reduce": lambda: dist.reduce(a, 0),
        "allgather": lambda: dist.all_gather_into_tensor(b, small),
        "gather": lambda: dist.gather(small, list(b.chunk(p)) if r == 0 else None, 0),
        "scatter": lambda: dist.scatter(small, list(a.chunk(p)) if r == 0 else None, 0),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(small, a),
        "alltoall": lambda: dist.all_to_all_single(b, a),
        "barrier": lambda: dist.barrier(),
    }
    return calls[collective]


def _measure(call: Callable[[], Any], calls: int, sync: Callable[[], Any]) -> list[float]:
    """Seconds of each of ``calls`` timed calls on this rank (one untimed first), a barrier before each."""
    call()
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _slowest(flat, times: list[float]) -> float:
    """Median over calls of the slowest rank's time (every rank gets it)."""
    mine = np.array(times, np.float64)
    every = np.empty(mine.size * flat.size, np.float64)
    flat.allgather(mine, every)
    return float(np.median(every.reshape(flat.size, -1).max(axis=0)))


def _flat_communicator(timeout: float):
    """Ours without the hierarchy, on its own port."""
    import collectives

    os.environ["COLLECTIVES_HIERARCHY"] = "off"
    try:
        port = int(os.environ["MASTER_PORT"]) + 1
        return collectives.init(timeout=timeout, job=os.environ.get("COLLECTIVES_JOB", "bench") + "-flat",
                                master_port=str(port))
    finally:
        del os.environ["COLLECTIVES_HIERARCHY"]


def worker(ns: argparse.Namespace) -> int:
    """One rank: build the three communicators, measure, rank 0 writes ``ns.out``."""
    import collectives

    comm = collectives.init(timeout=ns.call_timeout)
    flat = _flat_communicator(ns.call_timeout)
    gloo = None
    if not ns.no_gloo:
        import torch
        import torch.distributed as dist

        port = int(os.environ["MASTER_PORT"]) + 2
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}", rank=comm.rank,
                                world_size=comm.size)
        gloo = (dist, torch)
    rows: list[dict] = []
    plan = [("allreduce", s, ("hierarchical", "flat", "gloo")) for s in ns.allreduce_sizes]
    plan += [(c, s, ("flat", "auto", "gloo")) for s in ns.sizes for c in ns.collectives
             if c != "barrier" or s == ns.sizes[0]]
    for rnd in range(ns.repeat):
        for collective, nbytes, who in plan:
            n = _count(collective, nbytes, comm.size)
            order = list(who[rnd % len(who):] + who[:rnd % len(who)])  # a different one first each round
            for name in order:
                if name == "gloo" and gloo is None:
                    continue
                if name == "gloo":
                    call = _gloo(*gloo, collective, n, comm.size, comm.rank)
                elif name == "flat":
                    call = _ours(flat, collective, n, "auto")
                else:
                    call = _ours(comm, collective, n, name)
                seconds = _slowest(flat, _measure(call, _iterations(4 * n), flat.barrier))
                chosen = ""
                if name == "auto":
                    chosen = comm.explain(collective, 4 * n, np.float32).choice
                elif name == "flat":
                    chosen = flat.selector.choose(collective, 4 * n, flat.size, np.dtype(np.float32),
                                                  frozenset(flat.transport.capabilities))
                rows.append({"round": rnd, "part": "allreduce" if who[0] == "hierarchical" else "every",
                             "collective": collective, "bytes": 4 * n if collective != "barrier" else 0,
                             "who": name, "algorithm": chosen or name, "seconds": seconds})
    if comm.rank == 0:
        with open(ns.out, "w") as f:
            json.dump({"rows": rows, "topology": comm.topology.describe(), "repr": repr(comm)}, f)
    if gloo is not None:
        gloo[0].destroy_process_group()
    flat.close()
    comm.close()
    return 0


# ------------------------------------------------------------------ the driver


def _bits(rate: str) -> float:
    """``1gbit`` -> 1e9 (tc's units: kbit, mbit, gbit)."""
    t = rate.strip().lower()
    for unit, k in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[:-len(unit)]) * k
    return float(t)


def limit(hosts, i: int, rate: str) -> None:
    """Limit host ``i``'s link both ways to ``rate`` with a token bucket whose
    burst holds a 4 ms tick of it (at least 32 kB): a smaller bucket cannot
    reach the rate at 1 Gbit/s (the kernel refills it per timer tick)."""
    burst = max(32 * 1024, int(_bits(rate) / 8 / 250))
    tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
    for ns, dev in ((hosts.names[i], "eth0"), (hosts.switch, f"{hosts.prefix}p{i}")):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *tbf], check=True,
                       capture_output=True, text=True, timeout=20)


def _job(hosts, ns: argparse.Namespace, out: str) -> None:
    """One launcher per namespace running this module's worker; raises with their output if one fails."""
    secret, port, master = secrets.token_hex(16), 29600 + secrets.randbelow(300) * 3, hosts.address(0)
    forwarded = ["--worker", "--out", out, "--repeat", str(ns.repeat), "--sizes", ns.sizes_text,
                 "--allreduce-sizes", ns.allreduce_text, "--collectives", ",".join(ns.collectives),
                 "--call-timeout", str(ns.call_timeout)] + (["--no-gloo"] if ns.no_gloo else [])
    procs = []
    for node in reversed(range(ns.hosts)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
        env.update({"COLLECTIVES_SECRET": secret, "COLLECTIVES_HOST_ID": f"bench-host{node}",
                    "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"})
        argv = [sys.executable, "-m", "collectives.cli", "run", "--nnodes", str(ns.hosts), "--node-rank", str(node),
                "--master-addr", master, "--master-port", str(port), "-n", str(ns.ranks), "--timeout",
                str(ns.timeout), sys.executable, "-m", "collectives.bench.hierarchy", *forwarded]
        procs.append(subprocess.Popen(["ip", "netns", "exec", hosts.names[node], *argv], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=ns.timeout + 60)[0] for p in procs]
    if any(p.returncode for p in procs) or not os.path.exists(out):
        raise RuntimeError("the bench job failed:\n" + "\n".join(o[-4000:] for o in outputs))


def _median(rows: list[dict], **match: Any) -> tuple[float, str]:
    sel = [r for r in rows if all(r[k] == v for k, v in match.items())]
    if not sel:
        return float("nan"), ""
    return statistics.median(r["seconds"] for r in sel), sel[0]["algorithm"]


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def report(data: dict, ns: argparse.Namespace) -> str:
    """The two tables, in markdown."""
    rows = data["rows"]
    lines = [f"# {ns.hosts} hosts x {ns.ranks} ranks (network namespaces), links limited to {ns.rate} each way; "
             f"float32; median of {ns.repeat} interleaved rounds of the median call (slowest rank)", "",
             data["topology"], "", "## allreduce", "",
             "| size | hierarchical (ms) | flat TCP (ms) | Gloo (ms) | flat / hier | Gloo / hier |",
             "|---:|---:|---:|---:|---:|---:|"]
    for nbytes in sorted({r["bytes"] for r in rows if r["part"] == "allreduce"}):
        h, _ = _median(rows, part="allreduce", bytes=nbytes, who="hierarchical")
        f, fa = _median(rows, part="allreduce", bytes=nbytes, who="flat")
        g, _ = _median(rows, part="allreduce", bytes=nbytes, who="gloo")
        lines.append(f"| {_size(nbytes)} | {_ms(h)} | {_ms(f)} ({fa}) | {_ms(g)} | {f / h:.2f} | {g / h:.2f} |")
    lines += ["", "## every collective", "",
              "| collective | size | flat (ms) | hierarchical auto (ms) | auto chose | Gloo (ms) | flat / auto | "
              "Gloo / auto |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    every = [r for r in rows if r["part"] == "every"]
    for collective in ns.collectives:
        for nbytes in sorted({r["bytes"] for r in every if r["collective"] == collective}):
            f, fa = _median(every, collective=collective, bytes=nbytes, who="flat")
            a, chose = _median(every, collective=collective, bytes=nbytes, who="auto")
            g, _ = _median(every, collective=collective, bytes=nbytes, who="gloo")
            lines.append(f"| {collective} | {_size(nbytes)} | {_ms(f)} ({fa}) | {_ms(a)} | {chose} | {_ms(g)} | "
                         f"{f / a:.2f} | {g / a:.2f} |")
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from .cli import parse_sizes

    ap = argparse.ArgumentParser(prog="python -m collectives.bench.hierarchy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="every host's link, each way (tc tbf rate)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per host")
    ap.add_argument("--allreduce-sizes", dest="allreduce_text", default="16M,64M")
    ap.add_argument("--sizes", dest="sizes_text", default="8,1M,16M", help="sizes of the every-collective table")
    ap.add_argument("--collectives", default=",".join(ALL_COLLECTIVES))
    ap.add_argument("--no-gloo", action="store_true", help="without torch's Gloo")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole job")
    ap.add_argument("--call-timeout", type=float, default=120.0, help="the communicators' timeout")
    ap.add_argument("--json", default=None, help="also write the raw rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    ns.sizes = parse_sizes(ns.sizes_text)
    ns.allreduce_sizes = parse_sizes(ns.allreduce_text)
    ns.collectives = [c for c in ns.collectives.split(",") if c]
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collectives.bench.hierarchy``: build the hosts, run the job, print the tables."""
    ns = _parse(argv)
    if ns.worker:
        return worker(ns)
    from .netns import hosts, unavailable

    why = unavailable()
    if why:
        print(f"collectives bench hierarchy: {why}", file=sys.stderr)
        return 2
    with hosts(ns.hosts) as built, tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.hosts):
            limit(built, i, ns.rate)
        out = os.path.join(tmp, "rows.json")
        _job(built, ns, out)
        with open(out) as f:
            data = json.load(f)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(data, f, indent=1)
    print(report(data, ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
