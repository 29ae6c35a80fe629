"""One rank's part of a sweep: for each collective, algorithm and size, warm
up, time iterations one by one, take each iteration's maximum over ranks,
then check the result against numpy.

Run by the ``collectives bench`` launcher as
``python -m collectives.bench.sweep --peer ours|mpi|gloo --out FILE ...``;
rank 0 writes the rows to FILE (JSON) and prints a line per size to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

import numpy as np

from .peers import make_runner

__all__ = ["BUS_FACTOR", "bytes_of", "iterations", "run_sweep", "main"]

#: nccl-tests' bus bandwidth factors (busbw = algbw * factor(p)).
BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "bcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
    "barrier": lambda p: 0.0,
}
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("bcast", "reduce", "scatter", "gather")
#: collectives with both an in-place and an out-of-place form
TWO_FORMS = ("allreduce", "allgather")


def iterations(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """More iterations for small messages (as OSU does): at most 256 MiB moved per size."""
    if nbytes <= 64 * 1024:
        return iters, warmup
    scaled = max(5, min(iters, (256 << 20) // max(nbytes, 1)))
    return scaled, max(2, min(warmup, scaled // 4))


def bytes_of(collective: str, nbytes: int, p: int, itemsize: int) -> int:
    """nccl-tests' size: the per-rank buffer, rounded to whole elements (and to p blocks where split)."""
    count = max(nbytes // itemsize, 1)
    if collective in ("allgather", "reduce_scatter", "alltoall", "scatter", "gather"):
        count = max(count // p, 1) * p
    return 0 if collective == "barrier" else count * itemsize


def _data(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Small integers, so that sums are exact in every dtype."""
    return ((np.arange(count) + 3 * rank) % 7 + 1).astype(dtype)


def _buffers(runner: Any, collective: str, nbytes: int, dtype: np.dtype, op: str, root: int,
             inplace: bool) -> tuple[dict[str, Any], Any]:
    """Buffers for one call, and a function returning the count of wrong elements."""
    p, r = runner.size, runner.rank
    count = nbytes // dtype.itemsize
    block = count // p if collective in ("allgather", "reduce_scatter", "alltoall", "scatter", "gather") else count
    everyone = [_data(i, count, dtype) for i in range(p)]
    b: dict[str, Any] = {"root": root, "op_name": op, "op": op}
    reduce_ = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
               "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op].reduce
    if collective in ("allreduce", "reduce", "bcast"):
        b["send"] = runner.empty(count, dtype)
        if collective == "allreduce" and not inplace:
            b["out"] = runner.empty(count, dtype)
        want = reduce_(np.stack(everyone), axis=0).astype(dtype) if collective != "bcast" else everyone[root]

        def reset() -> None:
            b["send"][:] = everyone[r]

        def wrong() -> int:
            got = b.get("out") if b.get("out") is not None else b["send"]
            if collective == "reduce" and r != root:
                return 0
            return int(np.count_nonzero(got != want))
    elif collective == "allgather":
        b["recv"] = runner.empty(block * p, dtype)
        if not inplace:
            b["part"] = runner.empty(block, dtype)
        want = np.concatenate([e[:block] for e in everyone])

        def reset() -> None:
            b["recv"][:] = 0
            if inplace:
                b["recv"][r * block:(r + 1) * block] = everyone[r][:block]
            else:
                b["part"][:] = everyone[r][:block]

        def wrong() -> int:
            return int(np.count_nonzero(b["recv"] != want))
    elif collective == "reduce_scatter":
        b["send"], b["recv"] = runner.empty(block * p, dtype), runner.empty(block, dtype)
        full = reduce_(np.stack([e[:block * p] for e in everyone]), axis=0).astype(dtype)

        def reset() -> None:
            b["send"][:] = everyone[r][:block * p]

        def wrong() -> int:
            return int(np.count_nonzero(b["recv"] != full[r * block:(r + 1) * block]))
    elif collective == "alltoall":
        b["send"], b["recv"] = runner.empty(block * p, dtype), runner.empty(block * p, dtype)
        want = np.concatenate([everyone[i][r * block:(r + 1) * block] for i in range(p)])

        def reset() -> None:
            b["send"][:] = everyone[r][:block * p]

        def wrong() -> int:
            return int(np.count_nonzero(b["recv"] != want))
    elif collective == "scatter":
        b["send"], b["recv"] = runner.empty(block * p, dtype), runner.empty(block, dtype)

        def reset() -> None:
            b["send"][:] = everyone[root][:block * p]

        def wrong() -> int:
            return int(np.count_nonzero(b["recv"] != everyone[root][r * block:(r + 1) * block]))
    elif collective == "gather":
        b["send"], b["recv"] = runner.empty(block, dtype), runner.empty(block * p, dtype)
        want = np.concatenate([e[:block] for e in everyone])

        def reset() -> None:
            b["send"][:] = everyone[r][:block]

        def wrong() -> int:
            return int(np.count_nonzero(b["recv"] != want)) if r == root else 0
    else:  # barrier
        def reset() -> None:
            pass

        def wrong() -> int:
            return 0
    if collective not in ROOTED:
        b.pop("root")
    b["reset"] = reset
    return b, wrong


def _time(runner: Any, collective: str, algo: str, b: dict[str, Any], iters: int, warmup: int) -> np.ndarray:
    for _ in range(warmup):
        runner.call(collective, algo, b)
    runner.barrier()
    times = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter
    for i in range(iters):
        t0 = clock()
        runner.call(collective, algo, b)
        times[i] = clock() - t0
    return runner.max_over_ranks(times)


def run_sweep(runner: Any, collectives: Sequence[str], sizes: Sequence[int], *, algorithm: str = "auto",
              dtype: str = "float32", op: str = "sum", root: int = 0, iters: int = 100, warmup: int = 10,
              modes: Sequence[str] = ("inplace",), progress: bool = True) -> list[dict[str, Any]]:
    """Time every (collective, algorithm, size, mode); returns rows (the same on every rank)."""
    dt = np.dtype(dtype)
    p = runner.size
    rows = []
    for coll in collectives:
        for algo in runner.algorithms(coll, algorithm):
            for nbytes in ([0] if coll == "barrier" else sizes):
                size = bytes_of(coll, nbytes, p, dt.itemsize)
                for mode in (modes if coll in TWO_FORMS else ("inplace",)):
                    b, wrong = _buffers(runner, coll, size, dt, op, root % p, mode == "inplace")
                    n_iter, n_warm = iterations(size, iters, warmup)
                    b["reset"]()
                    times = _time(runner, coll, algo, b, n_iter, n_warm)
                    b["reset"]()
                    runner.call(coll, algo, b)
                    bad = np.array([wrong()], dtype=np.float64)
                    runner.max_over_ranks(bad)
                    med = float(np.median(times))
                    algbw = size / med / 1e9 if med > 0 else 0.0
                    row = {"peer": runner.name, "collective": coll, "mode": mode,
                           "algorithm": runner.label(coll, algo, size, dt),
                           "size": size, "count": size // dt.itemsize, "dtype": dtype,
                           "op": op if coll in REDUCING else "none",
                           "root": root % p if coll in ROOTED else -1, "iters": n_iter,
                           "time_us": med * 1e6, "time_us_min": float(times.min()) * 1e6,
                           "time_us_max": float(times.max()) * 1e6, "algbw": algbw,
                           "busbw": algbw * BUS_FACTOR[coll](p), "wrong": int(bad[0])}
                    rows.append(row)
                    if progress and runner.rank == 0:
                        print(f"  {runner.name:5s} {coll:14s} {algo:38s} {mode:8s} {size:>11d} B "
                              f"{row['time_us']:11.2f} us", file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one sweep rank (started by the bench launcher)."""
    ap = argparse.ArgumentParser(prog="collectives.bench.sweep")
    ap.add_argument("--peer", default="ours")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--alloc", action="store_true")
    ap.add_argument("--collectives", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="sum")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default="inplace")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    runner = make_runner(ns.peer, ns.transport, ns.alloc)
    rows = run_sweep(runner, ns.collectives.split(","), [int(s) for s in ns.sizes.split(",")],
                     algorithm=ns.algorithm, dtype=ns.dtype, op=ns.op, root=ns.root, iters=ns.iters,
                     warmup=ns.warmup, modes=ns.modes.split(","))
    if runner.rank == 0:
        with open(ns.out, "w") as f:
            json.dump({"p": runner.size, "transport": runner.transport, "rows": rows}, f)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
