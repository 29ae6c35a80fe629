"""Reducing blocks in rank order: in C for large blocks, with numpy's
ufuncs otherwise (in float32 scratch for half floats), the same bits on
every rank."""

from __future__ import annotations

import time

import numpy as np

from ... import compiled
from ...ops import BFLOAT16, Op
from .tuning import COMPILED_REDUCE_BYTES

__all__ = ["LOW", "reduce", "SCRATCH_LOW_PRECISION"]

#: Dtypes reduced in float32 scratch.
LOW = frozenset({np.dtype(np.float16)} | ({BFLOAT16} if BFLOAT16 is not None else set()))
#: The call's scratch slot (``ctx.scratch(..., slot=)``) of that float32 scratch.
SCRATCH_LOW_PRECISION = 7


def reduce(ctx, op: Op, dst: np.ndarray, srcs: list[np.ndarray], copies: list[np.ndarray] = ()) -> None:
    """``dst = srcs[0] op srcs[1] ...`` (dst may be srcs[0]), then the result
    into each of ``copies`` too; float32 scratch for half floats; in C
    (one pass over the sources, the copies made as the result is) for large
    blocks."""
    if ctx.tracer is not None:  # a timeline's "reducing" phase
        t0 = time.monotonic()
        try:
            _reduce(ctx, op, dst, srcs, copies)
        finally:
            ctx.tracer.phase("reducing", t0, time.monotonic())
        return
    _reduce(ctx, op, dst, srcs, copies)


def _reduce(ctx, op: Op, dst: np.ndarray, srcs: list[np.ndarray], copies) -> None:
    if dst.nbytes >= COMPILED_REDUCE_BYTES and len(srcs) > 1 and compiled.enabled() is not None:
        codes = compiled.kernel_codes(dst.dtype, op.name, op.ufunc)
        if codes is not None and all(a.flags.c_contiguous for a in srcs) and dst.flags.c_contiguous:
            compiled.reduce_into(dst, srcs, codes, copies)
            return
    scratch = ctx.scratch(dst.size, np.float32, slot=SCRATCH_LOW_PRECISION) if dst.dtype in LOW else None
    op.reduce_many(dst, srcs, scratch)
    for c in copies:
        compiled.copy(c, dst)
