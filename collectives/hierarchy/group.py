"""A group of the world's ranks, seen as a transport of its own.

The phases of a hierarchical call that cross hosts run ordinary message
algorithms among a few of the world's ranks (local rank s of every host,
or one leader per host). :class:`GroupView` gives those algorithms ranks
0..k-1 and maps them to world ranks on the world transport: no second
rendezvous, no connection of its own. Its messages are the hierarchical
call's own: the world call's tag and signature, so they keep their order
with every other message of the call between the same two ranks, and the
world transport checks them as it checks any.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..signature import NO_SIG, Sig
from ..transport import Request, Transport

__all__ = ["GroupView"]


class GroupView(Transport):
    """Ranks ``members`` of ``world`` as ranks 0..len(members)-1.

    Args:
        world: the world transport (this rank must be a member).
        members: world ranks, in the group's rank order.
    """

    name = "group"
    capabilities = frozenset()

    def __init__(self, world: Transport, members: Sequence[int]) -> None:
        self._world = world
        self.members = tuple(members)
        self.rank = self.members.index(world.rank)
        self.size = len(self.members)
        self.released_on_delivery = world.released_on_delivery
        self.receives_ahead = world.receives_ahead
        self.timeout = world.timeout

    @classmethod
    def open(cls, rank: int, size: int, *, job: str, timeout: float, options: dict[str, Any]) -> "GroupView":
        raise NotImplementedError("a group view is made over an open transport, never opened")

    def isend(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        return self._world.isend(buf, self.members[peer], tag, sig)

    def irecv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG) -> Request:
        return self._world.irecv(buf, self.members[peer], tag, sig)

    def send(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG, timeout: float | None = None) -> None:
        self._world.send(buf, self.members[peer], tag, sig, timeout)

    def recv(self, buf: np.ndarray, peer: int, tag: int, sig: Sig = NO_SIG, timeout: float | None = None) -> None:
        self._world.recv(buf, self.members[peer], tag, sig, timeout)

    def irecv_reduce(self, out: np.ndarray, mine: np.ndarray, peer: int, tag: int, op: Any,
                     tmp: np.ndarray, sig: Sig = NO_SIG) -> Request:
        return self._world.irecv_reduce(out, mine, self.members[peer], tag, op, tmp, sig)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        self._world.waitall(requests, timeout)

    def abort(self, reason: str, seq: int | None = None) -> None:
        """Nothing: the hierarchical communicator aborts the world transport itself."""

    def close(self) -> None:
        """Nothing: the world transport outlives its views."""

    def __repr__(self) -> str:
        return f"GroupView(rank={self.rank}, members={list(self.members)})"
