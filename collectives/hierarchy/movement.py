"""``hierarchical`` bcast, allgather, gather and scatter.

* bcast: the root's host broadcasts within itself; slot s then broadcasts
  slice s across hosts (every slot at once, over its own connections) and
  every other host puts the slices together (an allgather within the host).
* allgather: blocks by slot (see :mod:`.layout`): on uneven hosts each slot's
  driver first gathers the blocks of the ranks it serves; each slot
  allgathers its blocks across hosts; an allgather within the host gives
  every rank every slot's, and a copy puts them in world order.
* gather, scatter: one leader per host (the root on its own host, local
  rank 0 elsewhere): a gather (scatter) within each host to (from) its
  leader, and one between the leaders. Everything goes to or comes from
  the root's host, so more connections would not help the root's link.
  Where ranks run host after host (``Topology.contiguous``), the root's
  buffer is gathered into (scattered from) in place.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..arithmetic import prefix
from . import agreement
from .layout import blocks, from_order, host_order, local_counts, slot_parts, to_order
from .table import SLICED, hierarchical

__all__ = ["bcast", "allgather", "gather", "scatter"]


@hierarchical("bcast", SLICED, "bcast within the root's host, each slot's slice across hosts, allgather within "
              "the other hosts")
def bcast(h, ctx, buf: np.ndarray, root: int) -> None:
    agreement.check(h, ctx.sig, None)
    t = h.topology
    h0, l0 = t.where(root)
    if t.node == h0:
        h.host.bcast(buf, l0)
    counts = blocks(buf.size, t.slices) + [0] * (t.local_size - t.slices)
    lo = prefix(counts)[t.local_rank]
    mine = buf[lo:lo + counts[t.local_rank]]
    if t.local_rank < t.slices and t.nhosts > 1 and mine.size:
        cross = h.cross(t.group(t.local_rank))
        h.flat("bcast", mine.nbytes, t.nhosts, buf.itemsize)(cross, mine, h0)
    if t.node != h0:
        h.host.allgatherv(None, buf, counts)


@hierarchical("allgather", SLICED, "blocks by slot: (gathered to their slot's driver,) allgathered across hosts "
              "per slot, allgathered within hosts")
def allgather(h, ctx, buf: np.ndarray, counts: Sequence[int]) -> None:
    agreement.check(h, ctx.sig, None)
    t = h.topology
    m, l = t.slices, t.local_rank
    parts = [slot_parts(t, counts, s) for s in range(m)]
    totals = [sum(p) for p in parts]
    starts = prefix(totals)
    ordered = h.scratch("ag.ordered", sum(totals), buf.dtype)
    mine = buf[prefix(counts)[h.rank]:][:counts[h.rank]]
    _collect(h, ordered, starts, parts, mine, counts)
    if l < m and t.nhosts > 1 and totals[l]:
        cross = h.cross(t.group(l))
        h.flat("allgather", totals[l] * buf.itemsize, t.nhosts, buf.itemsize)(
            cross, ordered[starts[l]:starts[l + 1]], parts[l])
    h.host.allgatherv(None, ordered, totals + [0] * (t.local_size - m))
    from_order(ordered, counts, t.slot_order(), buf)


def _collect(h, ordered: np.ndarray, starts: list[int], parts: list[list[int]], mine: np.ndarray,
             counts: Sequence[int]) -> None:
    """Put the blocks of the ranks each slot's driver serves on this host into its part of ``ordered``."""
    t = h.topology
    l = t.local_rank
    if not t.uneven:
        at = starts[l] + sum(parts[l][:t.node])
        compiled.copy(ordered[at:at + mine.size], mine)
        return
    for s in range(t.slices):
        at = starts[s] + sum(parts[s][:t.node])
        gcounts = [int(counts[r]) if t.slot_of(i) == s else 0 for i, r in enumerate(t.local_ranks)]
        part = ordered[at:at + parts[s][t.node]] if l == s else None
        h.host.gatherv(mine if t.slot_of(l) == s else mine[:0], part, gcounts, s)


def _leaders(h, root: int) -> tuple[tuple[int, ...], int, int]:
    """(every host's leader, the root's node, this host's leader's local rank)."""
    t = h.topology
    h0, l0 = t.where(root)
    leaders = tuple(ranks[l0 if j == h0 else 0] for j, ranks in enumerate(t.hosts))
    return leaders, h0, (l0 if t.node == h0 else 0)


def _rooted(h, root: int, counts: Sequence[int]) -> tuple:
    """What a gather or scatter through the leaders needs: (the leaders, the
    root's host, the local rank leading each host, elements per host,
    whether this rank is the root, whether it leads its host)."""
    t = h.topology
    leaders, h0, lead = _leaders(h, root)
    hosts = [sum(int(counts[r]) for r in ranks) for ranks in t.hosts]
    return leaders, h0, lead, hosts, h.rank == root, t.local_rank == lead


@hierarchical("gather", SLICED, "gather within each host to its leader, then between the leaders to the root")
def gather(h, ctx, send: np.ndarray, recv: np.ndarray | None, root: int, counts: Sequence[int]) -> None:
    agreement.check(h, ctx.sig, None)
    t = h.topology
    leaders, h0, lead, hosts, is_root, leading = _rooted(h, root, counts)
    whole = None
    if is_root:
        whole = recv if t.contiguous else h.scratch("gather.whole", sum(hosts), send.dtype)
    mine = None
    if leading:
        at = prefix(hosts)[t.node]
        mine = whole[at:at + hosts[t.node]] if is_root else h.scratch("gather.host", hosts[t.node], send.dtype)
    h.host.gatherv(send, mine, local_counts(t, counts), lead)
    if leading and t.nhosts > 1:
        cross = h.cross(leaders)
        h.flat("gather", sum(hosts) * send.itemsize, t.nhosts, send.itemsize)(cross, mine, whole, h0, hosts)
    if is_root and not t.contiguous:
        from_order(whole, counts, host_order(t), recv)


@hierarchical("scatter", SLICED, "scatter between the leaders from the root, then within each host from its leader")
def scatter(h, ctx, send: np.ndarray | None, recv: np.ndarray, root: int, counts: Sequence[int]) -> None:
    agreement.check(h, ctx.sig, None)
    t = h.topology
    leaders, h0, lead, hosts, is_root, leading = _rooted(h, root, counts)
    whole = None
    if is_root:
        if t.contiguous:
            whole = send
        else:
            whole = h.scratch("scatter.whole", sum(hosts), recv.dtype)
            to_order(send, counts, host_order(t), whole)
    mine = h.scratch("scatter.host", hosts[t.node], recv.dtype) if leading else None
    if leading and t.nhosts > 1:
        cross = h.cross(leaders)
        h.flat("scatter", sum(hosts) * recv.itemsize, t.nhosts, recv.itemsize)(cross, whole, mine, h0, hosts)
    elif leading:
        compiled.copy(mine, whole)
    h.host.scatterv(mine, recv, local_counts(t, counts), lead)
