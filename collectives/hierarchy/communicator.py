"""The hierarchical communicator: the world's transport, and shared memory within each host.

:class:`HierarchicalCommunicator` is a :class:`~collectives.Communicator`
over the world transport (TCP, MPI or RDMA between every pair of ranks):
its flat algorithms, point-to-point calls, sequence numbers, aborts,
flight records and nonblocking calls are the communicator's own. Beside
them it offers, by name and to ``auto``, the hierarchical algorithms
(:mod:`.table`), whose phases run within each host over a shared-memory
communicator of the host's ranks (:mod:`.host`) and between hosts over
groups of world ranks (:mod:`.group`) that share the world call's tag.

Every call, flat or hierarchical, starts with the host's local check
(:mod:`.agreement`), so that ranks of one host that made different calls
raise MismatchedCollective at once instead of waiting on two transports;
a hierarchical call goes on with the round between hosts and its verdict
before any data moves. A failure anywhere aborts the world transport and
the host's shared memory with the same error, so every rank raises it.

Prepared calls are off here (every call takes the full path: the check
must run). The hooks it uses of the communicator's execution: ``_choose``,
``_remember``, ``_refuse``, ``_empty``, ``_root_verdict`` and
``_tell_abort``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from ..communicator import Communicator
from ..context import CallContext
from ..errors import BadArgument, CollectiveError
from ..ops import OPS, Op
from ..planning import ROOTED, Plan, Planner
from ..registry import Algorithm, algorithm as flat_algorithm
from ..selection import rule
from ..signature import NO_SIG, algorithm_code
from . import agreement
from .checks import RECORD_WORDS, masked
from .group import GroupView
from .selection import Chooser
from .table import algorithms_for
from .topology import Topology

__all__ = ["HierarchicalCommunicator"]

#: The capability hierarchical algorithms "need": no transport offers it, so nothing else runs them.
HIERARCHY = "hierarchy"


class _Planner(Planner):
    """The communicator's planner, with the hierarchical algorithms beside
    the flat ones, and every flat one run after the host's local check."""

    def __init__(self, comm: "HierarchicalCommunicator") -> None:
        super().__init__(comm.rank, comm.size, comm.transport, comm._choose)
        self._comm = comm

    def pick(self, collective: str, name: str, nbytes: int, dtype: np.dtype) -> Algorithm:
        if isinstance(name, str) and name == "auto":
            name = self.choose(collective, nbytes, dtype)
        if isinstance(name, str):
            algo = self._algorithms.get((collective, name))
            if algo is not None:
                return algo
            spec = algorithms_for(collective).get(name)
            if spec is not None:
                algo = Algorithm(collective, name, functools.partial(self._comm._run_hierarchical, spec),
                                 frozenset({HIERARCHY}), spec.description)
                self._algorithms[(collective, name)] = algo
                return algo
        flat = super().pick(collective, name, nbytes, dtype)
        algo = Algorithm(collective, flat.name, functools.partial(self._comm._run_flat, flat.func), flat.needs,
                         flat.description)
        self._algorithms[(collective, flat.name)] = algo
        return algo


def _hierarchical(plan: Plan) -> bool:
    return HIERARCHY in plan.algo.needs


class HierarchicalCommunicator(Communicator):
    """A communicator over several hosts, some with several ranks (see the module docstring).

    Args:
        transport: the world transport, open.
        topology: where every rank runs (the same on every rank).
        host: the host's ranks (:class:`~.host.SharedHost` or :class:`~.host.SoloHost`).
        params: the cost models' parameters (the same on every rank).
        Others as :class:`~collectives.Communicator`.
    """

    def __init__(self, transport: Any, topology: Topology, host: Any, params: Any, **kwargs: Any) -> None:
        super().__init__(transport, **kwargs)
        self._topology = topology
        self.host = host
        self._chooser = Chooser(topology, params)
        self._planner = _Planner(self)
        self.record = np.zeros(RECORD_WORDS, np.uint64)
        self.records = np.zeros(topology.local_size * RECORD_WORDS, np.uint64)
        self.tag = 1
        self._sig = NO_SIG
        self._checked = -1
        self._views: dict[tuple[int, ...], GroupView] = {}
        self._own: dict[Any, np.ndarray] = {}
        self._cross_scratch: dict = {}

    @property
    def topology(self) -> Topology:
        """Where every rank runs: hosts, local ranks, node indices (see :class:`~.topology.Topology`)."""
        return self._topology

    def __repr__(self) -> str:
        t = self._topology
        return (f"HierarchicalCommunicator(rank={self.rank}, size={self.size}, transport={self.transport.name!r}, "
                f"hosts={t.shape()}, node={t.node}, local_rank={t.local_rank}, local_size={t.local_size})")

    def explain(self, collective: str, nbytes: int, dtype: Any = np.float32) -> Any:
        """Why ``auto`` picks what it picks for ``collective`` of ``nbytes`` here
        (a :class:`~collectives.cost_models.hierarchy.HierExplanation`; ``.table()`` prints it)."""
        dt = np.dtype(dtype)
        flat = self._selector.choose(collective, nbytes, self.size, dt, self._capabilities)
        found = self._chooser.explain(collective, nbytes, dt, [flat])
        return dataclasses.replace(found, hosts=self._topology.describe())

    # ------------------------------------------------------------ choosing

    def _choose(self, collective: str, nbytes: int, dtype: np.dtype) -> str:
        return self._chooser.choose(collective, nbytes, dtype, super()._choose(collective, nbytes, dtype))

    def _remember(self, *args: Any, **kwargs: Any) -> None:
        """No prepared calls: every call runs the host's check first."""

    # ------------------------------------------------------------ running

    def _begin(self, ctx: CallContext) -> None:
        self.tag, self._sig = ctx.tag, ctx.sig
        self.host.begin(ctx.deadline)

    def _local_check(self, ctx: CallContext, refusal: str | None = None) -> None:
        """The host's check of a flat call, once per call."""
        if self._checked != ctx.tag:
            self._checked = ctx.tag
            self._begin(ctx)
            agreement.local_check(self, ctx.sig, refusal)

    def _run_flat(self, func: Callable, ctx: CallContext, *args: Any) -> None:
        self._local_check(ctx)
        self._checked = -1  # the next call checks again, whatever its tag
        func(ctx, *args)

    def _run_hierarchical(self, spec: Any, ctx: CallContext, *args: Any) -> None:
        self._begin(ctx)
        try:
            spec.func(self, ctx, *args)
        except CollectiveError as exc:
            raise self._named(exc, spec.collective) from None

    def _named(self, exc: CollectiveError, collective: str) -> CollectiveError:
        """``exc`` with the hierarchical algorithms' signature codes replaced by their names."""
        if exc.args:
            text = str(exc.args[0])
            for name in [*algorithms_for(collective), agreement.CHECK]:
                text = text.replace(f"(#{algorithm_code(name)})", f"({name})")
            exc.args = (text,) + tuple(exc.args[1:])
        return exc

    def _refuse(self, ctx: CallContext, plan: Plan) -> None:
        if _hierarchical(plan):  # every rank learns of it in the check, and raises it alike
            self._begin(ctx)
            agreement.check(self, ctx.sig, plan.refusal)
            raise BadArgument(f"rank {self.rank}: {plan.refusal}")
        if not (plan.collective in ROOTED and plan.root == self.rank and not plan.algo.needs):
            self._local_check(ctx, plan.refusal)
        super()._refuse(ctx, plan)

    def _empty(self, ctx: CallContext, plan: Plan) -> None:
        if _hierarchical(plan):
            self._begin(ctx)
            agreement.check(self, ctx.sig, None)
            return
        self._local_check(ctx)
        super()._empty(ctx, plan)

    def _root_verdict(self, ctx: CallContext, plan: Plan) -> None:
        self._local_check(ctx, plan.refusal)
        super()._root_verdict(ctx, plan)

    def _tell_abort(self, reason: str, seq: int) -> None:
        super()._tell_abort(reason, seq)
        self.host.abort(reason)

    def close(self) -> None:
        """Finish queued work, release the world transport and the host's shared memory (idempotent)."""
        try:
            super().close()
        finally:
            self.host.close()

    def alloc(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """An uninitialized array in the host's shared memory where it has some
        (the intra-host phases then read it without a copy)."""
        comm = getattr(self.host, "comm", None)
        if comm is None:
            return super().alloc(shape, dtype)
        return comm.alloc(shape, dtype)

    empty = alloc

    # --------------------------------------------- what the algorithms use

    def view(self, slot: int) -> GroupView:
        """The world ranks driving ``slot`` (local rank ``slot`` of every host) as a transport."""
        return self.group(self._topology.group(slot))

    def group(self, members: tuple[int, ...]) -> GroupView:
        """World ranks ``members`` as a transport (ranks 0..k-1)."""
        view = self._views.get(members)
        if view is None:
            view = self._views[members] = GroupView(self.transport, members)
        return view

    def cross(self, members: tuple[int, ...]) -> CallContext:
        """The current call's context over the group ``members``: its tag, deadline and signature."""
        return CallContext(self.group(members), self.tag, self.host.deadline, self.segment_bytes,
                           self._cross_scratch, masked(self._sig) if self._sig != NO_SIG else NO_SIG)

    def flat(self, collective: str, nbytes: int, p: int, itemsize: int) -> Callable:
        """The flat algorithm the default rule runs for ``p`` ranks (a phase between hosts)."""
        return flat_algorithm(collective, rule(collective, nbytes, p, itemsize, frozenset())).func

    def scratch(self, slot: Any, count: int, dtype: Any) -> np.ndarray:
        """Reusable memory of ``count`` elements of ``dtype``, one array per ``slot``
        (valid until the next call asks for the same slot)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._own.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._own[slot] = np.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes].view(dtype)

    @staticmethod
    def sum_of(op: Op) -> Op:
        """The op the phases reduce with: ``avg`` sums (the communicator divides once, at the end)."""
        return OPS["sum"] if op.name == "avg" else op
