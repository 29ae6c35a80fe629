"""The check every call of a hierarchical communicator starts with.

* :func:`local_check`: the host's ranks allgather their records
  (:mod:`.checks`) through shared memory. Ranks of one host that made
  different calls raise :class:`~collectives.errors.MismatchedCollective`
  at once, every one of them alike, naming world ranks; so do a flat and a
  hierarchical call on one host, which would otherwise wait for messages
  on different transports. For a flat call that is all (refusals are the
  flat call's business: the root's verdict, or the refusing rank's abort).
* :func:`cross_round`: in a hierarchical call, the drivers of each slot
  (local rank s of every host) send their host's summary, and the data a
  one-round algorithm carries, straight to the other hosts' drivers of the
  same slot, in one round; hosts with more ranks than the smallest pass
  what their drivers received on to the others through shared memory. Every
  rank then holds every host's summary and comes to the same verdict
  (:func:`verdict`): a refusal anywhere is BadArgument on every rank, in
  this call, with nothing written; differing hosts are MismatchedCollective.

The messages between hosts carry the call's sequence number and collective
with the algorithm :data:`~.table.CHECK` (not the call's own signature, in
which a refusing rank's count may differ): a rank that made another
collective, or is running a flat algorithm of this call, fails them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import signature
from ..errors import MismatchedCollective
from ..signature import REFUSED, Sig
from .checks import (INLINE_BYTES, RECORD_WORDS, SUMMARY_WORDS, Summary, describe, inline, masked, mismatch,
                     record_refusal, record_sig, refusal_error, write_record)
from .table import CHECK

if TYPE_CHECKING:
    from .communicator import HierarchicalCommunicator

__all__ = ["Local", "Round", "local_check", "cross_round", "verdict", "check", "groups_of"]


@dataclass
class Local:
    """The outcome of a local check.

    Attributes:
        records: every local rank's record (uint64, local size x RECORD_WORDS).
        refusals: (world rank, reason) of the host's refusing ranks, lowest first.
        sig: the host's signature: its lowest non-refusing rank's (refusal mark cleared).
    """

    records: np.ndarray
    refusals: list[tuple[int, str]]
    sig: Sig


@dataclass
class Round:
    """What every rank holds after the round between hosts.

    Attributes:
        summaries: every host's summary words (hosts x SUMMARY_WORDS).
        data: every host's data, in node order (empty arrays where none).
    """

    summaries: np.ndarray
    data: list[np.ndarray]

    def summary(self, node: int) -> Summary:
        return Summary(self.summaries[node])


def local_check(h: "HierarchicalCommunicator", sig: Sig, refusal: str | None,
                payload: np.ndarray | None = None) -> Local:
    """Allgather the host's records (``payload`` inline where it fits) and
    raise the host's verdict (see the module docstring)."""
    rec, recs = h.record, h.records
    write_record(rec, sig, refusal)
    if payload is not None and payload.nbytes <= INLINE_BYTES:
        inline(rec, payload.nbytes)[:] = payload
    h.host.allgather(rec, recs)
    table = recs.reshape(-1, RECORD_WORDS)
    members = h.topology.local_ranks
    sigs = [record_sig(row) for row in table]
    refusals = [(members[i], record_refusal(row)) for i, row in enumerate(table) if sigs[i][0] & REFUSED]
    if not refusals:  # a refusal comes first: the refusing rank's other fields may differ because of it
        err = mismatch(groups_of(members, sigs))
        if err is not None:
            raise err
    agreeing = [s for s in sigs if not s[0] & REFUSED] or sigs
    return Local(table, refusals, masked(agreeing[0]))


def _check_sig(ctx_sig: Sig) -> Sig:
    """The signature of the round's messages: the call's number and collective, algorithm CHECK."""
    f = signature.fields(ctx_sig, {})
    return signature.with_seq(signature.make(f["collective"], CHECK), f["seq"])


def _exchange(h: "HierarchicalCommunicator", ctx_sig: Sig, summaries: np.ndarray,
              data: list[np.ndarray]) -> None:
    """This rank's slot: send the host's summary and data to every other host's driver; receive theirs."""
    topo, view = h.topology, h.view(h.topology.local_rank)
    me, tag, sig = topo.node, h.tag, _check_sig(ctx_sig)
    others = [j for j in range(topo.nhosts) if j != me]
    recvs = {j: view.irecv(summaries[j], j, tag, sig) for j in others}
    sends = [view.isend(summaries[me], j, tag, sig) for j in others]
    if data[me].nbytes:
        sends += [view.isend(data[me], j, tag, sig) for j in others]
    arrived = []
    for j in others:
        recvs[j].wait(h.host.left())
        n = Summary(summaries[j]).nbytes
        data[j] = np.empty(n, np.uint8)
        if n:
            arrived.append(view.irecv(data[j], j, tag, sig))
    view.waitall(arrived + sends, h.host.left())


def _pass_on(h: "HierarchicalCommunicator", summaries: np.ndarray, data: list[np.ndarray]) -> None:
    """On a host with more ranks than the smallest: driver 0 hands what it
    received to every local rank (the summaries, then the data)."""
    host = h.host
    host.bcast(summaries.reshape(-1), 0)
    sizes = [Summary(summaries[j]).nbytes for j in range(len(data))]
    if sum(sizes):
        joined = np.empty(sum(sizes), np.uint8)
        if h.topology.local_rank == 0:
            np.concatenate(data, out=joined)
        host.bcast(joined, 0)
        bounds = np.cumsum([0] + sizes)
        for j in range(len(data)):
            data[j] = joined[bounds[j]:bounds[j + 1]]


def cross_round(h: "HierarchicalCommunicator", ctx_sig: Sig, local: Local,
                contribution: np.ndarray | None = None) -> Round:
    """The round between hosts (see the module docstring): every rank returns every host's summary and data."""
    topo = h.topology
    summaries = np.zeros((topo.nhosts, SUMMARY_WORDS), np.uint64)
    data = [np.zeros(0, np.uint8) for _ in range(topo.nhosts)]
    if not local.refusals and contribution is not None:
        data[topo.node] = contribution
    Summary(summaries[topo.node]).fill(local.refusals, local.sig, data[topo.node].nbytes)
    if topo.local_rank < topo.slices and topo.nhosts > 1:
        _exchange(h, ctx_sig, summaries, data)
    if topo.local_size > topo.slices:
        _pass_on(h, summaries, data)
    return Round(summaries, data)


def verdict(h: "HierarchicalCommunicator", sig: Sig, rnd: Round,
            expected: Callable[[int], int] | None = None) -> None:
    """Raise the call's verdict from every host's summary (the same on every
    rank): a refusal anywhere, hosts that differ, or (``expected(node)``:
    the bytes each host's data must hold) data of the wrong size."""
    topo = h.topology
    hosts = [rnd.summary(j) for j in range(topo.nhosts)]
    count = sum(s.refused for s in hosts)
    if count:
        raise refusal_error(sig, [s.first for s in hosts if s.refused], count)
    err = mismatch([(topo.hosts[j], s.sig) for j, s in enumerate(hosts)])
    if err is not None:
        raise err
    if expected is not None:
        for j in range(topo.nhosts):
            if rnd.data[j].nbytes != expected(j):
                raise MismatchedCollective(f"{describe(sig)}: host {topo.names[j]} (node {j}) sent "
                                           f"{rnd.data[j].nbytes} bytes, {expected(j)} expected")


def check(h: "HierarchicalCommunicator", sig: Sig, refusal: str | None) -> None:
    """The whole check of a hierarchical call without data: local, between hosts, verdict."""
    local = local_check(h, sig, refusal)
    verdict(h, sig, cross_round(h, sig, local))


def groups_of(members: Sequence[int], sigs: Sequence[Sig]) -> list[tuple[list[int], Sig]]:
    """World ranks grouped by signature (for verdict texts)."""
    groups: dict[Sig, list[int]] = {}
    for r, s in zip(members, sigs):
        groups.setdefault(masked(s), []).append(r)
    return [(ranks, s) for s, ranks in groups.items()]
