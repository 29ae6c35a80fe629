"""Prepared (persistent) calls: a blocking call validated once per signature.

A blocking call on contiguous 1-D numpy arrays is kept, once validated, under
its key: the collective, the algorithm argument, the root, the op and each
buffer's dtype and size (see the communicator's public methods). A repeated
call with the same key skips validation and selection and runs at once, as
MPI's persistent collectives do; it still carries its signature (kept with
the entry), so the peers check it like any other call.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .context import CallContext
from .planning import ROOTED, Plan
from .registry import Algorithm
from .signature import Sig

__all__ = ["Prepared", "PreparedCalls", "flat_array", "apart", "rooted_key"]

#: Entries kept before the oldest half is dropped.
CAPACITY = 256


class Prepared:
    """A prepared call.

    Attributes:
        algo: the algorithm.
        collective: the collective.
        sig: the call's signature without its sequence number.
        writes: per array of the call, whether it is written (checked writable).
        args: ``args(arrays)``, the algorithm's arguments for this call's arrays.
        func: the algorithm's own persistent plan for this signature (see
            :class:`~collectives.registry.Algorithm`), else its function.
        ctx: the call context, reused (its tag, signature and deadline set per call).
        check: an extra per-call check ``check(arrays) -> bool`` (False: full path).
        direct: the persistent plan's ``on_arrays``, ``(go, settle)``: it runs
            from the call's arrays, ``go(arrays, seq, sig)``, and when that
            returns what to wait for, ``settle(arrays, late, deadline)``;
            None if it has none.
    """

    __slots__ = ("algo", "collective", "sig", "writes", "args", "func", "ctx", "check", "direct")

    def __init__(self, algo: Algorithm, sig: Sig, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                 func: Callable, ctx: CallContext, check: Callable[[tuple], bool] | None,
                 direct: tuple | None = None) -> None:
        self.algo, self.collective, self.sig = algo, algo.collective, sig
        self.writes, self.args, self.func, self.ctx, self.check = writes, args, func, ctx, check
        self.direct = direct


class PreparedCalls(dict):
    """The prepared calls of one communicator, by key (a dict: ``get`` is the
    hot path); None marks a key whose calls cannot be prepared."""

    def remember(self, key: tuple, plan: Plan, transport: Any, segment_bytes: int, scratch: dict,
                 writes: tuple[bool, ...], args: Callable[[tuple], tuple], staged: bool,
                 check: Callable[[tuple], bool] | None = None, as_is: bool = True) -> None:
        """Keep ``plan`` (just validated) for repeated calls of ``key``, with the
        algorithm's own persistent plan where it offers one. ``as_is``: the
        call's arrays are the algorithm's array arguments, in order (so a
        persistent plan's ``on_arrays`` may take them directly). Plans with a
        finalizer (``avg``), staged device buffers, a refusal or no data, and
        rooted calls over messages (they start with a signature check), are
        not kept."""
        if key in self:
            return
        entry = None
        if (plan.finalize is None and not staged and plan.refusal is None and not plan.empty
                and not (plan.collective in ROOTED and not plan.algo.needs)):  # those start with a check
            func = plan.algo.func
            if plan.algo.prepare is not None:
                func = plan.algo.prepare(transport, *plan.args) or func
            ctx = CallContext(transport, 0, 0.0, segment_bytes, scratch)
            entry = Prepared(plan.algo, plan.sig, writes, args, func, ctx, check,
                             getattr(func, "on_arrays", None) if as_is else None)
        if len(self) >= CAPACITY:
            for old in list(self)[:CAPACITY // 2]:
                del self[old]
        self[key] = entry


def flat_array(buf: Any) -> bool:
    """Whether ``buf`` can take a prepared call: a 1-D numpy array."""
    return type(buf) is np.ndarray and buf.ndim == 1


def apart(arrays: tuple) -> bool:
    """Whether two contiguous arrays' memory does not overlap (alltoall's sendbuf and recvbuf)."""
    return not np.may_share_memory(arrays[0], arrays[1])


def rooted_key(collective: str, algorithm: str, root: Any, everywhere: Any, on_root: Any,
               rank: int) -> tuple[tuple | None, Any]:
    """Key of a prepared gather or scatter, whose ``everywhere`` buffer every
    rank passes and ``on_root`` only the root, with that buffer as this rank
    takes it (None off the root); (None, None) where the call cannot be
    prepared."""
    if not (flat_array(everywhere) and type(root) is int):
        return None, None
    mine = on_root if root == rank else None
    if mine is not None and not flat_array(mine):
        return None, None
    return (collective, algorithm, root, everywhere.dtype, everywhere.size,
            None if mine is None else (mine.dtype, mine.size)), mine
