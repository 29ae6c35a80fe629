"""Predicted versus measured time per algorithm on a live transport, and the regret of selection.

    python -m collectives.bench.model_validation [-n P] [--transport shm] [--sizes 8,64K,1M]
        [--collectives allreduce,bcast] [--repeats 5] [--passes 2] [--out results.json]

starts P local ranks; every rank runs every algorithm the transport offers
for each collective and size (best of ``--repeats`` after a warm-up, the
slowest rank's time, the algorithms taking turns; the best of ``--passes``
whole sweeps), rank 0 predicts it with the transport's calibration
profile (``collectives calibrate`` first; defaults otherwise), and prints per
algorithm |predicted - measured| / measured, and per (collective, size) the
regret (time of the chosen algorithm over the best measured one) of what
``auto`` runs in the job (rank 0's profile, else the rule: see
:mod:`collectives.cost_models.agreed`), of :class:`ModelSelector`, of the library's rule
(:class:`~collectives.selection.RuleSelector`, which takes the shared window
where there is one) and of MPICH's fixed rules (the same rule without the
window: the algorithms MPICH chooses among). It also prints the
measurement's own noise as a regret: the algorithm measured best in half of
the rounds, judged on the other half; no choice made before the
measurement can be expected to do much better. Writes JSON with ``--out``;
``--summarize a.json b.json ...`` prints the figures over several runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import replace
from typing import Sequence

import numpy as np

__all__ = ["main"]

DEFAULT_COLLECTIVES = ("bcast", "scatter", "gather", "allgather", "reduce", "allreduce", "reduce_scatter", "alltoall")


def _measure(comm, call, algos: list[str], repeats: int) -> tuple[dict, dict, dict]:
    """Per algorithm, the best of ``repeats`` (two at least) of the slowest
    rank's time, the algorithms taking turns (see
    :func:`~collectives.cost_models.timing.timed_rounds`); and the best of
    the even rounds and of the odd ones apart."""
    from collectives.cost_models.timing import timed_rounds

    times = timed_rounds(comm, {a: functools.partial(call, a) for a in algos}, max(2, repeats))
    best = {a: min(t) for a, t in times.items()}
    return best, {a: min(t[0::2]) for a, t in times.items()}, {a: min(t[1::2]) for a, t in times.items()}


def rank_main(ns) -> int:
    import collectives
    from collectives.cost_models import predict
    from collectives.arithmetic import parse_bytes
    from collectives.cost_models.profile import host_cores, load_profile
    from collectives.cost_models.selector import ModelSelector
    from collectives.cost_models.timing import collective_call
    from collectives.registry import algorithms_for
    from collectives.selection import RuleSelector

    comm = collectives.init()
    caps = frozenset(comm.transport.capabilities)
    params = load_profile(comm.transport.name)
    if not params.cores:  # every rank of this job runs on this host
        params = replace(params, cores=comm.transport.cores or host_cores())
    dtype = np.dtype(np.float32)
    points = []  # (collective, nbytes, call, algorithms)
    for collective in ns.collectives.split(","):
        for size in (parse_bytes(s) for s in ns.sizes.split(",")):
            count = max(size // dtype.itemsize, comm.size)
            count -= count % comm.size
            algos = [name for name, algo in algorithms_for(collective).items()
                     if algo.needs <= caps and name != "native"]
            call = collective_call(comm, collective, count, dtype)
            points.append((collective, count * dtype.itemsize, call, algos))
    found: list[list[dict]] = [[{}, {}, {}] for _ in points]  # best, even rounds, odd rounds
    for _ in range(ns.passes):  # whole sweeps, so that a slow spell of the machine spares some pass
        for (collective, nbytes, call, algos), bests in zip(points, found):
            for got, into in zip(_measure(comm, call, algos, ns.repeats), bests):
                for name, t in got.items():
                    into[name] = min(into.get(name, t), t)
    rows, regrets = [], []
    model_sel, rule_sel, mpich_sel = ModelSelector(params), RuleSelector(), RuleSelector()
    for (collective, nbytes, _, _), (measured, even, odd) in zip(points, found):
        for name, t in measured.items():
            pred = predict(collective, name, comm.size, nbytes, params, dtype)
            rows.append({"collective": collective, "algorithm": name, "bytes": nbytes, "p": comm.size,
                         "measured": t, "predicted": pred, "rel_error": abs(pred - t) / t})
        best = min(measured.values())
        picks = {"auto": comm.selector.choose(collective, nbytes, comm.size, dtype, caps),
                 "model": model_sel.choose(collective, nbytes, comm.size, dtype, caps),
                 "rule": rule_sel.choose(collective, nbytes, comm.size, dtype, caps),
                 "mpich": mpich_sel.choose(collective, nbytes, comm.size, dtype, caps - {"window"})}
        noise = min(even, key=even.get)
        regrets.append({"collective": collective, "bytes": nbytes, "p": comm.size,
                        **{f"{k}_choice": v for k, v in picks.items()},
                        **{f"{k}_regret": measured[v] / best - 1 for k, v in picks.items()},
                        "noise_choice": noise, "noise_regret": odd[noise] / min(odd.values()) - 1})
    transport = comm.transport.name
    comm.close()
    if comm.rank != 0:
        return 0
    print(f"{'collective':15s} {'algorithm':38s} {'bytes':>9s} {'measured us':>12s} {'predicted us':>12s} {'err':>6s}")
    for r in rows:
        print(f"{r['collective']:15s} {r['algorithm']:38s} {r['bytes']:9d} {r['measured'] * 1e6:12.1f} "
              f"{r['predicted'] * 1e6:12.1f} {r['rel_error']:6.0%}")
    med = statistics.median(r["rel_error"] for r in rows)
    print(f"\n{transport}, p={rows[0]['p'] if rows else '?'}, profile: {params.source}")
    _print_summary(rows, regrets)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"transport": transport, "profile": params.as_dict(), "rows": rows, "regrets": regrets,
                       "median_rel_error": med}, f, indent=2)
    return 0


def _print_summary(rows: list[dict], regrets: list[dict]) -> None:
    errors = sorted(r["rel_error"] for r in rows)
    print(f"median |predicted - measured| / measured: {statistics.median(errors):.1%} "
          f"({len(errors)} points)")
    for who, what in (("auto", "what auto runs (the job's agreed selector)"), ("model", "the model's choice"),
                      ("rule", "the rule's choice"),
                      ("mpich", "MPICH's rules' choice"),
                      ("noise", "the best of half the rounds, judged on the other half (noise)")):
        reg = sorted(g[f"{who}_regret"] for g in regrets if f"{who}_regret" in g)
        if reg:
            p95 = reg[min(len(reg) - 1, int(0.95 * len(reg)))]
            print(f"regret of {what}: median {statistics.median(reg):.1%}, p95 {p95:.1%}, "
                  f"mean {statistics.fmean(reg):.1%}, max {reg[-1]:.1%} ({len(reg)} choices)")


def summarize(paths: Sequence[str]) -> int:
    """Print the figures over the runs written to ``paths`` (``--out`` files)."""
    rows, regrets = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        regrets += data["regrets"]
    print(f"{len(paths)} runs, p in {sorted({r['p'] for r in rows})}")
    _print_summary(rows, regrets)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; starts the ranks unless run as one of them."""
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.model_validation", description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=4)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--sizes", default="8,4K,64K,1M")
    ap.add_argument("--collectives", default=",".join(DEFAULT_COLLECTIVES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--passes", type=int, default=2, help="sweeps over every point; each point's best counts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                    help="print the figures over earlier --out files and exit")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.summarize:
        return summarize(ns.summarize)
    if ns.rank_main:
        return rank_main(ns)
    from collectives.launcher import launch

    cmd = [sys.executable, "-m", "collectives.bench.model_validation", "--rank-main", "--sizes", ns.sizes,
           "--collectives", ns.collectives, "--repeats", str(ns.repeats), "--passes", str(ns.passes)]
    cmd += ["--out", ns.out] if ns.out else []
    return launch(cmd, ns.nprocs, transport=ns.transport, prefix=False, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
