"""Deterministic per-rank data and numpy references for the collective tests.

Values are small integers (exact in every dtype, including float16 and
bfloat16), so results must match the reference exactly whatever the
algorithm's order of reduction.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import BFLOAT16, get_op

DTYPE_OP_CASES = [
    ("float32", "sum"), ("float64", "max"), ("int32", "prod"), ("int64", "min"),
    ("float16", "sum"), ("bfloat16", "sum"), ("uint8", "bxor"), ("int16", "band"),
    ("bool", "lor"), ("complex64", "sum"), ("float32", "avg"), ("int8", "land"),
]
MOVE_DTYPES = ["float32", "int64", "uint8", "float16", "bfloat16", "complex128"]
LARGE_BYTES = 2 << 20


def dtype_of(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def data(rank: int, count: int, dtype: str, op: str = "sum", salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: reproducible on every rank."""
    rng = np.random.default_rng(1000003 * rank + 7919 * salt + count)
    dt = dtype_of(dtype)
    if op == "prod":
        vals = rng.integers(1, 3, count)
    elif op in ("land", "lor") or dt == np.bool_:
        vals = rng.integers(0, 2, count)
    elif op in ("band", "bor", "bxor"):
        vals = rng.integers(0, 128, count)
    else:
        vals = rng.integers(0, 4, count)
    return vals.astype(dt)


def reduced(p: int, count: int, dtype: str, op: str, salt: int = 0) -> np.ndarray:
    """The reduction of every rank's :func:`data`."""
    o = get_op(op)
    dt = dtype_of(dtype)
    ins = [data(r, count, dtype, op, salt) for r in range(p)]
    if dt == BFLOAT16 or dt == np.float16:
        acc = ins[0].astype(np.float32)
        for x in ins[1:]:
            o.ufunc(acc, x.astype(np.float32), out=acc)
        out = acc
    else:
        out = ins[0].copy()
        for x in ins[1:]:
            o.ufunc(out, x, out=out)
    if op == "avg":
        out = out / p
    return out.astype(dt)


def sizes(p: int) -> list[int]:
    """Element counts every algorithm is checked with."""
    return sorted({0, 1, max(p - 1, 0), 7 * p + 3})


def runnable(comm, collective: str) -> list[str]:
    """Names of every algorithm of ``collective`` the communicator's transport can run."""
    import collectives

    caps = comm.transport.capabilities
    return [a.name for a in collectives.algorithms_for(collective).values() if a.needs <= caps]


def expect_equal(failures: list, what: str, got: np.ndarray, want: np.ndarray) -> None:
    """Record a failure unless ``got`` equals ``want`` exactly."""
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{what}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)) and not np.array_equal(got, want):
        bad = int(np.count_nonzero(got != want))
        failures.append(f"{what}: {bad} of {want.size} elements differ")
