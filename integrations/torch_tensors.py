"""Tensors as the torch backend hands them to the communicator.

Reduce ops as the library names them, flat numpy views of CPU tensors,
contiguous stand-ins for tensors that are not, and the autograd version
bump of the tensors a call writes in place.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from collectives.errors import BadArgument

__all__ = ["reduce_op_name", "as_numpy", "Staged", "check_cpu", "tensors_in", "mark_written"]

_RED = dist.ReduceOp.RedOpType

# As in Gloo, on bool tensors sum and max are "or", min and product "and".
_BOOL_OPS = {_RED.SUM: "lor", _RED.MAX: "lor", _RED.BOR: "lor", _RED.MIN: "land",
             _RED.PRODUCT: "land", _RED.BAND: "land", _RED.BXOR: "bxor"}
_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.PRODUCT: "prod", _RED.MIN: "min",
        _RED.MAX: "max", _RED.BAND: "band", _RED.BOR: "bor", _RED.BXOR: "bxor"}


def reduce_op_name(op: Any, dtype: torch.dtype) -> str:
    """Our op name for a ``torch.distributed.ReduceOp`` on tensors of ``dtype``.

    Raises:
        BadArgument: for ``PREMUL_SUM`` and other ops without an equivalent.
    """
    kind = op.op if hasattr(op, "op") else op
    name = (_BOOL_OPS if dtype == torch.bool else _OPS).get(kind)
    if name is None:
        raise BadArgument(f"reduce op {kind} is not supported by the collectives backend")
    return name


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor (bfloat16 as ml_dtypes.bfloat16)."""
    from collectives.buffers import flat

    if t.is_cpu and t.dtype != torch.bfloat16:  # the common case: numpy's view, then its checks
        return flat((t.detach() if t.requires_grad else t).numpy(), writable=True, what="tensor")
    return flat(t, writable=True, what="tensor")


class Staged:
    """Contiguous stand-ins for tensors that are not, copied back when done."""

    def __init__(self) -> None:
        self.copy_backs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def writable(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when contiguous, else a contiguous copy that :meth:`finish` copies back."""
        if t.is_contiguous():
            return t
        c = t.contiguous()
        self.copy_backs.append((t, c))
        return c

    @staticmethod
    def readable(t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when contiguous, else a contiguous copy (read only: never copied back)."""
        return t if t.is_contiguous() else t.contiguous()

    def finish(self) -> None:
        """Copy every stand-in back into its tensor."""
        for dst, src in self.copy_backs:
            dst.copy_(src)

    @property
    def finisher(self):
        """:meth:`finish`, or None when there is nothing to copy back (the
        work then skips it, and its ``no_grad()`` block)."""
        return self.finish if self.copy_backs else None


def check_cpu(tensors: Sequence[torch.Tensor]) -> None:
    """Refuse tensors that are not on the CPU (BadArgument)."""
    for t in tensors:
        if not t.is_cpu:  # (is_cpu is a tenth of the cost of device.type)
            raise BadArgument(f"the collectives backend takes CPU tensors, got one on {t.device}")


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` (a tensor or nested lists of them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def mark_written(*outputs: Any) -> None:
    """Tell autograd that the backend writes these tensors in place (as torch's
    own in-place operations do), so a tensor saved for backward and then
    overwritten by a collective makes backward raise instead of using the new
    values."""
    tensors = [t for out in outputs for t in tensors_in(out)]
    if tensors:
        increment_version(tensors)
