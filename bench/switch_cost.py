"""What a switch costs: the same collective with a setting on and off, in one run.

    python -m collectives.bench.switch_cost [-n 2] [--switch COLLECTIVES_SIGNATURE_CHECKS]
        [--collective allreduce] [--sizes 8,64K,1M] [--iters 2000] [--rounds 15] [--out f.json]

starts P local ranks; each opens two communicators, one with the switch's
environment variable at ``--on`` (default 1) and one at ``--off`` (default
0), and times blocks of ``--iters`` back-to-back calls on each in turn
(``--rounds`` rounds, the order alternating), in place, from a common
start. Prints per size the median time per call of each (the slowest
rank's), their difference and ratio, and the spread between rounds (the
difference between the medians of the even and of the odd rounds), so a
difference smaller than the spread is noise. Switches: signature checks
(``COLLECTIVES_SIGNATURE_CHECKS``, for measurement only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Sequence

import numpy as np

__all__ = ["main"]


def _open(switch: str, value: str, job: str):
    import collectives

    os.environ[switch] = value
    try:
        return collectives.init(job=job, timeout=120)
    finally:
        os.environ.pop(switch, None)


def _block(comm, call, iters: int) -> float:
    """Seconds per call of ``iters`` calls, from a barrier's exit."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def rank_main(ns) -> int:
    from collectives.arithmetic import parse_bytes

    job = os.environ.get("COLLECTIVES_JOB", "switch")
    comms = {"on": _open(ns.switch, ns.on, job + "-on"), "off": _open(ns.switch, ns.off, job + "-off")}
    rank = comms["on"].rank
    rows = []
    for size in [parse_bytes(s) for s in ns.sizes.split(",")]:
        bufs = {k: np.ones(max(1, size // 4), np.float32) for k in comms}
        calls = {k: _caller(c, ns.collective, bufs[k]) for k, c in comms.items()}
        for k in comms:
            _block(comms[k], calls[k], max(10, ns.iters // 10))  # warm up
        times: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(ns.rounds):
            for k in (("on", "off") if r % 2 == 0 else ("off", "on")):
                mine = np.array([_block(comms[k], calls[k], ns.iters)])
                comms["on"].allreduce(mine, op="max")  # the slowest rank's
                times[k].append(float(mine[0]))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        halves = [statistics.median(t[i::2]) for t in times.values() for i in (0, 1)]
        spread = max(abs(halves[0] - halves[1]), abs(halves[2] - halves[3]))
        rows.append({"bytes": size, "on_us": on * 1e6, "off_us": off * 1e6, "diff_us": (on - off) * 1e6,
                     "ratio": on / off, "spread_us": spread * 1e6,
                     "on_all_us": [t * 1e6 for t in times["on"]], "off_all_us": [t * 1e6 for t in times["off"]]})
    if rank == 0:
        print(f"{ns.collective}, {comms['on'].size} ranks, {ns.switch} = {ns.on} (on) against {ns.off} (off); "
              f"{ns.rounds} rounds of {ns.iters} calls, median of the slowest rank's time per call")
        print(f"{'bytes':>10} {'on us':>10} {'off us':>10} {'on-off us':>10} {'on/off':>8} {'spread us':>10}")
        for row in rows:
            print(f"{row['bytes']:>10} {row['on_us']:>10.3f} {row['off_us']:>10.3f} {row['diff_us']:>10.3f} "
                  f"{row['ratio']:>8.3f} {row['spread_us']:>10.3f}")
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump({"switch": ns.switch, "collective": ns.collective, "ranks": comms["on"].size,
                           "rows": rows}, f, indent=1)
    for c in comms.values():
        c.close()
    return 0


def _caller(comm, collective: str, buf: np.ndarray):
    if collective == "allreduce":
        return lambda: comm.allreduce(buf)
    if collective == "bcast":
        return lambda: comm.bcast(buf, 0)
    if collective == "barrier":
        return lambda: comm.barrier()
    if collective == "reduce":
        return lambda: comm.reduce(buf, 0)
    raise SystemExit(f"--collective: allreduce, bcast, reduce or barrier, not {collective!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; starts the ranks unless run as one of them."""
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.switch_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--switch", default="COLLECTIVES_SIGNATURE_CHECKS")
    ap.add_argument("--on", default="1")
    ap.add_argument("--off", default="0")
    ap.add_argument("--collective", default="allreduce")
    ap.add_argument("--sizes", default="8,64K")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_main:
        return rank_main(ns)
    from collectives.launcher import launch

    cmd = [sys.executable, "-m", "collectives.bench.switch_cost", "--rank-main"]
    for opt in ("switch", "on", "off", "collective", "sizes", "iters", "rounds", "out"):
        value = getattr(ns, opt)
        if value is not None:
            cmd += [f"--{opt}", str(value)]
    return launch(cmd, ns.nprocs, transport=ns.transport, prefix=False, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
