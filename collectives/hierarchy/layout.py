"""Where blocks go: slices, block offsets and the orders phases carry blocks in.

World buffers hold blocks in world rank order. The phases between hosts
carry them in *slot order* (:meth:`~.topology.Topology.slot_order`: slot by
slot, and within a slot host by host) or in *host order* (host by host,
each in local order), so the hierarchical algorithms copy blocks between
those orders with :func:`to_order` and :func:`from_order`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import compiled
from ..arithmetic import prefix
from .topology import Topology

__all__ = ["blocks", "to_order", "from_order", "host_order", "slot_parts", "local_counts"]


def blocks(n: int, parts: int) -> list[int]:
    """``n`` elements in ``parts`` blocks differing by at most one (the larger first)."""
    q, r = divmod(int(n), parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def host_order(topo: Topology) -> list[int]:
    """World ranks host by host, each host's in local order."""
    return [r for h in topo.hosts for r in h]


def to_order(src: np.ndarray, counts: Sequence[int], order: Sequence[int], out: np.ndarray) -> None:
    """Copy the blocks of ``src`` (world rank order, ``counts``) into ``out`` in ``order``."""
    displs = prefix(counts)
    at = 0
    for r in order:
        c = int(counts[r])
        if c:
            compiled.copy(out[at:at + c], src[displs[r]:displs[r] + c])
        at += c


def from_order(src: np.ndarray, counts: Sequence[int], order: Sequence[int], out: np.ndarray) -> None:
    """Copy the blocks of ``src`` (in ``order``) into ``out`` in world rank order."""
    displs = prefix(counts)
    at = 0
    for r in order:
        c = int(counts[r])
        if c:
            compiled.copy(out[displs[r]:displs[r] + c], src[at:at + c])
        at += c


def slot_parts(topo: Topology, counts: Sequence[int], slot: int) -> list[int]:
    """Elements each host's part of ``slot`` holds: the blocks of its ranks that slot's driver serves."""
    return [sum(int(counts[h[l]]) for l in topo.dependents(j, slot)) for j, h in enumerate(topo.hosts)]


def local_counts(topo: Topology, counts: Sequence[int]) -> list[int]:
    """Each local rank's block (world ``counts`` of this host's ranks)."""
    return [int(counts[r]) for r in topo.local_ranks]
