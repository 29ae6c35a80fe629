"""``hierarchical`` allreduce, reduce and reduce_scatter: slices driven by every slot.

With m the smallest host's ranks (:attr:`~.topology.Topology.slices`), the
buffer is cut into m slices. Within each host a reduce-scatter leaves
slice s, reduced over the host, on local rank s; the m slots then reduce
their slices across hosts at once, each over its own connections (local
rank s of every host); within each host an allgather (or, for reduce, a
gather on the root's host) puts the slices together. Every slot drives
its own slice, so every link and core of a host works. On uneven hosts the
ranks above m hand their data to the slots in the reduce-scatter and get
the result back in the allgather: they take no part between hosts.

reduce_scatter carries blocks in *slot order* (see :mod:`.layout`): slot s
carries the blocks of the ranks it serves on every host (local ranks s,
s + m, ...), reduces them across hosts with a reduce-scatter among its
drivers, and, on uneven hosts, scatters them to the ranks it serves.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..ops import Op
from . import agreement
from .layout import blocks, slot_parts, to_order
from .table import SLICED, hierarchical

__all__ = ["allreduce", "reduce", "reduce_scatter"]


def _slices(h, n: int) -> list[int]:
    """Each local rank's slice of ``n`` elements (none beyond the m slots)."""
    t = h.topology
    return blocks(n, t.slices) + [0] * (t.local_size - t.slices)


def _reduce_slices(h, buf: np.ndarray, op: Op) -> tuple[np.ndarray, list[int]]:
    """This rank's slice of ``buf`` reduced over its host (a reduce-scatter within the host)."""
    counts = _slices(h, buf.size)
    mine = h.scratch("slice", counts[h.topology.local_rank], buf.dtype)
    h.host.reduce_scatterv(buf, mine, counts, h.sum_of(op))
    return mine, counts


def _across(h, collective: str, arr: np.ndarray, *args) -> None:
    """Run the flat ``collective`` on ``arr`` among this rank's slot's drivers (one per host)."""
    t = h.topology
    if t.local_rank < t.slices and t.nhosts > 1 and arr.size:
        ctx = h.cross(t.group(t.local_rank))
        h.flat(collective, arr.nbytes, t.nhosts, arr.itemsize)(ctx, arr, *args)


@hierarchical("allreduce", SLICED, "reduce-scatter within hosts, each slot's slice allreduced across hosts, "
              "allgather within hosts")
def allreduce(h, ctx, buf: np.ndarray, op: Op) -> None:
    agreement.check(h, ctx.sig, None)
    mine, counts = _reduce_slices(h, buf, op)
    _across(h, "allreduce", mine, h.sum_of(op))
    h.host.allgatherv(mine, buf, counts)


@hierarchical("reduce", SLICED, "reduce-scatter within hosts, each slot's slice reduced to the root's host, "
              "gather to the root")
def reduce(h, ctx, buf: np.ndarray, root: int, op: Op) -> None:
    agreement.check(h, ctx.sig, None)
    t = h.topology
    h0, l0 = t.where(root)
    mine, counts = _reduce_slices(h, buf, op)
    _across(h, "reduce", mine, h0, h.sum_of(op))
    if t.node == h0:
        h.host.gatherv(mine, buf if t.local_rank == l0 else None, counts, l0)


@hierarchical("reduce_scatter", SLICED, "blocks by slot: reduce-scatter within hosts, each slot's blocks "
              "reduce-scattered across hosts (then scattered to the ranks a slot serves)")
def reduce_scatter(h, ctx, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: Op) -> None:
    agreement.check(h, ctx.sig, None)
    t, sop = h.topology, h.sum_of(op)
    m, l = t.slices, t.local_rank
    ordered = h.scratch("rs.ordered", send.size, send.dtype)
    to_order(send, counts, t.slot_order(), ordered)
    parts = [slot_parts(t, counts, s) for s in range(m)]  # per slot, each host's elements
    totals = [sum(p) for p in parts]
    mine = h.scratch("rs.slot", totals[l] if l < m else 0, send.dtype)
    h.host.reduce_scatterv(ordered, mine, totals + [0] * (t.local_size - m), sop)
    served = recv
    if l < m:
        served = recv if not t.uneven else h.scratch("rs.served", parts[l][t.node], send.dtype)
        if t.nhosts > 1:
            cross = h.cross(t.group(l))
            h.flat("reduce_scatter", mine.nbytes, t.nhosts, send.itemsize)(cross, mine, served, parts[l], sop)
        else:
            compiled.copy(served, mine)
    if t.uneven:
        _serve(h, served, recv, counts)


def _serve(h, served: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
    """On uneven hosts: each slot's driver scatters the blocks it holds to the local ranks it serves."""
    t = h.topology
    l, m = t.local_rank, t.slices
    nothing = recv[:0]
    for s in range(m):
        mine_in_s = t.slot_of(l) == s
        scounts = [int(counts[r]) if t.slot_of(i) == s else 0 for i, r in enumerate(t.local_ranks)]
        h.host.scatterv(served if l == s else None, recv if mine_in_s else nothing, scounts, s)
