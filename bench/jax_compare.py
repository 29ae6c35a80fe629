"""The in-jit gradient allreduce against mpi4jax, on CPU: ``python -m collectives.bench.jax_compare``.

Both sides run jitted functions on a float32 array, summed over the ranks,
for two kinds of operand (``--operands``):

* ``computed``: ``jax.jit(lambda x: allreduce(x * 2))``, a value computed in
  the function, as a gradient is: XLA may give its buffer up, and ours
  works on it in place;
* ``argument``: ``jax.jit(lambda x: allreduce(x))``, the function's own
  argument, which the caller keeps: XLA copies it into a fresh buffer
  for ours to work on (mpi4jax writes a fresh output either way).

The two libraries:

* ours: :func:`collectives.integrations.jax.allreduce_tree_in_jit` (an XLA
  FFI call into this library, shared memory; an ordered ``io_callback``
  with ``COLLECTIVES_JAX_FFI=0``), ranks started by ``collectives run``;
* mpi4jax: ``mpi4jax.allreduce(x, op=MPI.SUM)`` (an XLA custom call into
  MPI_Allreduce; MPICH, the ``mpich`` wheel), ranks started by ``mpiexec``.

Each side times every size and operand like the bench does (warm-up, a
barrier, calls timed one by one up to ``block_until_ready``, each call's
maximum over ranks, then the median), checks the result, and its job
writes the rows. ``--rounds R`` runs the two jobs R times, alternating
which goes first; the table gives per operand and size each side's median
over rounds [min-max] and the ratio ours / mpi4jax (below 1: ours is
faster). mpi4jax is optional (``pip install mpi4jax``, or the
``mpi4jax`` extra); without it only our side runs and the reason is
said.

::

    python -m collectives.bench.jax_compare                      # 2 ranks, 8 B to 64 MiB (x8), 3 rounds, both operands
    python -m collectives.bench.jax_compare -n 2 --sizes 8,1K,1M,64M --operands computed --rounds 5 --json j.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

__all__ = ["mpi4jax_available", "main", "OPERANDS"]

#: The operand kinds: what each jitted function allreduces, given its argument ``x``.
OPERANDS = {"computed": lambda x: x * 2, "argument": lambda x: x}
#: Each kind's factor on the summed inputs.
_FACTOR = {"computed": 2, "argument": 1}


def mpi4jax_available() -> tuple[bool, str]:
    """(True, version) when mpi4jax imports here, else (False, why)."""
    code = "import mpi4jax; print(mpi4jax.__version__)"
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env=_env())
    except subprocess.TimeoutExpired:
        return False, "import mpi4jax took over 120 s"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"mpi4jax does not import ({last}); pip install mpi4jax"
    return True, res.stdout.strip()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLECTIVES_", "PMI_")) or k == "COLLECTIVES_JAX_FFI"}  # that one chooses our path
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


# -- one rank -------------------------------------------------------------------------------------


def _iterations(nbytes: int, iters: int) -> tuple[int, int]:
    from .sweep import iterations

    return iterations(nbytes, iters, max(iters // 10, 2))


def _rank_main(side: str, sizes: list[int], operands: list[str], iters: int, out: str) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    if side == "ours":
        import collectives
        from collectives.integrations.jax import allreduce_tree_in_jit

        comm = collectives.init(timeout=120)
        rank, size = comm.rank, comm.size

        def reduce_max(a: np.ndarray) -> np.ndarray:
            comm.allreduce(a, "max")
            return a

        barrier, close = comm.barrier, comm.close

        def call(x: Any) -> Any:
            return allreduce_tree_in_jit(x, comm, op="sum")
        version = collectives.__version__ if hasattr(collectives, "__version__") else "?"
        what = f"collectives {version}, allreduce_tree_in_jit, transport {comm.transport.name}"
    else:
        import mpi4jax
        from mpi4py import MPI

        from .openmpi import mpi_name

        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()

        def reduce_max(a: np.ndarray) -> np.ndarray:
            world.Allreduce(MPI.IN_PLACE, a, MPI.MAX)
            return a

        def close() -> None:
            pass

        barrier = world.Barrier

        def call(x: Any) -> Any:
            got = mpi4jax.allreduce(x, op=MPI.SUM, comm=world)
            return got[0] if isinstance(got, tuple) else got  # before 0.6: (result, token)

        what = f"mpi4jax {mpi4jax.__version__}, {mpi_name(MPI.Get_library_version())}"
    rows = []
    clock = time.perf_counter

    def jitted(operand: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return jax.jit(lambda x: call(operand(x)))

    fns = {kind: jitted(OPERANDS[kind]) for kind in operands}
    for nbytes, kind in ((nbytes, kind) for nbytes in sizes for kind in operands):
        fn = fns[kind]
        count = max(nbytes // 4, 1)
        x = jnp.asarray(((np.arange(count) + 3 * rank) % 7 + 1).astype(np.float32))
        want = _FACTOR[kind] * sum(((np.arange(count) + 3 * r) % 7 + 1).astype(np.float32) for r in range(size))
        n_iter, n_warm = _iterations(count * 4, iters)
        for _ in range(n_warm):
            fn(x).block_until_ready()
        barrier()
        times = np.empty(n_iter)
        for i in range(n_iter):
            t0 = clock()
            fn(x).block_until_ready()
            times[i] = clock() - t0
        times = reduce_max(times)
        wrong = np.array([float(np.count_nonzero(np.asarray(fn(x)) != want))])
        wrong = reduce_max(wrong)
        rows.append({"side": side, "operand": kind, "size": count * 4, "iters": n_iter,
                     "time_us": float(np.median(times)) * 1e6, "time_us_p99": float(np.percentile(times, 99)) * 1e6,
                     "time_us_min": float(times.min()) * 1e6, "wrong": int(wrong[0])})
        if rank == 0 and sys.stderr.isatty():
            print(f"\r  {side} {kind} {count * 4} B: {rows[-1]['time_us']:.2f} us".ljust(60), end="", file=sys.stderr,
                  flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"side": side, "what": what, "p": size, "jax": jax.__version__, "rows": rows}, f)
    close()
    return 0


# -- the launcher ---------------------------------------------------------------------------------


def _run_side(side: str, n: int, sizes: list[int], operands: list[str], iters: int, tmp: str,
              timeout: float) -> dict | None:
    out = os.path.join(tmp, f"{side}.json")
    if os.path.exists(out):
        os.unlink(out)
    argv = [sys.executable, "-m", "collectives.bench.jax_compare", "--rank-side", side, "--sizes",
            ",".join(map(str, sizes)), "--operands", ",".join(operands), "--iters", str(iters), "--out", out]
    if side == "ours":
        from collectives.launcher import launch

        status = launch(argv, n, transport="shm", prefix=False, timeout=timeout)
    else:
        status = subprocess.run([shutil.which("mpiexec") or "mpiexec", "-n", str(n)] + argv, env=_env(),
                                timeout=timeout).returncode
    if status != 0 or not os.path.exists(out):
        print(f"jax_compare: the {side} job failed (status {status})", file=sys.stderr)
        return None
    with open(out) as f:
        return json.load(f)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: the comparison, or (``--rank-side``) one rank of one side."""
    from .cli import parse_sizes

    ap = argparse.ArgumentParser(prog="python -m collectives.bench.jax_compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--sizes", default="8,64,512,4K,32K,256K,1M,4M,16M,64M",
                    help="a list (8,1K,1M) or lo:hi (powers of --factor)")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--operands", default="computed,argument",
                    help="what is allreduced: computed (x * 2 in the function, as a gradient), argument (x itself)")
    ap.add_argument("--iters", type=int, default=200, help="timed calls for small sizes (fewer from 64 KiB up)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the two jobs")
    ap.add_argument("--sides", default="ours,mpi4jax")
    ap.add_argument("--json", default=None, help="write every round's rows here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--rank-side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    sizes = parse_sizes(ns.sizes, ns.factor)
    operands = [o for o in ns.operands.split(",") if o]
    unknown = sorted(set(operands) - set(OPERANDS))
    if unknown or not operands:
        ap.error(f"--operands: {', '.join(unknown) or 'none given'}; known: {', '.join(OPERANDS)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # both sides' ranks inherit it
    if ns.rank_side:
        return _rank_main(ns.rank_side, sizes, operands, ns.iters, ns.out)
    sides = [s for s in ns.sides.split(",") if s]
    if "mpi4jax" in sides:
        ok, why = mpi4jax_available()
        if not ok:
            print(f"jax_compare: skipping mpi4jax: {why}", file=sys.stderr)
            sides.remove("mpi4jax")
        else:
            print(f"# mpi4jax {why}", file=sys.stderr)
    if not sides:
        return 1
    found: dict[tuple[str, str, int], list[float]] = {}
    p99: dict[tuple[str, str, int], list[float]] = {}
    what: dict[str, str] = {}
    wrong = 0
    rounds = []
    with tempfile.TemporaryDirectory(prefix="collectives-jax-compare-") as tmp:
        for rnd in range(max(ns.rounds, 1)):
            order = sides if rnd % 2 == 0 else sides[::-1]
            print(f"# round {rnd + 1} of {ns.rounds}: {', '.join(order)} (load average {os.getloadavg()[0]:.2f})",
                  file=sys.stderr, flush=True)
            for side in order:
                got = _run_side(side, ns.nprocs, sizes, operands, ns.iters, tmp, ns.timeout)
                if got is None:
                    return 1
                what[side] = got["what"]
                rounds.append(dict(got, round=rnd + 1))
                for r in got["rows"]:
                    key = (side, r["operand"], r["size"])
                    found.setdefault(key, []).append(r["time_us"])
                    p99.setdefault(key, []).append(r["time_us_p99"])
                    wrong += r["wrong"]
    print(f"# jitted allreduce of one float32 array (sum), {ns.nprocs} ranks, CPU; per operand (computed: x * 2 "
          "in the function, as a gradient; argument: x itself) and size the median over "
          f"{ns.rounds} interleaved rounds of each round's median time per call (us) [min-max over rounds]; "
          "ratio = ours / mpi4jax (< 1: ours is faster)")
    for side in sides:
        print(f"# {side}: {what[side]}")
    head = f"#{'operand':>8} {'size(B)':>10}" + "".join(f" {s + ' p50 [range]':>30} {s + ' p99':>10}" for s in sides)
    head += f" {'ratio':>6}" if len(sides) == 2 else ""
    print(head)
    for kind, size in sorted({(kind, size) for (_, kind, size) in found}, key=lambda k: (operands.index(k[0]), k[1])):
        line = f"{kind:>9} {size:>10}"
        for side in sides:
            vals = found.get((side, kind, size), [])
            line += f" {_spread(vals):>30} {statistics.median(p99[(side, kind, size)]) if vals else 0:>10.2f}"
        mine, theirs = (found.get((side, kind, size)) for side in sides) if len(sides) == 2 else (None, None)
        if mine and theirs:
            line += f" {statistics.median(mine) / statistics.median(theirs):>6.2f}"
        print(line)
    print(f"# wrong results: {wrong}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"p": ns.nprocs, "sides": what, "rounds": rounds}, f, indent=1)
    return 0 if wrong == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
