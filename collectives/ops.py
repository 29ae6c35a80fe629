"""Reduction operators: numpy ufuncs applied in place on views.

``op.reduce(dst, src)`` computes ``dst = dst (op) src`` without a Python loop
over elements. ``op.reduce_many(dst, srcs)`` folds several sources into
``dst``; float16 and bfloat16 sums accumulate in float32 there and round
once. ``avg`` is ``sum`` followed by :meth:`Op.finalize` (divide by p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import BadArgument

try:  # bfloat16 is optional at import time, required by the dependencies
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None

__all__ = ["Op", "OPS", "get_op", "check_dtype", "SUPPORTED_DTYPES", "SUPPORTED_SET", "BFLOAT16"]

_LOW_PRECISION = {np.dtype(np.float16)} | ({BFLOAT16} if BFLOAT16 is not None else set())


def _kind(dtype: np.dtype) -> str:
    if dtype == BFLOAT16:
        return "f"
    return dtype.kind


@dataclass(frozen=True)
class Op:
    """A reduction operator.

    Attributes:
        name: ``sum``, ``prod``, ``min``, ``max``, ``avg``, ``band``, ``bor``,
            ``bxor``, ``land`` or ``lor``.
        ufunc: the numpy ufunc applied elementwise.
        kinds: numpy dtype kinds the op is defined for.
    """

    name: str
    ufunc: np.ufunc
    kinds: str

    def check(self, dtype: np.dtype) -> None:
        """Raise BadArgument if the op is not defined for ``dtype``."""
        if _kind(dtype) not in self.kinds:
            raise BadArgument(f"op {self.name!r} is not valid for dtype {dtype}")

    def reduce(self, dst: np.ndarray, src: np.ndarray) -> None:
        """In place: ``dst = dst (op) src``."""
        if dst.size:
            self.ufunc(dst, src, out=dst)

    def reduce_into(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """``out = a (op) b`` (out may alias a or b)."""
        if out.size:
            self.ufunc(a, b, out=out)

    def reduce_many(self, dst: np.ndarray, srcs: Sequence[np.ndarray],
                    scratch: np.ndarray | None = None) -> None:
        """``dst = srcs[0] (op) srcs[1] (op) ...``; dst may be one of srcs.

        For float16/bfloat16 sums and products the partial results are kept
        in float32 (``scratch``, float32 of dst's size, if given) and rounded
        once at the end.
        """
        if not dst.size or not srcs:
            if srcs and dst is not srcs[0]:
                np.copyto(dst, srcs[0])
            return
        if dst.dtype in _LOW_PRECISION and self.name in ("sum", "avg", "prod") and len(srcs) > 1:
            acc = scratch if scratch is not None else np.empty(dst.shape, np.float32)
            np.copyto(acc, srcs[0], casting="unsafe")
            for s in srcs[1:]:
                self.ufunc(acc, s, out=acc, casting="unsafe")
            np.copyto(dst, acc, casting="unsafe")
            return
        first, rest = srcs[0], srcs[1:]
        if len(rest) == 0:
            if first is not dst:
                np.copyto(dst, first)
            return
        self.ufunc(first, rest[0], out=dst)
        for s in rest[1:]:
            self.ufunc(dst, s, out=dst)

    def finalize(self, buf: np.ndarray, size: int) -> None:
        """Post-processing after the reduction (``avg`` divides by ``size``)."""
        if self.name == "avg" and buf.size and size > 1:
            if buf.dtype in _LOW_PRECISION:
                tmp = buf.astype(np.float32)
                tmp /= size
                np.copyto(buf, tmp, casting="unsafe")
            else:
                np.true_divide(buf, size, out=buf, casting="unsafe")


_NUM = "biufc"  # signed, unsigned, float, complex (bool handled separately)
OPS: dict[str, Op] = {
    "sum": Op("sum", np.add, _NUM + "?"),
    "prod": Op("prod", np.multiply, _NUM + "?"),
    "min": Op("min", np.minimum, "biuf?"),
    "max": Op("max", np.maximum, "biuf?"),
    "avg": Op("avg", np.add, "fc"),
    "band": Op("band", np.bitwise_and, "biu?"),
    "bor": Op("bor", np.bitwise_or, "biu?"),
    "bxor": Op("bxor", np.bitwise_xor, "biu?"),
    "land": Op("land", np.logical_and, _NUM + "?"),
    "lor": Op("lor", np.logical_or, _NUM + "?"),
}
# Aliases users of MPI and torch.distributed type.
_ALIASES = {"product": "prod", "mean": "avg", "minimum": "min", "maximum": "max",
            "and": "land", "or": "lor", "xor": "bxor", "add": "sum"}

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
        np.int64, np.uint64, np.float16, np.float32, np.float64, np.longdouble,
        np.complex64, np.complex128,
    )
) + ((BFLOAT16,) if BFLOAT16 is not None else ())


def get_op(op: "str | Op") -> Op:
    """The Op for a name (case-insensitive, MPI/torch aliases accepted) or an Op."""
    found = OPS.get(op) if isinstance(op, str) else None
    if found is not None:
        return found
    if isinstance(op, Op):
        return op
    name = getattr(op, "name", op)  # accepts enums such as torch's ReduceOp members
    if not isinstance(name, str):
        raise BadArgument(f"unknown reduction op {op!r}")
    key = name.lower().removeprefix("mpi_")
    key = _ALIASES.get(key, key)
    try:
        return OPS[key]
    except KeyError:
        raise BadArgument(f"unknown reduction op {op!r}; known: {', '.join(OPS)}") from None


def check_dtype(dtype: np.dtype) -> None:
    """Raise BadArgument if ``dtype`` cannot be communicated."""
    if dtype not in SUPPORTED_SET:
        raise BadArgument(f"unsupported dtype {dtype}; supported: "
                          + ", ".join(str(d) for d in SUPPORTED_DTYPES))

#: :data:`SUPPORTED_DTYPES` as a set, for membership tests.
SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
