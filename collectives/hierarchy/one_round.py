"""``hierarchical_one_round``: small messages in one round between hosts.

Every rank's data rides along with its record in the host's local check
(inline up to :data:`~.checks.INLINE_BYTES`, else in a second local
allgather once the host agreed), so every rank of a host holds all of
the host's data and makes the host's *contribution* (its sum, its blocks,
the root's data) alike. The drivers of every slot then send their host's
summary and contribution straight to the other hosts' drivers of the same
slot in one round (:func:`~.agreement.cross_round`): every slot carries the
same data, so no rank waits for another slot, and every rank holds every
host's contribution. After the verdict (nothing is written before it),
each rank makes its result from them in node order: every rank gets the
same bits.

Latency: one local allgather and one message time between hosts, against
at least two rounds for a hierarchical algorithm with phases (its check
and its data) and log2 p rounds for a flat one. The round carries every
host's contribution to every host, so it is for small messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import compiled
from ..arithmetic import byte_view, prefix
from ..ops import Op
from . import agreement
from .checks import INLINE_BYTES, inline
from .table import ONE_ROUND, hierarchical

if TYPE_CHECKING:
    from .communicator import HierarchicalCommunicator

__all__ = ["one_round"]

_EMPTY = np.zeros(0, np.uint8)


def one_round(h: "HierarchicalCommunicator", ctx, payload: np.ndarray, local_counts: Sequence[int],
              contribute: Callable[[list[np.ndarray]], np.ndarray],
              expected: Callable[[int], int]) -> list[np.ndarray]:
    """Gather the host's payloads (``local_counts``: bytes of each local
    rank's), make the host's contribution with ``contribute(payloads)``,
    exchange contributions between hosts, raise the verdict, and return every
    host's contribution (node order; ``expected(node)``: its bytes)."""
    local = agreement.local_check(h, ctx.sig, None, payload)
    contribution = None
    if not local.refusals:
        if max(local_counts, default=0) <= INLINE_BYTES:
            payloads = [inline(row, int(c)) for row, c in zip(local.records, local_counts)]
        else:  # the host agreed on the call: every local rank takes part in this allgather
            joined = h.scratch("one_round", sum(local_counts), np.uint8)
            h.host.allgatherv(payload, joined, local_counts)
            bounds = prefix(local_counts)
            payloads = [joined[bounds[i]:bounds[i + 1]] for i in range(len(local_counts))]
        contribution = contribute(payloads)
    rnd = agreement.cross_round(h, ctx.sig, local, contribution)
    agreement.verdict(h, ctx.sig, rnd, expected)
    return rnd.data


def _reduced(h: "HierarchicalCommunicator", parts: list[np.ndarray], dtype: np.dtype, op: Op,
             slot: str) -> np.ndarray:
    """``parts`` (bytes) reduced in order, as bytes."""
    n = parts[0].nbytes // dtype.itemsize
    out = h.scratch(slot, n, dtype)
    h.sum_of(op).reduce_many(out, [p.view(dtype) for p in parts])
    return out.view(np.uint8)


def _sum_contribution(h, dtype: np.dtype, op: Op) -> Callable[[list[np.ndarray]], np.ndarray]:
    return lambda parts: _reduced(h, parts, dtype, op, "one_round.host")


def _reduce_all(h, ctx, buf: np.ndarray, op: Op) -> list[np.ndarray]:
    n, L = buf.nbytes, h.topology.local_size
    return one_round(h, ctx, byte_view(buf), [n] * L, _sum_contribution(h, buf.dtype, op), lambda j: n)


@hierarchical("allreduce", ONE_ROUND, "local allgather with the check; host sums in one round between hosts")
def allreduce(h, ctx, buf: np.ndarray, op: Op) -> None:
    data = _reduce_all(h, ctx, buf, op)
    h.sum_of(op).reduce_many(buf, [d.view(buf.dtype) for d in data])


@hierarchical("reduce", ONE_ROUND, "local allgather with the check; host sums in one round between hosts")
def reduce(h, ctx, buf: np.ndarray, root: int, op: Op) -> None:
    data = _reduce_all(h, ctx, buf, op)
    if h.rank == root:
        h.sum_of(op).reduce_many(buf, [d.view(buf.dtype) for d in data])


@hierarchical("reduce_scatter", ONE_ROUND, "local allgather with the check; host sums in one round between hosts")
def reduce_scatter(h, ctx, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], op: Op) -> None:
    n, L = send.nbytes, h.topology.local_size
    data = one_round(h, ctx, byte_view(send), [n] * L, _sum_contribution(h, send.dtype, op), lambda j: n)
    lo = prefix(counts)[h.rank]
    parts = [d.view(send.dtype)[lo:lo + recv.size] for d in data]
    if recv.size:
        h.sum_of(op).reduce_many(recv, parts)


def _from_root(h, ctx, mine: np.ndarray | None, n: int, root: int) -> np.ndarray:
    """The root's ``n`` bytes (``mine`` on the root) on every rank, in one round from the root's host."""
    t = h.topology
    h0, l0 = t.where(root)
    counts = [n if (t.node == h0 and i == l0) else 0 for i in range(t.local_size)]
    got = one_round(h, ctx, byte_view(mine), counts, lambda parts: parts[l0] if t.node == h0 else _EMPTY,
                    lambda j: n if j == h0 else 0)
    return got[h0]


@hierarchical("bcast", ONE_ROUND, "the root's data with the check; one round from the root's host")
def bcast(h, ctx, buf: np.ndarray, root: int) -> None:
    got = _from_root(h, ctx, buf if h.rank == root else None, buf.nbytes, root)
    if h.rank != root and buf.size:
        compiled.copy(buf.view(np.uint8), got)


@hierarchical("scatter", ONE_ROUND, "the root's data with the check; one round from the root's host")
def scatter(h, ctx, send: np.ndarray | None, recv: np.ndarray, root: int, counts: Sequence[int]) -> None:
    item = recv.itemsize
    got = _from_root(h, ctx, send if h.rank == root else None, sum(counts) * item, root)
    lo = prefix(counts)[h.rank] * item
    if recv.size:
        compiled.copy(recv.view(np.uint8), got[lo:lo + recv.nbytes])


def _blocks_everywhere(h, ctx, mine: np.ndarray, counts: Sequence[int], item: int) -> list[np.ndarray]:
    """Every host's blocks (its ranks' blocks in local order, as bytes), on every rank."""
    t = h.topology
    host_bytes = [sum(int(counts[r]) for r in ranks) * item for ranks in t.hosts]
    local = [int(counts[r]) * item for r in t.local_ranks]
    return one_round(h, ctx, byte_view(mine), local, lambda parts: np.concatenate(parts) if parts else _EMPTY,
                     lambda j: host_bytes[j])


def _place(h, data: list[np.ndarray], counts: Sequence[int], out: np.ndarray) -> None:
    """Every host's blocks into ``out`` in world rank order."""
    displs = prefix(counts)
    for j, ranks in enumerate(h.topology.hosts):
        at = 0
        part = data[j].view(out.dtype) if data[j].nbytes else data[j]
        for r in ranks:
            c = int(counts[r])
            if c:
                compiled.copy(out[displs[r]:displs[r] + c], part[at:at + c])
            at += c


@hierarchical("allgather", ONE_ROUND, "local allgather with the check; host blocks in one round between hosts")
def allgather(h, ctx, buf: np.ndarray, counts: Sequence[int]) -> None:
    lo = prefix(counts)[h.rank]
    data = _blocks_everywhere(h, ctx, buf[lo:lo + counts[h.rank]], counts, buf.itemsize)
    _place(h, data, counts, buf)


@hierarchical("gather", ONE_ROUND, "local allgather with the check; host blocks in one round between hosts")
def gather(h, ctx, send: np.ndarray, recv: np.ndarray | None, root: int, counts: Sequence[int]) -> None:
    data = _blocks_everywhere(h, ctx, send, counts, send.itemsize)
    if h.rank == root:
        _place(h, data, counts, recv)


@hierarchical("alltoall", ONE_ROUND, "every sendbuf with the check; host sendbufs in one round between hosts")
def alltoall(h, ctx, send: np.ndarray, recv: np.ndarray) -> None:
    t, p = h.topology, h.size
    b = send.size // p
    n = send.nbytes
    data = one_round(h, ctx, byte_view(send), [n] * t.local_size,
                     lambda parts: np.concatenate(parts) if parts else _EMPTY, lambda j: n * len(t.hosts[j]))
    me = h.rank
    for j, ranks in enumerate(t.hosts):
        whole = data[j].view(send.dtype) if data[j].nbytes else data[j]
        for i, r in enumerate(ranks):
            if b:
                compiled.copy(recv[r * b:(r + 1) * b], whole[i * p * b + me * b:i * p * b + (me + 1) * b])
