"""The simulated machine's network: what a message costs and which resources it holds.

A message of n bytes occupies the network resources on its path for
``alpha + n * beta`` (:class:`SimParams`) from ``start = max(post time,
every resource free)``; it arrives at ``start + alpha + n * beta``.

Networks (``topology``):

* ``"full"``: fully connected; each rank one full-duplex link (an outgoing
  and an incoming port, each busy for one message at a time);
* ``"switch"``: a single shared (half-duplex) switch port per node: a
  node's sends and receives take turns on it;
* ``"mesh"``: a 2-D mesh (rows x cols as square as possible), dimension-order
  (X then Y) routing; a message holds every directed link on its path plus
  the two end ports, and pays ``hop_latency`` per hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from collectives.errors import BadArgument

__all__ = ["SimParams", "Network", "TOPOLOGIES"]

TOPOLOGIES = ("full", "switch", "mesh")


@dataclass(frozen=True)
class SimParams:
    """Network and reduction costs of a simulated machine.

    Attributes:
        alpha: seconds per message.
        beta: seconds per byte sent.
        gamma: seconds per byte reduced.
        hop_latency: extra seconds per hop on the mesh.
    """

    alpha: float = 2e-6
    beta: float = 1e-10
    gamma: float = 2.5e-10
    hop_latency: float = 0.0


class Network:
    """Resources (ports, links) and their busy-until times."""

    def __init__(self, size: int, params: SimParams, topology: str) -> None:
        if topology not in TOPOLOGIES:
            raise BadArgument(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
        self.params = params
        self.topology = topology
        self.free: dict[Any, float] = {}
        self.cols = _mesh_cols(size)

    def _path(self, src: int, dst: int) -> tuple[list[Any], int]:
        """(resources held, hops) of a message from src to dst."""
        if self.topology == "full":
            return [("out", src), ("in", dst)], 1
        if self.topology == "switch":
            return [("port", src), ("port", dst)], 1
        res: list[Any] = [("out", src), ("in", dst)]
        (r0, c0), (r1, c1) = divmod(src, self.cols), divmod(dst, self.cols)
        r, c = r0, c0
        while c != c1:
            nc = c + (1 if c1 > c else -1)
            res.append(("link", r, c, r, nc))
            c = nc
        while r != r1:
            nr = r + (1 if r1 > r else -1)
            res.append(("link", r, c, nr, c))
            r = nr
        return res, max(len(res) - 2, 1)

    def schedule(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """Reserve the path of one message posted at ``now``; return its arrival time."""
        if src == dst:
            return now
        res, hops = self._path(src, dst)
        start = max([now] + [self.free.get(r, 0.0) for r in res])
        p = self.params
        end = start + p.alpha + nbytes * p.beta + (hops - 1) * p.hop_latency
        for r in res:
            self.free[r] = end
        return end


def _mesh_cols(size: int) -> int:
    """Columns of the most nearly square mesh with ``size`` nodes (rows * cols >= size)."""
    return max(1, math.ceil(math.sqrt(size)))
