"""Prepared (persistent) calls: a blocking call validated once per signature.

A blocking call on contiguous 1-D numpy arrays is kept, once validated, under
its key (:func:`call_key`: the collective, the algorithm argument, the root,
the op and each buffer's dtype and size). A repeated call with the same key
skips validation and selection and runs at once, as MPI's persistent
collectives do; it still carries its signature (kept with the entry), so the
peers check it like any other call.

Two layers keep what they make once per call key, each in a
:class:`BoundedCache`: the communicator its prepared calls
(:class:`PreparedCalls`), and each shared window what its algorithms make
per buffer shape for the calls that take the full path (nonblocking calls,
buffers that are not 1-D arrays): views, pieces, compiled calls.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import compiled
from .context import CallContext
from .planning import ROOTED, Plan
from .registry import Algorithm
from .signature import Sig

__all__ = ["BoundedCache", "Prepared", "PreparedCalls", "CopyIn", "ApartOrAt", "call_key", "apart"]

#: Entries a cache keeps before its oldest half is dropped.
CAPACITY = 256

_NDARRAY = np.ndarray
_ABSENT = object()


def call_key(collective: str, algorithm: str, root: Any, op: Any, first: Any = _ABSENT,
             second: Any = _ABSENT) -> tuple | None:
    """The key of a prepared call: ``collective``, ``algorithm``, ``root``
    and ``op`` (None where the collective has none), and each array's dtype
    and size (an array passed as None, one a rank does not pass, such as
    gather's ``recvbuf`` off the root, keys as None). None where the call
    cannot be kept: an array that is not a 1-D numpy array, a root that is
    not an int, an op that is not a name. (Positional and unrolled: it is on
    every blocking call.)"""
    if (root is not None and type(root) is not int) or (op is not None and type(op) is not str):
        return None
    if first is _ABSENT:
        return (collective, algorithm, root, op)
    if type(first) is not _NDARRAY or first.ndim != 1:
        return None
    if second is _ABSENT:
        return (collective, algorithm, root, op, first.dtype, first.size)
    if second is None:
        return (collective, algorithm, root, op, first.dtype, first.size, None, None)
    if type(second) is not _NDARRAY or second.ndim != 1:
        return None
    return (collective, algorithm, root, op, first.dtype, first.size, second.dtype, second.size)


class CopyIn(NamedTuple):
    """How a call's arrays map to its algorithm's (``as_is`` of
    :meth:`PreparedCalls.remember`): the second array is first copied into
    the first from element ``at`` on (when it is not None), and the
    algorithm runs on the first alone (out-of-place allreduce, allgather)."""

    at: int

    def start(self, arrays: tuple) -> tuple:
        """Copy the second array in; the algorithm's arrays."""
        pair = self.pair(arrays)
        if pair is not None and pair[1].size:
            compiled.copy(*pair)
        return arrays[:1]

    def pair(self, arrays: tuple) -> tuple | None:
        """The copy as a plan's ``copy_in``, ``(place, source)``; None without a second array."""
        first, second = arrays
        return None if second is None else (first[self.at:self.at + second.size], second)


class BoundedCache(dict):
    """A dict of at most :data:`CAPACITY` entries: adding one to a full cache
    drops the oldest half first (``get`` stays a dict's: the hot path)."""

    def keep(self, key: Any, value: Any) -> Any:
        """Store ``value`` under ``key``; returns ``value``."""
        if len(self) >= CAPACITY and key not in self:
            for old in list(self)[:CAPACITY // 2]:
                del self[old]
        self[key] = value
        return value


class Prepared:
    """A prepared call.

    Attributes:
        algo: the algorithm.
        collective: the collective.
        sig: the call's signature without its sequence number.
        writes: per array of the call, whether it is written (checked writable).
        args: ``args(arrays)``, the algorithm's arguments for this call's arrays.
        func: the algorithm's own prepared call for this signature (see
            :class:`~collectives.registry.Algorithm`), else its function.
        ctx: the call context, reused (its tag, signature and deadline set per call).
        check: an extra per-call check ``check(arrays) -> bool`` (False: full path).
        direct: the prepared call's ``on_arrays``, ``(go, settle)``: it runs
            from the call's arrays, ``go(arrays, seq, sig)``, and when that
            returns what to wait for, ``settle(arrays, late, deadline)``;
            None if it has none.
        call: the compiled call ``go`` runs (the fast calls of
            :mod:`.fast_calls` may keep it), else None.
        copy_in: the :class:`CopyIn` of an out-of-place call whose
            prepared call does not make it: before ``func`` runs, or by
            ``func`` itself once every rank agreed, where the algorithm
            ``copies_in`` (:func:`~collectives.execution.run_algorithm`);
            else None.
        fast_generation: the fast calls' generation it was added in (-1: never).
    """

    __slots__ = ("algo", "collective", "sig", "writes", "args", "func", "ctx", "check", "direct", "call",
                 "copy_in", "fast_generation")

    def __init__(self, algo: Algorithm, sig: Sig, writes: tuple[bool, ...], args: Callable[[tuple], tuple],
                 func: Callable, ctx: CallContext, check: Callable[[tuple], bool] | None,
                 direct: tuple | None = None, call: Any = None, copy_in: CopyIn | None = None) -> None:
        self.algo, self.collective, self.sig = algo, algo.collective, sig
        self.writes, self.args, self.func, self.ctx, self.check = writes, args, func, ctx, check
        self.direct, self.call, self.copy_in = direct, call, copy_in
        self.fast_generation = -1


class PreparedCalls(BoundedCache):
    """The prepared calls of one communicator, by :func:`call_key`; None marks
    a key whose calls cannot be prepared."""

    def remember(self, key: tuple, plan: Plan, transport: Any, segment_bytes: int, scratch: dict,
                 writes: tuple[bool, ...], args: Callable[[tuple], tuple], staged: bool,
                 check: Callable[[tuple], bool] | None = None,
                 as_is: bool | CopyIn = True) -> None:
        """Keep ``plan`` (just validated) for repeated calls of ``key``, with the
        algorithm's own prepared call where it offers one. ``as_is``: True when
        the call's arrays are the algorithm's array arguments, in order (so a
        prepared call's ``on_arrays`` may take them directly); or a
        :class:`CopyIn` that maps them. Plans with a
        finalizer (``avg``), staged device buffers, a refusal or no data, and
        rooted calls over messages (they start with a signature check), are
        not kept."""
        if key in self:
            return
        entry = None
        if (plan.finalize is None and not staged and plan.refusal is None and not plan.empty
                and not (plan.collective in ROOTED and not plan.algo.needs)):  # those start with a check
            algo, made = plan.algo, None
            if isinstance(as_is, CopyIn) and algo.copies_in:  # the copy in done by its own call
                made = algo.prepare(transport, *plan.args, copy_in=as_is)
                if getattr(made, "on_arrays", None) is None:
                    made = None
                else:
                    as_is = True  # its on_arrays take the call's arrays as they are
            copies_itself = isinstance(as_is, CopyIn) and algo.copies_in  # (its body takes the source)
            if made is None and algo.prepare is not None and not copies_itself:
                made = algo.prepare(transport, *plan.args)
            func = made or algo.func
            ctx = CallContext(transport, 0, 0.0, segment_bytes, scratch)
            direct = getattr(func, "on_arrays", None) if as_is else None
            owner = getattr(direct[0], "__self__", None) if direct is not None else None
            call = owner if compiled.ext is not None and isinstance(owner, compiled.ext.Call) else None
            copy_in = as_is if isinstance(as_is, CopyIn) else None
            if direct is not None and copy_in is not None:
                direct = _mapped(direct, copy_in)
            entry = Prepared(plan.algo, plan.sig, writes, args, func, ctx, check, direct, call, copy_in)
        self.keep(key, entry)


def _mapped(direct: tuple, copy_in: CopyIn) -> tuple:
    """A compiled call's ``(go, settle)`` on the call's own arrays (see ``as_is``)."""
    go, settle = direct

    def go_from(arrays: tuple, seq: int, sig: Sig) -> Any:
        return go(copy_in.start(arrays), seq, sig)

    def settle_from(arrays: tuple, late: Any, deadline: float) -> None:
        settle(arrays[:1], late, deadline)
    return go_from, settle_from


def apart(arrays: tuple) -> bool:
    """Whether two contiguous arrays' memory does not overlap (alltoall's sendbuf and recvbuf)."""
    return not np.may_share_memory(arrays[0], arrays[1])


class ApartOrAt(NamedTuple):
    """A prepared call's check: the second array's memory lies apart from
    the first's, or it is the first's part from byte ``at`` (an allgather's
    own block in its receive buffer). The fast calls check the first
    alone (a call of the second kind runs from Python)."""

    at: int

    def __call__(self, arrays: tuple) -> bool:
        first, second = arrays
        return second is None or not np.may_share_memory(first, second) or \
            second.ctypes.data == first.ctypes.data + self.at
