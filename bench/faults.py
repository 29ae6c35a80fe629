"""Pieces of the fault-injection tests and campaigns: guarded buffers, calls
made from a description, fresh communicators inside one job, outcomes.

A *spec* describes one rank's call: ``(collective, algorithm, dtype, count,
op, root)``. :func:`call` makes it on guarded buffers (each with a guard
region after its end that must stay untouched) and reports what happened.
:func:`mapped_shm_files` and :func:`remove_left` clear what a killed MPI job
leaves in /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

import collectives
from collectives import CollectiveError
from collectives.registry import algorithms_for

GUARD = 1024  # elements after every buffer
FILL = 77


@dataclass(frozen=True)
class Spec:
    """One rank's collective call."""

    collective: str
    algorithm: str = "auto"
    dtype: str = "float32"
    count: int = 8  # elements per rank's block (gather/scatter/allgather/alltoall: per block)
    op: str = "sum"
    root: int = 0
    out: bool = False  # allreduce out of place (into an array of its own)

    def with_(self, **changes: Any) -> "Spec":
        return Spec(**{**self.__dict__, **changes})


def mapped_shm_files() -> list[str]:
    """The files in /dev/shm this process maps. MPICH maps its segments at
    MPI_Init and removes them at MPI_Finalize, so a job whose rank was killed
    leaves them: a rank reports these, and its job's runner removes them."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                found.add(path)
    return sorted(found)


def remove_left(paths: Iterable[str]) -> int:
    """Remove ``paths`` (files of a job that has ended) that still exist; how many did."""
    removed = 0
    for path in set(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


def guarded(n: int, dtype: str, value: float = 1) -> tuple[np.ndarray, np.ndarray]:
    """(whole array, the first n elements): the rest is a guard region."""
    raw = np.full(n + GUARD, FILL, np.dtype(dtype))
    view = raw[:n]
    view[...] = value
    return raw, view


def intact(raws: list[np.ndarray], ns: list[int]) -> bool:
    """Whether every guard region still holds FILL."""
    return all(np.all(raw[n:] == FILL) for raw, n in zip(raws, ns))


def fresh(tag: str, timeout: float = 5.0) -> collectives.Communicator:
    """A new communicator of this job (every rank must call it with the same tag)."""
    return collectives.init(job=f"{os.environ['COLLECTIVES_JOB']}-{tag}", timeout=timeout)


def call(comm, spec: Spec) -> dict:
    """Make ``spec``'s call on guarded buffers; what happened, how long it took,
    whether every guard is intact, whether every buffer still holds what
    it held before (``untouched``) and (on success) the result."""
    p, r = comm.size, comm.rank
    c, n = spec.collective, spec.count
    raws, ns, fills = [], [], []

    def buf(k: int, value: float = 1) -> np.ndarray:
        raw, view = guarded(k, spec.dtype, value)
        raws.append(raw)
        ns.append(k)
        fills.append((view, view.copy()))
        return view

    result: Any = None
    t0 = time.monotonic()
    try:
        if c == "allreduce" and spec.out:
            x, out = buf(n, r + 1), buf(n, 0)
            comm.allreduce(x, spec.op, algorithm=spec.algorithm, out=out)
            result = out if np.all(x == r + 1) else x  # its input must keep its values
        elif c == "allreduce":
            x = buf(n, r + 1)
            comm.allreduce(x, spec.op, algorithm=spec.algorithm)
            result = x
        elif c == "reduce":
            x = buf(n, r + 1)
            comm.reduce(x, spec.root, spec.op, algorithm=spec.algorithm)
            result = x
        elif c == "bcast":
            x = buf(n, 5 if r == spec.root else 0)
            comm.bcast(x, spec.root, algorithm=spec.algorithm)
            result = x
        elif c == "allgather":
            x, out = buf(n, r + 1), buf(n * p, 0)
            comm.allgather(x, out, algorithm=spec.algorithm)
            result = out
        elif c == "gather":
            x = buf(n, r + 1)
            out = buf(n * p, 0) if r == spec.root else None
            comm.gather(x, out, spec.root, algorithm=spec.algorithm)
            result = out
        elif c == "scatter":
            send = buf(n * p, 3) if r == spec.root else None
            out = buf(n, 0)
            comm.scatter(send, out, spec.root, algorithm=spec.algorithm)
            result = out
        elif c == "reduce_scatter":
            x, out = buf(n * p, r + 1), buf(n, 0)
            comm.reduce_scatter(x, out, spec.op, algorithm=spec.algorithm)
            result = out
        elif c == "alltoall":
            x, out = buf(n * p, r + 1), buf(n * p, 0)
            comm.alltoall(x, out, algorithm=spec.algorithm)
            result = out
        elif c == "barrier":
            comm.barrier(algorithm=spec.algorithm)
        else:
            raise ValueError(c)
        outcome = "ok"
        message = ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return {"outcome": outcome, "message": message, "elapsed": time.monotonic() - t0,
            "intact": intact(raws, ns), "untouched": all(np.array_equal(v, was) for v, was in fills),
            "result": None if result is None else result.copy()}


def expected(spec: Spec, p: int, r: int) -> np.ndarray | None:
    """What a correct ``spec`` call leaves in rank ``r``'s result (None: nothing to check)."""
    n, dt, c = spec.count, np.dtype(spec.dtype), spec.collective
    if c in ("allreduce", "reduce", "reduce_scatter"):
        if c == "reduce" and r != spec.root:
            return np.full(n, r + 1, dt)
        vals = [np.full(n, q + 1, dt) for q in range(p)]
        acc = vals[0].copy()
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[spec.op]
        for v in vals[1:]:
            acc = ufunc(acc, v).astype(dt)
        return acc
    if c == "bcast":
        return np.full(n, 5, dt)
    if c in ("allgather", "gather"):
        if c == "gather" and r != spec.root:
            return None
        return np.concatenate([np.full(n, q + 1, dt) for q in range(p)])
    if c == "scatter":
        return np.full(n, 3, dt)
    if c == "alltoall":
        return np.concatenate([np.full(n, q + 1, dt) for q in range(p)])
    return None


def named_algorithms(collective: str, capabilities: frozenset[str]) -> list[str]:
    """Every algorithm of ``collective`` a transport with ``capabilities`` runs."""
    return sorted(a.name for a in algorithms_for(collective).values() if a.needs <= capabilities)
