"""One rank's part of a sweep: for each collective, algorithm and size, warm
up, time iterations one by one, take each iteration's maximum over ranks,
then check the result against numpy.

Run by the ``collectives bench`` launcher as
``python -m collectives.bench.sweep --peer ours|mpi|openmpi|gloo --out FILE ...``;
rank 0 writes the rows to FILE (JSON) and prints a line per size to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from collectives.transports.shm.pages import every_page_huge

from .pages import PAGES
from .peers import make_runner

__all__ = ["BUS_FACTOR", "REDUCE_OPS", "POINT_TO_POINT", "CallBuffers", "bytes_of", "dtype_of", "iterations",
           "measure", "run_sweep", "main"]

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
    "pingpong": lambda p: 1.0,
}
#: What the bench times beside the collectives, never part of "all": ``pingpong``,
#: OSU's latency test (ranks 0 and 1 send the message back and forth, the
#: other ranks idle; each iteration is a round trip, reported as half of it,
#: one way, as ``osu_latency`` reports).
POINT_TO_POINT = ("pingpong",)
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("bcast", "reduce", "scatter", "gather")
#: collectives with both an in-place and an out-of-place form
TWO_FORMS = ("allreduce", "allgather")
#: numpy's reference of each reduction op the bench checks
REDUCE_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
              "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
              "land": np.logical_and, "lor": np.logical_or}
#: collectives whose buffer is split in p blocks
BLOCKED = ("allgather", "reduce_scatter", "alltoall", "scatter", "gather")


def dtype_of(name: str) -> np.dtype:
    """numpy's dtype of ``name``; ``bfloat16`` and the other ml_dtypes types too."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def iterations(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """More iterations for small messages (as OSU does): at most 256 MiB moved per size."""
    if nbytes <= 64 * 1024:
        return iters, warmup
    scaled = max(5, min(iters, (256 << 20) // max(nbytes, 1)))
    return scaled, max(2, min(warmup, scaled // 4))


def bytes_of(collective: str, nbytes: int, p: int, itemsize: int) -> int:
    """nccl-tests' size: the per-rank buffer, rounded to whole elements (and to p blocks where split)."""
    count = max(nbytes // itemsize, 1)
    if collective in BLOCKED:
        count = max(count // p, 1) * p
    return 0 if collective == "barrier" else count * itemsize


def _data(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Small integers, so that sums are exact in every dtype."""
    return ((np.arange(count) + 3 * rank) % 7 + 1).astype(dtype)


class CallBuffers:
    """Buffers of one timed call on one rank: ``bufs`` (what the runner's ``call`` reads),
    ``reset()`` (put the inputs back) and ``wrong()`` (elements that differ from numpy)."""

    def __init__(self, runner: Any, collective: str, count: int, dtype: np.dtype, op: str, root: int,
                 inplace: bool) -> None:
        self.runner, self.dtype, self.root, self.inplace = runner, dtype, root, inplace
        self.p, self.r = runner.size, runner.rank
        self.block = count // self.p if collective in BLOCKED else count
        self.everyone = [_data(i, count, dtype) for i in range(self.p)]
        self.bufs: dict[str, Any] = {"op_name": op, "op": op}
        if collective in ROOTED:
            self.bufs["root"] = root
        self.reduce = REDUCE_OPS[op].reduce
        self._fill: list[tuple[str, np.ndarray]] = []
        self._check: tuple[str, np.ndarray] | None = None
        getattr(self, "_" + collective)()

    def _empty(self, count: int) -> np.ndarray:
        return self.runner.empty(count, self.dtype)

    def in_huge_pages(self) -> bool | None:
        """Whether every page of this rank's buffers lies in a huge page
        (None when the kernel cannot tell)."""
        answers = [every_page_huge(b.ctypes.data, b.nbytes) for b in self.bufs.values()
                   if isinstance(b, np.ndarray) and b.nbytes]
        return None if None in answers else all(answers)

    def _reduced(self, count: int) -> np.ndarray:
        return self.reduce(np.stack([e[:count] for e in self.everyone]), axis=0).astype(self.dtype)

    def _allreduce(self) -> None:
        self.bufs["send"] = self._empty(self.block)
        if not self.inplace:
            self.bufs["out"] = self._empty(self.block)
        self._fill = [("send", self.everyone[self.r])]
        self._check = ("out" if not self.inplace else "send", self._reduced(self.block))

    def _reduce(self) -> None:
        self.bufs["send"] = self._empty(self.block)
        self._fill = [("send", self.everyone[self.r])]
        self._check = ("send", self._reduced(self.block)) if self.r == self.root else None

    def _bcast(self) -> None:
        self.bufs["send"] = self._empty(self.block)
        self._fill = [("send", self.everyone[self.r])]
        self._check = ("send", self.everyone[self.root])

    def _allgather(self) -> None:
        b, n = self.block, self.block * self.p
        self.bufs["recv"] = self._empty(n)
        mine = self.everyone[self.r][:b]
        if self.inplace:
            start = np.zeros(n, self.dtype)
            start[self.r * b:(self.r + 1) * b] = mine
            self._fill = [("recv", start)]
        else:
            self.bufs["part"] = self._empty(b)
            self._fill = [("recv", np.zeros(n, self.dtype)), ("part", mine)]
        self._check = ("recv", np.concatenate([e[:b] for e in self.everyone]))

    def _reduce_scatter(self) -> None:
        b, n = self.block, self.block * self.p
        self.bufs["send"], self.bufs["recv"] = self._empty(n), self._empty(b)
        self._fill = [("send", self.everyone[self.r][:n])]
        self._check = ("recv", self._reduced(n)[self.r * b:(self.r + 1) * b])

    def _alltoall(self) -> None:
        b, n = self.block, self.block * self.p
        self.bufs["send"], self.bufs["recv"] = self._empty(n), self._empty(n)
        self._fill = [("send", self.everyone[self.r][:n])]
        self._check = ("recv", np.concatenate([e[self.r * b:(self.r + 1) * b] for e in self.everyone]))

    def _scatter(self) -> None:
        b, n = self.block, self.block * self.p
        self.bufs["send"], self.bufs["recv"] = self._empty(n), self._empty(b)
        self._fill = [("send", self.everyone[self.root][:n])]
        self._check = ("recv", self.everyone[self.root][self.r * b:(self.r + 1) * b])

    def _gather(self) -> None:
        b, n = self.block, self.block * self.p
        self.bufs["send"], self.bufs["recv"] = self._empty(b), self._empty(n)
        self._fill = [("send", self.everyone[self.r][:b])]
        self._check = ("recv", np.concatenate([e[:b] for e in self.everyone])) if self.r == self.root else None

    def _barrier(self) -> None:
        pass

    def _pingpong(self) -> None:
        if self.p < 2:
            raise ValueError("pingpong needs at least 2 ranks")
        self.bufs["send"], self.bufs["recv"] = self._empty(self.block), self._empty(self.block)
        self._fill = [("send", self.everyone[self.r]), ("recv", np.zeros(self.block, self.dtype))]
        self._check = ("recv", self.everyone[0]) if self.r < 2 else None  # what rank 0 sent, echoed

    def reset(self) -> None:
        for key, source in self._fill:
            self.bufs[key][:] = source

    def wrong(self) -> int:
        if self._check is None:
            return 0
        key, want = self._check
        return int(np.count_nonzero(self.bufs[key] != want))


def _time(runner: Any, collective: str, algo: str, b: dict[str, Any], iters: int, warmup: int,
          write: Callable[[], None] | None = None) -> np.ndarray:
    """Warm up, barrier, then time each iteration; returns each iteration's maximum over ranks.
    With ``write``, each iteration writes the inputs first, and its time covers the write and the call.

    In-place reductions compound over the iterations (a sum doubles at 2
    ranks) and overflow to inf after about 128 of them: numpy's overflow
    warning is expected here and silenced (the checked call runs on reset
    buffers afterwards)."""
    call = runner.bind(collective, algo, b)
    if write is not None:
        bare = call

        def call() -> None:
            write()
            bare()
    with np.errstate(over="ignore"):
        for _ in range(warmup):
            call()
        runner.barrier()
        times = np.empty(iters, dtype=np.float64)
        clock = time.perf_counter
        for i in range(iters):
            t0 = clock()
            call()
            times[i] = clock() - t0
    return runner.max_over_ranks(times)


def measure(runner: Any, collective: str, algorithm: str, size: int, *, dtype: str = "float32",
            op: str = "sum", root: int = 0, mode: str = "inplace", iters: int = 100,
            warmup: int = 10, rewrite: bool = False) -> dict[str, Any]:
    """Time one (collective, algorithm, size in bytes, mode) and check its result;
    with ``rewrite``, every iteration writes the call's inputs again and is
    timed with the write (see ``collectives bench --rewrite``).

    Returns:
        The row (the same on every rank): median (p50), 99th percentile, min and max over
        iterations of the per-iteration maximum over ranks, bandwidths, the count of wrong
        elements, the MPI library that ran it (None where none did), and whether every
        rank's buffers lay in huge pages as placed, before the calls (None where the kernel
        cannot tell).
    """
    dt, p = dtype_of(dtype), runner.size
    case = CallBuffers(runner, collective, size // dt.itemsize, dt, op, root % p, mode == "inplace")
    n_iter, n_warm = iterations(size, iters, warmup)
    case.reset()
    huge = case.in_huge_pages()  # as placed (the shared pool may adopt a buffer used again, in its own pages)
    times = _time(runner, collective, algorithm, case.bufs, n_iter, n_warm, case.reset if rewrite else None)
    if collective in POINT_TO_POINT:
        times /= 2  # one way
    case.reset()
    runner.bind(collective, algorithm, case.bufs)()
    bad = runner.max_over_ranks(np.array([case.wrong()], dtype=np.float64))
    lacking, unknown = runner.max_over_ranks(np.array([huge is False, huge is None], dtype=np.float64))
    med = float(np.median(times))
    algbw = size / med / 1e9 if med > 0 else 0.0
    return {"peer": runner.name, "collective": collective, "mode": mode,
            "algorithm": runner.label(collective, algorithm, size, dt),
            "size": size, "count": size // dt.itemsize, "dtype": dtype,
            "op": op if collective in REDUCING else "none",
            "root": root % p if collective in ROOTED else -1, "iters": n_iter,
            "time_us": med * 1e6, "time_us_min": float(times.min()) * 1e6,
            "time_us_max": float(times.max()) * 1e6, "time_us_p99": float(np.percentile(times, 99)) * 1e6,
            "algbw": algbw, "busbw": algbw * BUS_FACTOR[collective](p), "wrong": int(bad[0]),
            "mpi": getattr(runner, "mpi", None), "rewrite": rewrite,
            "huge_pages": None if unknown else not lacking}


def run_sweep(runner: Any, collectives: Sequence[str], sizes: Sequence[int], *, algorithm: str = "auto",
              dtype: str = "float32", op: str = "sum", root: int = 0, iters: int = 100, warmup: int = 10,
              modes: Sequence[str] = ("inplace",), progress: bool = True,
              rewrite: bool = False) -> list[dict[str, Any]]:
    """Time every (collective, algorithm, size, mode) with :func:`measure`.

    Args:
        runner: a runner of :mod:`collectives.bench.peers` (this rank's).
        collectives: collective names; sizes: requested sizes in bytes (rounded per collective).
        algorithm: "auto", "all", a name or a comma list.

    Returns:
        The rows, the same on every rank; rank 0 prints a line per size to stderr.
    """
    itemsize = dtype_of(dtype).itemsize
    rows = []
    for coll in collectives:
        for algo in runner.algorithms(coll, algorithm):
            for nbytes in ([0] if coll == "barrier" else sizes):
                size = bytes_of(coll, nbytes, runner.size, itemsize)
                for mode in (modes if coll in TWO_FORMS else ("inplace",)):
                    row = measure(runner, coll, algo, size, dtype=dtype, op=op, root=root, mode=mode,
                                  iters=iters, warmup=warmup, rewrite=rewrite)
                    rows.append(row)
                    if progress and runner.rank == 0 and sys.stderr.isatty():  # one line, rewritten
                        print(f"\r  {runner.name} {coll} {algo} {mode} {size} B: {row['time_us']:.2f} us"
                              .ljust(100)[:100], end="", file=sys.stderr, flush=True)
    if progress and runner.rank == 0 and sys.stderr.isatty():
        print("\r" + " " * 100 + "\r", end="", file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one sweep rank (started by the bench launcher)."""
    ap = argparse.ArgumentParser(prog="collectives.bench.sweep")
    ap.add_argument("--peer", default="ours")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--alloc", action="store_true")
    ap.add_argument("--pages", default="numpy", choices=PAGES)
    ap.add_argument("--collectives", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="sum")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default="inplace")
    ap.add_argument("--rewrite", action="store_true")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    runner = make_runner(ns.peer, ns.transport, ns.alloc, ns.pages)
    rows = run_sweep(runner, ns.collectives.split(","), [int(s) for s in ns.sizes.split(",")],
                     algorithm=ns.algorithm, dtype=ns.dtype, op=ns.op, root=ns.root, iters=ns.iters,
                     warmup=ns.warmup, modes=ns.modes.split(","), rewrite=ns.rewrite)
    if runner.rank == 0:
        with open(ns.out, "w") as f:
            json.dump({"p": runner.size, "transport": runner.transport, "mpi": getattr(runner, "mpi", None),
                       "rows": rows}, f)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
