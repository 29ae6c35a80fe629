"""The time to shrink after a lost rank: detection, agreement and the first call.

    python -m collectives.bench.shrink_time [--ranks 4,8] [--transports shm,zmq] [--repeat 5]
        [--victim 1] [--count 1024] [--timeout 10] [--out f.json]

Each repeat is one job of ``collectives run -n P --transport T --on-failure
continue`` on this module's rank side (``--rank-side``): every rank warms
up (allreduces of ``--count`` float32), then the victim notes the time
(``time.monotonic()``, one clock for every process of the machine) and
kills itself with SIGKILL, while the survivors go on calling allreduce.
Each survivor records when it caught :class:`~collectives.errors.PeerLost`,
when ``comm.shrink()`` returned, and when its first allreduce on the new
communicator finished (its result checked). Per (transport, ranks) it
prints the median and the maximum over every survivor of every repeat of:

* detection: from the kill to the survivor's ``PeerLost``;
* shrink: from ``PeerLost`` to ``shrink()`` returned (the agreement on who
  failed, and the survivors' new transport);
* first call: from ``shrink()`` returned to the end of the first allreduce
  on the new communicator (the new transport's first message, its lazily
  set-up parts);
* total: from the kill to the end of that first call.

A repeat whose job does not end as expected (every survivor's report, the
victim killed) is reported as failed, with the launcher's output.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

__all__ = ["main", "run_job", "summary", "table"]

PHASES = ("detect_s", "shrink_s", "first_s", "total_s")
WARMUP = 20


# ------------------------------------------------------------ the rank side


def _rank_side(ns: argparse.Namespace) -> int:
    """One rank of one job: warm up, the victim dies, the survivors shrink."""
    import numpy as np

    import collectives
    from collectives import PeerLost

    comm = collectives.init(timeout=ns.timeout)
    me = comm.rank
    x = np.ones(ns.count, np.float32)
    for _ in range(WARMUP):
        comm.allreduce(x)
    if me == ns.victim:
        killed = time.monotonic()
        with open(os.path.join(ns.out, "victim.json"), "w") as f:
            json.dump({"rank": me, "killed": killed}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + ns.timeout
    lost = None
    while lost is None:
        try:
            comm.allreduce(x)
        except PeerLost:
            lost = time.monotonic()
        if lost is None and time.monotonic() > deadline:
            raise SystemExit(f"rank {me}: no PeerLost within {ns.timeout} s of the warm-up")
    new = comm.shrink()
    shrunk = time.monotonic()
    y = np.full(ns.count, new.original_ranks[new.rank] + 1.0, np.float32)
    new.allreduce(y)
    first = time.monotonic()
    want = sum(r + 1.0 for r in new.original_ranks)
    report = {"rank": me, "new_rank": new.rank, "size": new.size, "lost": lost, "shrunk": shrunk, "first": first,
              "right": bool(np.all(y == want)), "survivors": new.original_ranks}
    with open(os.path.join(ns.out, f"rank{me}.json"), "w") as f:
        json.dump(report, f)
    new.close()
    comm.close()
    return 0


# ------------------------------------------------------------------ a job


def run_job(transport: str, p: int, victim: int, count: int, timeout: float) -> dict[str, Any]:
    """One job of ``p`` ranks on ``transport``: every survivor's phases (seconds),
    or ``{"error": ...}`` with the launcher's output."""
    with tempfile.TemporaryDirectory(prefix="shrink_time_") as out:
        cmd = [sys.executable, "-m", "collectives.cli", "run", "-n", str(p), "--transport", transport,
               "--on-failure", "continue", "--timeout", str(3 * timeout + 30), os.path.abspath(__file__), "--rank-side", "--out", out, "--victim", str(victim), "--count", str(count),
               "--timeout", str(timeout)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * timeout + 60)
        except subprocess.TimeoutExpired as exc:
            return {"error": f"the job did not end within {exc.timeout:.0f} s"}
        said = (proc.stdout + proc.stderr).strip()
        try:
            with open(os.path.join(out, "victim.json")) as f:
                killed = json.load(f)["killed"]
            reports = []
            for r in range(p):
                if r != victim:
                    with open(os.path.join(out, f"rank{r}.json")) as f:
                        reports.append(json.load(f))
        except OSError as exc:
            return {"error": f"status {proc.returncode}, {exc.filename} missing: {said[-2000:]}"}
    survivors = [r for r in range(p) if r != victim]
    wrong = [m["rank"] for m in reports if not m["right"] or m["size"] != p - 1 or m["survivors"] != survivors]
    if proc.returncode != 128 + signal.SIGKILL or wrong:
        return {"error": f"status {proc.returncode}, wrong results on ranks {wrong}: {said[-2000:]}"}
    return {"ranks": [{"rank": m["rank"], "detect_s": m["lost"] - killed, "shrink_s": m["shrunk"] - m["lost"],
                       "first_s": m["first"] - m["shrunk"], "total_s": m["first"] - killed} for m in reports]}


# ---------------------------------------------------------------- report


def summary(jobs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and maximum of each phase over every survivor of every job that worked."""
    rows = [r for job in jobs if "ranks" in job for r in job["ranks"]]
    out: dict[str, Any] = {"repeats": len(jobs), "failed": sum(1 for job in jobs if "error" in job)}
    for phase in PHASES:
        values = [r[phase] for r in rows]
        out[phase] = {"median": statistics.median(values), "max": max(values)} if values else None
    return out


def _ms(v: dict[str, float] | None, key: str) -> str:
    return "-" if v is None else f"{1e3 * v[key]:.1f}"


def table(results: Sequence[dict[str, Any]]) -> str:
    """One line per (transport, ranks): median and maximum of each phase, in ms."""
    head = " ".join(f"{name + ' med':>12} {'max':>8}" for name in ("detect", "shrink", "first call", "total"))
    lines = ["# time to shrink after SIGKILL of one rank, ms (median and max over every survivor of every repeat)",
             f"# {'transport':>9} {'ranks':>5} {'repeats':>7} {'failed':>6} {head}"]
    for res in results:
        s = res["summary"]
        cells = " ".join(f"{_ms(s[ph], 'median'):>12} {_ms(s[ph], 'max'):>8}" for ph in PHASES)
        lines.append(f"  {res['transport']:>9} {res['p']:>5} {s['repeats']:>7} {s['failed']:>6} {cells}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.shrink_time", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,8", help="world sizes, comma-separated (default 4,8)")
    ap.add_argument("--transports", default="shm,zmq", help="transports, comma-separated (default shm,zmq)")
    ap.add_argument("--repeat", type=int, default=5, help="jobs per (transport, ranks) (default 5)")
    ap.add_argument("--victim", type=int, default=1, help="the rank that kills itself (default 1)")
    ap.add_argument("--count", type=int, default=1024, help="float32 elements per allreduce (default 1024)")
    ap.add_argument("--timeout", type=float, default=10.0, help="the communicators' timeout, seconds (default 10)")
    ap.add_argument("--out", default=None, help="write every job's phases and the summary as JSON here")
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_side:
        return _rank_side(ns)
    ranks = [int(p) for p in ns.ranks.split(",")]
    transports = [t for t in ns.transports.split(",") if t]
    if ns.repeat < 1 or any(p < 2 or not 0 <= ns.victim < p for p in ranks):
        ap.error(f"--repeat must be at least 1 and --victim {ns.victim} a rank of every world size {ranks}")
    results = []
    for transport in transports:
        for p in ranks:
            jobs = [run_job(transport, p, ns.victim, ns.count, ns.timeout) for _ in range(ns.repeat)]
            for job in jobs:
                if "error" in job:
                    print(f"# {transport}, {p} ranks: a repeat failed: {job['error']}", file=sys.stderr)
            results.append({"transport": transport, "p": p, "jobs": jobs, "summary": summary(jobs)})
    print(table(results))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"victim": ns.victim, "count": ns.count, "timeout": ns.timeout, "results": results}, f, indent=1)
    return 1 if any(r["summary"]["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
