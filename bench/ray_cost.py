"""What a collective costs among Ray actors, against the same collective under
``collectives run``, in one run.

Both sides time the same way (:func:`collectives.bench.sweep.measure`: warm
up, then each iteration's maximum over ranks; the median is reported) on
the same transport (shared memory); only the processes differ: ranks that
``collectives run`` starts (bound to cores when they outnumber them), or
Ray actors in a group formed by
:func:`collectives.integrations.ray.create_collective_group`, once where
Ray placed them (unbound) and once bound to a core each (actor i on core i,
round robin, for that pass only). The sides take turns ``--repeat`` times
while one Ray instance runs, so that all see the same background; each
size's median pass is reported. It also reports what
forming the group costs. Needs Ray (``pip install 'collectives[ray]'``)::

    python -m collectives.bench.ray_cost --sizes 8,64K,1M,16M --ranks 2,3

Under ``--rank-side`` it is one rank of the launcher's side (started by this
module through ``collectives run``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

from collectives.launcher import launch, rank_cpus

from .cli import parse_sizes
from .peers import OursRunner
from .sweep import measure

__all__ = ["main", "launcher_rows", "RayGroup", "ray_and_launcher", "cost_table"]

DEFAULT_SIZES = "8,64K,1M,16M"
#: the launcher's ranks; Ray actors where Ray put them; Ray actors bound to a core each
SIDES = ("launcher", "ray", "ray_bound")


class _CommRunner(OursRunner):
    """The sweep's runner over a communicator that already exists (a Ray group's)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.transport = comm.transport.name
        self.alloc = False


def _measure_all(runner: Any, collective: str, sizes: Sequence[int], iters: int, warmup: int) -> list[dict]:
    return [measure(runner, collective, "auto", size, iters=iters, warmup=warmup) for size in sizes]


# ------------------------------------------------------------ the launcher


def _rank_side(ns: argparse.Namespace) -> int:
    """One rank under ``collectives run``: time every size; rank 0 writes the rows."""
    runner = OursRunner("shm")
    try:
        rows = _measure_all(runner, ns.collective, parse_sizes(ns.sizes), ns.iters, ns.warmup)
    finally:
        runner.close()
    if runner.rank == 0:
        with open(ns.out, "w") as f:
            json.dump(rows, f)
    return 0


def launcher_rows(p: int, ns: argparse.Namespace) -> tuple[list[dict], float]:
    """The rows of ``p`` ranks under ``collectives run``, and the job's wall time in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "collectives.bench.ray_cost", "--rank-side", "--out", out,
               "--collective", ns.collective, "--sizes", ns.sizes, "--iters", str(ns.iters),
               "--warmup", str(ns.warmup)]
        t0 = time.perf_counter()
        status = launch(cmd, p, transport="shm", prefix=False, timeout=ns.timeout)
        wall = time.perf_counter() - t0
        if status != 0 or not os.path.exists(out):
            raise SystemExit(f"ray_cost: the launcher's {p} ranks failed (status {status})")
        with open(out) as f:
            return json.load(f), wall


# ------------------------------------------------------------------ Ray


def _actor_side(actor_self: Any, group: str, collective: str, sizes: list[int], iters: int, warmup: int,
                cpus: list[set[int]] | None) -> list[dict]:
    """Run on each actor (``__ray_call__``): time every size, bound to
    ``cpus[rank]`` for the pass when given (then unbound again)."""
    from collectives.integrations import ray as cray

    comm = cray.get_communicator(group)
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus[comm.rank])
    try:
        return _measure_all(_CommRunner(comm), collective, sizes, iters, warmup)
    finally:
        os.sched_setaffinity(0, before)


class RayGroup:
    """``p`` Ray actors in one group, kept for the repeats of a world size."""

    def __init__(self, p: int, timeout: float) -> None:
        import ray

        from collectives.integrations import ray as cray

        @ray.remote(num_cpus=0)
        class BenchActor:
            def ready(self) -> bool:
                return True

        self.p, self.timeout, self.group = p, timeout, f"ray_cost_{p}"
        t0 = time.perf_counter()
        self.actors = [BenchActor.remote() for _ in range(p)]
        ray.get([a.ready.remote() for a in self.actors], timeout=timeout)
        t1 = time.perf_counter()
        cray.create_collective_group(self.actors, group_name=self.group, timeout=60)
        #: seconds to start the actors, and to form the group among them
        self.setup = {"actors_s": t1 - t0, "group_s": time.perf_counter() - t1}

    def rows(self, ns: argparse.Namespace, bound: bool) -> list[dict]:
        """Rank 0's rows of one pass over the sizes; ``bound``: actor i on core i (round robin)."""
        import ray

        cpus = rank_cpus(self.p, "core") if bound else None
        return ray.get([a.__ray_call__.remote(_actor_side, self.group, ns.collective, parse_sizes(ns.sizes),
                                              ns.iters, ns.warmup, cpus) for a in self.actors],
                       timeout=self.timeout)[0]

    def close(self) -> None:
        import ray

        from collectives.integrations import ray as cray

        cray.destroy_collective_group(self.group)
        for a in self.actors:
            ray.kill(a)


def _median_rows(passes: list[list[dict]]) -> list[dict]:
    """Each size's row of the pass with the median time (steadier on a busy machine)."""
    out = []
    for rows in zip(*passes):
        ordered = sorted(rows, key=lambda r: r["time_us"])
        out.append(ordered[len(ordered) // 2])
    return out


def ray_and_launcher(p: int, ns: argparse.Namespace) -> dict[str, Any]:
    """Every side for ``p`` ranks (the launcher's, Ray actors as placed,
    Ray actors bound), in turn ``ns.repeat`` times while the same Ray
    instance runs, so that all see the same background."""
    group = RayGroup(p, ns.timeout)
    passes: dict[str, list] = {side: [] for side in SIDES}
    job_s = []
    try:
        for _ in range(ns.repeat):
            rows, wall = launcher_rows(p, ns)
            passes["launcher"].append(rows)
            job_s.append(wall)
            passes["ray"].append(group.rows(ns, bound=False))
            passes["ray_bound"].append(group.rows(ns, bound=True))
    finally:
        group.close()
    return {"p": p, **{side: _median_rows(rows) for side, rows in passes.items()},
            "launcher_job_s": sorted(job_s)[len(job_s) // 2], **group.setup}


# ---------------------------------------------------------------- report


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def cost_table(results: list[dict[str, Any]], collective: str) -> str:
    """One line per (ranks, size): the median time of each side, and each Ray side's ratio to the launcher."""
    lines = [f"# {collective}, float32 sum, shared memory; median over iterations of the slowest rank, in us",
             f"# {'ranks':>5} {'size':>9} {'launcher':>10} {'Ray actors':>11} {'ratio':>6} "
             f"{'Ray, bound':>11} {'ratio':>6}"]
    for res in results:
        for ours, ray_, bound in zip(res["launcher"], res["ray"], res["ray_bound"]):
            base = ours["time_us"]
            lines.append(f"  {res['p']:>5} {_size(ours['size']):>9} {base:>10.2f} {ray_['time_us']:>11.2f} "
                         f"{ray_['time_us'] / base:>6.2f} {bound['time_us']:>11.2f} {bound['time_us'] / base:>6.2f}")
    lines += ["", "# setup: a whole launcher job (start to exit, every size), starting the actors, forming their group",
              f"# {'ranks':>5} {'launcher job (s)':>17} {'actors started (s)':>19} {'group formed (s)':>17}"]
    for res in results:
        lines.append(f"  {res['p']:>5} {res['launcher_job_s']:>17.2f} {res['actors_s']:>19.2f} "
                     f"{res['group_s']:>17.2f}")
    return "\n".join(lines)


def _wrong(results: list[dict[str, Any]]) -> int:
    return sum(r["wrong"] for res in results for side in SIDES for r in res[side])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.ray_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--collective", default="allreduce", help="default: allreduce")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per rank, e.g. 8,64K,1M (default {DEFAULT_SIZES})")
    ap.add_argument("--ranks", default="2,3", help="comma list of world sizes (default 2,3)")
    ap.add_argument("--iters", type=int, default=100, help="timed iterations (fewer above 64 KiB)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5,
                    help="alternate the two sides this many times; each size's median pass is reported")
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each side may take")
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap


def _start_ray(address: str | None) -> None:
    try:
        import ray
    except ImportError:
        raise SystemExit("ray_cost needs Ray: pip install 'collectives[ray]'") from None
    if address is None:  # a local instance: its own traffic stays on the loopback interface
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="error")
    else:
        ray.init(address=address, log_to_driver=False, logging_level="error")


def main(argv: Sequence[str] | None = None) -> int:
    """Run both sides for every world size; print the table (status 3 if a result was wrong)."""
    ns = _parser().parse_args(argv)
    if ns.rank_side:
        return _rank_side(ns)
    _start_ray(ns.address)
    results = []
    for p in (int(x) for x in ns.ranks.split(",")):
        print(f"# {p} ranks: launcher, Ray actors, Ray actors bound; {ns.repeat} turns", file=sys.stderr, flush=True)
        results.append(ray_and_launcher(p, ns))
    print(cost_table(results, ns.collective))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"collective": ns.collective, "results": results}, f, indent=1)
    if _wrong(results):
        print("ray_cost: some results were wrong (see the JSON rows' 'wrong')", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
