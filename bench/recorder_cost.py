"""What the flight recorder costs: 8 B allreduce with the recorder off and on, in one run.

    python -m collectives.bench.recorder_cost [-n 2] [--transport shm] [--bytes 8]
        [--rounds 21] [--iters 20000] [--out f.json]
    collectives run -n 2 -m collectives.bench.recorder_cost [-- --rounds 21 --iters 20000]

Started by itself, it starts ``-n`` local ranks (default 2, shared memory);
started under a launcher, the process is one rank. Each rank opens two
communicators, one with ``COLLECTIVES_FLIGHT_RECORDER=0`` (off) and one
with the default ring (on), warms both up, then times ``--rounds`` rounds,
each a block of ``--iters`` back-to-back allreduces of ``--bytes`` bytes
on each communicator in turn (the order alternating between rounds), every
block starting from a barrier. Rank 0 prints the median time per call of
each (the slowest rank's), the difference, and the spread between rounds
(the difference between the medians of the even and of the odd rounds):
a difference smaller than the spread is noise.
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

__all__ = ["main", "measure"]

#: The ring the "on" communicator keeps (the default of COLLECTIVES_FLIGHT_RECORDER).
ON = "2000"


def _open(recorder: str, job: str, transport: str | None):
    import collectives

    previous = os.environ.get("COLLECTIVES_FLIGHT_RECORDER")
    os.environ["COLLECTIVES_FLIGHT_RECORDER"] = recorder  # read when the communicator is made
    try:
        return collectives.init(transport=transport or "auto", job=job, timeout=120)
    finally:
        if previous is None:
            os.environ.pop("COLLECTIVES_FLIGHT_RECORDER", None)
        else:
            os.environ["COLLECTIVES_FLIGHT_RECORDER"] = previous


def _block(comm, buf: np.ndarray, iters: int) -> float:
    """Seconds per call of ``iters`` allreduces, from a barrier's exit."""
    comm.barrier()
    allreduce = comm.allreduce
    t0 = time.perf_counter()
    for _ in range(iters):
        allreduce(buf)
    return (time.perf_counter() - t0) / iters


def measure(rounds: int = 21, iters: int = 20000, nbytes: int = 8, transport: str | None = None) -> dict | None:
    """Run on every rank of a job; returns the result on rank 0 (None elsewhere):
    ``off_us``, ``on_us`` (medians of the slowest rank's time per call),
    ``diff_us``, ``spread_us`` and every round's time."""
    job = os.environ.get("COLLECTIVES_JOB", "recorder-cost")
    comms = {"off": _open("0", job + "-off", transport), "on": _open(ON, job + "-on", transport)}
    if comms["off"]._recorder is not None or comms["on"]._recorder is None:
        raise RuntimeError("the recorder did not follow COLLECTIVES_FLIGHT_RECORDER")
    try:
        bufs = {k: np.ones(max(1, nbytes // 4), np.float32) for k in comms}
        for k, c in comms.items():
            _block(c, bufs[k], max(10, iters // 10))  # warm up: prepared calls, compiled calls
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
                mine = np.array([_block(comms[k], bufs[k], iters)])
                comms["off"].allreduce(mine, op="max")  # the slowest rank's
                times[k].append(float(mine[0]) * 1e6)
        rank, size, name = comms["on"].rank, comms["on"].size, comms["on"].transport.name
        recorded = len(comms["on"].flight_record())
    finally:
        for c in comms.values():
            c.close()
    if rank != 0:
        return None
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    halves = [statistics.median(t[i::2]) if t[i::2] else t[0] for t in times.values() for i in (0, 1)]
    spread = max(abs(halves[0] - halves[1]), abs(halves[2] - halves[3]))
    return {"ranks": size, "transport": name, "bytes": bufs["on"].nbytes, "rounds": rounds, "iters": iters,
            "off_us": off, "on_us": on, "diff_us": on - off, "spread_us": spread, "recorded": recorded,
            "off_all_us": times["off"], "on_all_us": times["on"]}


def report(res: dict) -> str:
    """The result in words (one line)."""
    return (f"{res['bytes']} B allreduce, {res['ranks']} ranks, {res['transport']}: recorder off "
            f"{res['off_us']:.3f} us, on {res['on_us']:.3f} us, on - off {res['diff_us']:+.3f} us, "
            f"spread {res['spread_us']:.3f} us ({res['rounds']} rounds x {res['iters']} calls, medians of "
            f"the slowest rank's time per call)")


def _rank_main(ns) -> int:
    res = measure(ns.rounds, ns.iters, ns.bytes, ns.transport)
    if res is not None:
        print(report(res), flush=True)
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump(res, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; starts the ranks unless run as one of them."""
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.recorder_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--transport", default=None, help="default: shm when it starts the ranks, else automatic")
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--timeout", type=float, default=600.0)
    ns = ap.parse_args(argv)
    from collectives.environment import detect_launch

    if detect_launch().launcher != "none":
        return _rank_main(ns)
    from collectives.launcher import launch

    cmd = [sys.executable, "-m", "collectives.bench.recorder_cost", "--bytes", str(ns.bytes),
           "--iters", str(ns.iters), "--rounds", str(ns.rounds)]
    if ns.out:
        cmd += ["--out", os.path.abspath(ns.out)]
    return launch(cmd, ns.nprocs, transport=ns.transport or "shm", prefix=False, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
