"""``collectives calibrate``: measure alpha, beta, gamma and memory bandwidth.

    collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick] [--stretch-ranks LIST]

starts P local ranks (``mpiexec`` for ``--transport mpi``) and measures, in
order: a ping-pong sweep fitted to ``alpha + n beta`` (piecewise where the
transport changes protocol), the exchange factor, gamma per dtype, the
copy bandwidth and the fence, the per-message overhead and per-call cost,
every algorithm's anchors, and the stretch table at further rank counts.
docs/cost-models.md ("Calibration") says what each step measures and how
it is fitted. The profile is saved where :func:`~.profile.profile_path`
says. What the ranks measure is :mod:`.calibration_measurements`, the fits
:mod:`.calibration_fits`; this module is the command and the jobs it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from collectives.arithmetic import show_bytes

from .calibration_fits import fit_exchange, fit_overheads, fit_piecewise, fit_stretch
from .calibration_measurements import (EXCHANGE_BYTES, SWEEP_BYTES, LatencyLog, best_time, exchange,
                                       measure_copy_bandwidth, measure_gamma, measure_probes, pingpong,
                                       rank_count_measurements, window_fence)
from .digests import anchor_digests
from .model import Params
from .profile import DEFAULTS, GENERIC, host_cores, profile_path, save_profile, unsteady

__all__ = ["main", "rank_main", "stretch_main", "add_stretch", "default_stretch_ranks"]


def rank_main(out: str | None, quick: bool) -> int:
    """What every rank of the calibration job runs."""
    import collectives

    comm = collectives.init()
    latency = LatencyLog(comm)
    step = _progress(comm.rank, 5, latency)
    sizes = SWEEP_BYTES[:8] if quick else SWEEP_BYTES
    step(f"ping-pong, {show_bytes(sizes[0])} to {show_bytes(sizes[-1])} (alpha, beta)")
    times = pingpong(comm, sizes, quick) if comm.size > 1 else []
    step("both ways at once (exchange)")
    exchanges = exchange(comm, EXCHANGE_BYTES, quick) if comm.size > 1 else []
    comm.barrier()
    step("fence")
    fence = window_fence(comm, 20 if quick else 50)
    if fence is None:
        fence = best_time(comm.barrier, 5 if quick else 50)
    step("small collectives (overhead per message, cost per call)")
    probes = measure_probes(comm, 3 if quick else 20) if comm.size > 1 else []
    step("every algorithm at its anchor sizes")
    extra, anchors = rank_count_measurements(comm, quick) if comm.size > 1 else ([], [])
    latency.probe("at the end")
    name, p, cores = comm.transport.name, comm.size, comm.transport.cores or host_cores()
    cma_from = int(getattr(comm.transport, "cma_from", 0))
    comm.close()
    if comm.rank != 0:
        return 0
    fit = fit_piecewise(sizes, times) if times else {"alpha": DEFAULTS.get(name, GENERIC).alpha,
                                                     "beta": DEFAULTS.get(name, GENERIC).beta,
                                                     "protocol": [], "error": 0.0}
    gammas = measure_gamma(1 << 20 if quick else 4 << 20)
    params = Params(alpha=fit["alpha"], beta=fit["beta"], gamma=gammas.get("float32", GENERIC.gamma),
                    gamma_by_dtype=gammas, mem_bandwidth=measure_copy_bandwidth(16 << 20 if quick else 64 << 20),
                    fence=fence, protocol=tuple(tuple(t) for t in fit["protocol"]))
    params = replace(params, exchange=fit_exchange(EXCHANGE_BYTES, exchanges, params))
    overhead, call = fit_overheads(probes, params, p)
    params = replace(params, overhead=overhead, call=call, cores=cores if name == "shm" else 0,
                     cma_from=cma_from if name == "shm" else 0)
    if p > 1:
        params = replace(params, stretch=((p, *fit_stretch(probes + extra, params, p)),),
                         anchors=tuple(anchors))
    path = Path(out) if out else profile_path(name)
    data = {**params.as_dict(), "transport": name, "host": socket.gethostname(), "ranks": comm.size,
            "fit_error": fit["error"], "sweep": {"bytes": list(sizes), "seconds": times},
            "probes": [list(t) for t in probes + extra], "latency_probes": latency.rows,
            "anchor_digests": anchor_digests(params.anchors),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    data.pop("source", None)
    save_profile(path, data)
    print(f"{name}: a message {params.messages()}, gamma(float32)={params.gamma * 1e9:.3f} ns/B, "
          f"copy {params.mem_bandwidth / 1e9:.2f} GB/s, fence {fence * 1e6:.2f} us, "
          f"exchange x{params.exchange:.2f}, "
          f"overhead {overhead * 1e6:.2f} us/msg, call {call * 1e6:.2f} us, "
          f"{len(params.protocol) + 1} piece(s), fit error {fit['error']:.1%}\nprofile: {path}")
    return 0



def _progress(rank: int, steps: int, latency: LatencyLog):
    """``step(what)``: rank 0 says on stderr which of ``steps`` measurements
    starts, after a ``latency`` probe."""
    done = [0]

    def step(what: str) -> None:
        done[0] += 1
        latency.probe(f"before step {done[0]} of {steps}")
        if rank == 0:
            print(f"calibrate: [{done[0]}/{steps}] {what}", file=sys.stderr, flush=True)
    return step


#: The sizes and collectives the closing reading shows auto's choices for.
READING_BYTES = (8, 64 << 10, 16 << 20)
READING_COLLECTIVES = ("allreduce", "bcast", "reduce", "allgather", "reduce_scatter", "alltoall")


def reading(path: Path, transport: str, p: int) -> str:
    """A few lines on what the profile at ``path`` says: a message's cost,
    and what ``auto`` now runs at ``p`` ranks where the rule would run another."""
    import numpy as np

    from collectives.selection import RuleSelector

    from .explain import transport_capabilities
    from .profile import load_profile
    from .selector import ModelSelector

    params = load_profile(transport, path)
    caps = transport_capabilities(transport)
    model, rule = ModelSelector(params, transport), RuleSelector()
    lines = [f"reading: a message costs {params.messages()}; reducing float32 {params.gamma * 1e9:.3f} ns/B; "
             f"a fence {params.fence * 1e6:.2f} us",
             f"auto now follows these models on {transport} (in a job, rank 0's profile); at {p} ranks:"]
    f32 = np.dtype(np.float32)
    for c in READING_COLLECTIVES:
        picks = []
        for n in READING_BYTES:
            m, r = model.choose(c, n, p, f32, caps), rule.choose(c, n, p, f32, caps)
            picks.append(f"{show_bytes(n)} {m}" + ("" if m == r else f" (the rule: {r})"))
        lines.append(f"  {c}: " + ", ".join(picks))
    return "\n".join(lines)


def stretch_main(out: str, quick: bool) -> int:
    """What every rank of a stretch job runs: the probes at this rank count;
    rank 0 writes them to ``out`` (JSON)."""
    import collectives

    comm = collectives.init()
    latency = LatencyLog(comm)
    latency.probe("at the start")
    probes = measure_probes(comm, 3 if quick else 10)
    extra, anchors = rank_count_measurements(comm, quick)
    probes += extra
    latency.probe("at the end")
    comm.close()
    if comm.rank == 0:
        Path(out).write_text(json.dumps({"probes": probes, "anchors": anchors, "latency_probes": latency.rows}))
    return 0


#: The status of a job stopped at ``--timeout`` (the launcher's, and ``mpiexec`` run here).
TIMED_OUT = 124


def _ran(launch_job, p: int, out: str, tries: int) -> bool:
    """Run a stretch job until it succeeds, at most ``tries`` times (one
    failed start, such as a rendezvous that timed out, should not cost a
    rank count its factors); a job stopped at ``--timeout`` is not run
    again, since it would only run as long once more."""
    for attempt in range(tries):
        status = launch_job(p, out)
        if status == 0 and os.path.exists(out):
            return True
        if status == TIMED_OUT:
            print(f"calibrate: the {p}-rank stretch job ran past --timeout and is not run again "
                  "(a slow or busy host needs a longer --timeout)", file=sys.stderr)
            return False
        if attempt + 1 < tries:
            print(f"calibrate: the {p}-rank stretch job failed; trying again", file=sys.stderr)
    return False


def add_stretch(path: Path, ranks: Sequence[int], launch_job) -> None:
    """Measure the probes at each rank count of ``ranks`` (``launch_job(p,
    out) -> status`` runs one stretch job) and add the fitted factors to the
    profile at ``path``."""
    data = json.loads(path.read_text())
    params = Params.from_dict(data)
    table = {int(t[0]): tuple(t[1:]) for t in params.stretch}
    anchors = [t for t in data.get("anchors", ()) if int(t[2]) not in ranks]
    latency = [t for t in data.get("latency_probes", ()) if int(t[0]) not in ranks]
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(ranks):
            print(f"calibrate: stretch job {i + 1} of {len(ranks)}, at {p} ranks", file=sys.stderr, flush=True)
            out = os.path.join(tmp, f"probes-{p}.json")
            if not _ran(launch_job, p, out, tries=2):
                print(f"calibrate: no factors for {p} ranks", file=sys.stderr)
                continue
            job = json.loads(Path(out).read_text())
            probes = [tuple(t) for t in job["probes"]]
            table[p] = fit_stretch(probes, replace(params, stretch=(), anchors=()), p)
            anchors += job["anchors"]
            latency += job.get("latency_probes", [])
    data["stretch"] = [[p, *table[p]] for p in sorted(table)]
    data["anchors"] = anchors
    data["anchor_digests"] = anchor_digests(anchors)  # measured by this code, as the main job's
    data["latency_probes"] = latency
    save_profile(path, data)
    print("stretch (ranks: message latency x, message bytes x, fence x, local x): "
          + ", ".join(f"{p}: {a:.2f}, {b:.2f}, {f:.2f}, {c:.2f}" for p, (a, b, f, c) in sorted(table.items())))


def default_stretch_ranks(transport: str, nprocs: int) -> list[int]:
    """Rank counts measured for the stretch table: on shared memory every
    count above the main job's up to 8 (or 4 per core), elsewhere none."""
    if transport != "shm":
        return []
    return list(range(nprocs + 1, max(8, 4 * host_cores()) + 1))


def main(argv: Sequence[str] | None = None) -> int:
    """``collectives calibrate [--transport NAME] [-n P] [--out PATH] [--quick]``."""
    ap = argparse.ArgumentParser(prog="collectives calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", help="transport to calibrate (default: shm)")
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2; ranks 0 and 1 ping-pong)")
    ap.add_argument("--out", default=None, help="profile path (default: the user cache directory)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--timeout", type=float, default=300.0, help="stop after this many seconds")
    ap.add_argument("--stretch-ranks", default=None,
                    help="comma list of rank counts whose stretch factors are measured "
                         "(default on shm: every count above -n up to 8; 'none' to skip)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stretch-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank_main:
        return rank_main(ns.out, ns.quick)
    if ns.stretch_main:
        return stretch_main(ns.out, ns.quick)
    module = [sys.executable, "-m", "collectives.cost_models.calibrate"]
    flags = ["--quick"] if ns.quick else []

    def run_job(p: int, mode: str, out: str | None) -> int:
        cmd = [*module, mode, *(["--out", out] if out else []), *flags]
        if ns.transport == "mpi":
            try:
                return subprocess.run(["mpiexec", "-n", str(p), *cmd], timeout=ns.timeout).returncode
            except subprocess.TimeoutExpired:
                return TIMED_OUT
        from collectives.launcher import launch

        return launch(cmd, p, transport=ns.transport, prefix=False, timeout=ns.timeout)

    status = run_job(ns.nprocs, "--rank-main", ns.out)
    if ns.stretch_ranks is None:
        ranks = default_stretch_ranks(ns.transport, ns.nprocs)
    elif ns.stretch_ranks.strip().lower() in ("", "none"):
        ranks = []
    else:
        ranks = [int(x) for x in ns.stretch_ranks.split(",") if x.strip()]
    path = Path(ns.out) if ns.out else profile_path(ns.transport)
    if status == 0 and ranks:
        add_stretch(path, ranks, lambda p, out: run_job(p, "--stretch-main", out))
    if status == 0 and path.is_file():
        print(reading(path, ns.transport, ns.nprocs))
        note = unsteady(json.loads(path.read_text()))
        if note:
            print(f"calibrate: this profile was {note}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
