"""A campaign of injected faults on each transport, summed up in a table.

    python -m collectives.bench.fault_campaign [--transports shm,zmq,mpi] [--trials 10]
        [--scenarios kill,stop,raise,exit,abort,mismatch,refuse] [--ranks 2,4] [--out f.json]

Each trial starts P real processes (``mpiexec`` for MPI, the library's own
rank environment otherwise) that loop over collectives until one of them,
chosen at random, does what the scenario says at a random call: is killed
with SIGKILL, stops (SIGSTOP, resumed after the others gave up), raises,
calls ``sys.exit``, calls ``comm.abort``, makes a different call (a random
field changed) or passes a bad argument as a root. Per scenario and
transport it prints: trials, the outcomes of the ranks that did not cause
the fault (the expected error, or anything else), the time from the fault
to each survivor's error (best and worst), and leftovers (processes still
alive after the trial, this run's files left in /dev/shm: the library's,
and the segments MPI mapped in its ranks, which the trial then removes; a
killed MPICH job leaves those).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import defaultdict
from typing import Sequence

from .faults import remove_left

__all__ = ["main", "SCENARIOS"]

SCENARIOS = ("kill", "stop", "raise", "exit", "abort", "mismatch", "refuse")
#: What a survivor must raise in each scenario.
EXPECTED = {"kill": "PeerLost", "stop": "CollectiveTimeout", "raise": "PeerLost", "exit": "PeerLost",
            "abort": "PeerLost", "mismatch": "MismatchedCollective", "refuse": "BadArgument"}
COMM_TIMEOUT = 3.0


def _rank(ns) -> int:
    """One rank of one trial: loop, inject, report one JSON line."""
    import numpy as np

    import collectives
    from collectives import CollectiveError
    from collectives.bench.faults import Spec, call, mapped_shm_files

    comm = collectives.init(timeout=COMM_TIMEOUT)
    sys.stdout.write("@@shm" + json.dumps(mapped_shm_files()) + "\n")  # before any fault: MPI's segments
    sys.stdout.flush()
    rng = random.Random(ns.seed)
    victim, at = rng.randrange(comm.size), rng.randrange(2, 30)
    loop = [Spec("allreduce", count=8), Spec("allreduce", count=300_000), Spec("bcast", count=1000),
            Spec("allgather", count=64), Spec("reduce_scatter", count=4096), Spec("alltoall", count=16),
            Spec("barrier"), Spec("gather", count=5000), Spec("reduce", count=100, root=1 % comm.size)]
    me = comm.rank
    record = {"rank": me, "victim": victim, "pid": os.getpid()}
    fault_at = None
    try:
        for i in range(at + 20):
            spec = loop[i % len(loop)]
            if i == at and me == victim and ns.scenario != "refuse":
                fault_at = time.time()
                record["fault_at"] = fault_at
                if ns.scenario == "kill":
                    _emit(record)
                    os.kill(os.getpid(), signal.SIGKILL)
                elif ns.scenario == "stop":
                    _emit(record)
                    _resume_later(os.getpid(), COMM_TIMEOUT + 1.0)
                    os.kill(os.getpid(), signal.SIGSTOP)
                    return 0
                elif ns.scenario == "raise":
                    _emit(record)
                    raise RuntimeError("injected")
                elif ns.scenario == "exit":
                    _emit(record)
                    sys.exit(0)
                elif ns.scenario == "abort":
                    _emit(record)
                    comm.abort("the campaign's abort")
                    return 0
                elif ns.scenario == "mismatch":
                    field = rng.choice(["dtype", "count", "collective"])
                    spec = {"dtype": spec.with_(dtype="float64"), "count": spec.with_(count=spec.count + 1),
                            "collective": spec.with_(collective="allgather" if spec.collective != "allgather"
                                                     else "allreduce", count=max(spec.count, 1))}[field]
            if ns.scenario == "refuse" and i == at:  # the victim, as a gather's root, passes a short recvbuf
                t0 = time.time()
                recv = np.zeros(4 * comm.size - 1, np.float32) if me == victim else None
                try:
                    comm.gather(np.ones(4, np.float32), recv, victim)
                    outcome, message = "ok", ""
                except CollectiveError as exc:
                    outcome, message = type(exc).__name__, str(exc)
                _emit({**record, "outcome": outcome, "message": message[:300], "error_at": time.time(),
                       "started": t0})
                return 0
            got = call(comm, spec)
            if got["outcome"] != "ok":
                _emit({**record, "outcome": got["outcome"], "message": got["message"][:300],
                       "error_at": time.time(), "intact": got["intact"]})
                return 0
        _emit({**record, "outcome": "ok", "message": ""})
    finally:
        try:
            comm.close()
        except Exception:
            pass
    return 0


def _resume_later(pid: int, seconds: float) -> None:
    """A child that sends ``pid`` SIGCONT after ``seconds`` (once the others gave up on it)."""
    subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep({seconds}); "
                      f"os.kill({pid}, signal.SIGCONT)"], start_new_session=True)


def _emit(record: dict) -> None:
    sys.stdout.write("@@" + json.dumps(record) + "\n")
    sys.stdout.flush()


def _trial(transport: str, scenario: str, p: int, seed: int) -> dict:
    """Run one trial; every rank's records, and the leftovers."""
    from collectives.launcher import free_port, rank_environment

    job = f"fc{secrets.token_hex(4)}"
    args = [sys.executable, "-m", "collectives.bench.fault_campaign", "--rank", "--scenario", scenario,
            "--seed", str(seed)]
    procs = []
    deadline = time.monotonic() + 3 * COMM_TIMEOUT + 20
    if transport == "mpi":
        env = dict(os.environ, COLLECTIVES_TRANSPORT="mpi")
        procs.append(subprocess.Popen(["mpiexec", "-n", str(p)] + args, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, start_new_session=True))
    else:
        port, secret = free_port(), secrets.token_hex(8)
        for r in range(p):
            env = rank_environment(r, p, job=job, secret=secret, master_port=port, transport=transport)
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                          start_new_session=True))
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
        time.sleep(0.05)
    outs = []
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc)
        out, _ = proc.communicate()
        outs.append(out.decode(errors="replace"))
    lines = [line for out in outs for line in out.splitlines()]
    records = [json.loads(line[2:]) for line in lines if line.startswith("@@") and not line.startswith("@@shm")]
    mapped = [path for line in lines if line.startswith("@@shm") for path in json.loads(line[5:])]
    pids = {rec["pid"] for rec in records}
    _resume(pids)
    time.sleep(0.2)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shm = [n for n in _listdir("/dev/shm") if job in n]
    left = remove_left(path for path in mapped if job not in path)  # MPI's own segments, gone with the job
    return {"records": records, "alive": len(alive), "shm": len(shm) + left}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _resume(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _summarize(rows: dict) -> list[dict]:
    table = []
    for (transport, scenario, p), trials in sorted(rows.items()):
        want = EXPECTED[scenario]
        got, other, delays, alive, shm = 0, defaultdict(int), [], 0, 0
        for t in trials:
            alive += t["alive"]
            shm += t["shm"]
            recs = t["records"]
            victim = recs[0]["victim"] if recs else None
            fault = next((r.get("fault_at") for r in recs if r.get("fault_at")), None)
            survivors = [r for r in recs if r["rank"] != victim or scenario in ("mismatch", "refuse")]
            survivors = [r for r in survivors if "outcome" in r]
            missing = (p - 1 if scenario not in ("mismatch", "refuse") else p) - len(survivors)
            if missing > 0:
                other["no report"] += missing
            for r in survivors:
                if r["outcome"] == want:
                    got += 1
                else:
                    other[r["outcome"]] += 1
                start = fault or r.get("started")
                if start and r.get("error_at"):
                    delays.append(r["error_at"] - start)
        table.append({"transport": transport, "scenario": scenario, "ranks": p, "trials": len(trials),
                      "expected": want, "as_expected": got, "other": dict(other),
                      "best_s": min(delays) if delays else None, "worst_s": max(delays) if delays else None,
                      "processes_left": alive, "shm_left": shm})
    return table


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.fault_campaign",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", default="shm,zmq")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="kill", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank:
        return _rank(ns)
    rows: dict = defaultdict(list)
    for transport in ns.transports.split(","):
        for scenario in ns.scenarios.split(","):
            for p in (int(x) for x in ns.ranks.split(",")):
                for t in range(ns.trials):
                    rows[(transport, scenario, p)].append(_trial(transport, scenario, p, ns.seed * 1000 + t))
    table = _summarize(rows)
    print(f"{'transport':<9} {'scenario':<9} {'p':>2} {'trials':>6} {'expected':<21} {'as exp.':>7} "
          f"{'best s':>7} {'worst s':>7} {'procs left':>10} {'shm left':>8}  other")
    for row in table:
        best = f"{row['best_s']:.3f}" if row["best_s"] is not None else "-"
        worst = f"{row['worst_s']:.3f}" if row["worst_s"] is not None else "-"
        print(f"{row['transport']:<9} {row['scenario']:<9} {row['ranks']:>2} {row['trials']:>6} "
              f"{row['expected']:<21} {row['as_expected']:>7} {best:>7} {worst:>7} {row['processes_left']:>10} "
              f"{row['shm_left']:>8}  {row['other'] or ''}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
