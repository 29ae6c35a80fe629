"""The rendezvous of a Ray collective group: who is rank what, where, and how they connect.

One small asynchronous Ray actor (:class:`Rendezvous`) lives while a group
forms. Every member calls :meth:`Rendezvous.join` with its rank and
whereabouts (Ray node id, the node's address, its process id; rank 0 also a
free TCP port on its node) and waits there, without polling, until every
rank has joined or the timeout runs out. The answer is the roster: the job
id and job secret (made by whoever started the group), and every member's
whereabouts, from which each member derives the same transport: shared
memory when every member is on one Ray node, else TCP with rank 0's node
and port as the master. The actor ends when the last member has its roster
(:meth:`Rendezvous.done`), or as soon as the group fails to form: it holds
no state the group needs afterwards.

Why an actor and not Ray's internal key-value store: an actor is public
Ray API, blocks the members' reads without polling, can refuse a rank that
joins twice or a world size that disagrees at once, and is gone with its
owner (the driver, or the member that started it) so that a failed
rendezvous leaves nothing behind; the key-value store is a private module
(``ray.experimental.internal_kv``) whose keys outlive the job unless deleted.
It costs one process for the time the group takes to form.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

from collectives.errors import BadArgument, CollectiveError, CollectiveTimeout, PeerLost

__all__ = ["BACKENDS", "Rendezvous", "RendezvousAbandoned", "new_job", "whereabouts", "transport_for",
           "roster_error", "store_name"]

#: What ``backend`` may be: ``auto`` picks ``shm`` on one node, else ``zmq`` (TCP).
BACKENDS = ("auto", "shm", "zmq")


class RendezvousAbandoned(PeerLost):
    """The group's rendezvous ended before this member got its roster (another
    member failed or the creator gave up): a consequence, not a cause."""


def new_job() -> tuple[str, str]:
    """A fresh job id (names the group's shared-memory segments) and job secret."""
    return f"ray-{secrets.token_hex(6)}", secrets.token_hex(16)


def store_name(group_name: str) -> str:
    """The Ray actor name of a group's rendezvous when its members start it themselves."""
    return f"collectives.ray:{group_name}"


def whereabouts(rank: int) -> dict[str, Any]:
    """This process's place in the Ray cluster: node id and address, pid; a port on rank 0."""
    import ray

    from collectives.launcher import free_port

    host = ray.util.get_node_ip_address()
    return {"rank": rank, "node": ray.get_runtime_context().get_node_id(), "host": host, "pid": os.getpid(),
            "port": free_port(host) if rank == 0 else 0}


class Rendezvous:
    """The roster of one forming group (run as a Ray actor; see the module docstring).

    Args:
        group_name: the group's name (for messages).
        world_size: the number of members.
        job, secret: the job id and secret every member gets.
    """

    def __init__(self, group_name: str, world_size: int, job: str, secret: str) -> None:
        self._group, self._size, self._job, self._secret = group_name, world_size, job, secret
        self._members: dict[int, dict[str, Any]] = {}
        self._done: set[int] = set()
        self._complete = asyncio.Event()

    def _refusal(self, me: dict[str, Any], world_size: int) -> str | None:
        """Why ``me`` cannot join, or None."""
        rank = me["rank"]
        if world_size != self._size:
            return (f"group {self._group!r}: rank {rank} says the world has {world_size} ranks, the group "
                    f"was started with {self._size}")
        if not 0 <= rank < self._size:
            return f"group {self._group!r}: rank {rank} is not in a world of {self._size} ranks"
        other = self._members.get(rank)
        if other is not None and other["pid"] != me["pid"]:
            return (f"group {self._group!r}: rank {rank} joined twice (process {other['pid']} on node "
                    f"{other['node'][:12]}, then process {me['pid']} on node {me['node'][:12]})")
        return None

    async def join(self, me: dict[str, Any], world_size: int, timeout: float) -> dict[str, Any]:
        """Add ``me`` (see :func:`whereabouts`); wait until every rank has joined.

        Returns:
            The roster ``{"job", "secret", "members"}`` (members in rank
            order), or ``{"error": kind, "message": text}`` on a refusal
            (``BadArgument``) or a timeout (``CollectiveTimeout``).
        """
        why = self._refusal(me, world_size)
        if why is not None:
            return {"error": "BadArgument", "message": why}
        self._members[me["rank"]] = me
        if len(self._members) == self._size:
            self._complete.set()
        try:
            await asyncio.wait_for(self._complete.wait(), timeout)
        except asyncio.TimeoutError:
            missing = sorted(set(range(self._size)) - set(self._members))
            return {"error": "CollectiveTimeout",
                    "message": (f"group {self._group!r}: rank(s) {missing} of {self._size} did not join within "
                                f"{timeout:.3g} s"), "missing": missing}
        return {"job": self._job, "secret": self._secret,
                "members": [self._members[r] for r in range(self._size)]}

    async def done(self, rank: int) -> bool:
        """Note that ``rank`` has its roster; True for the last rank (it ends this actor)."""
        self._done.add(rank)
        return len(self._done) == self._size


def roster_error(group_name: str, rank: int, answer: dict[str, Any]) -> CollectiveError:
    """The error of a :meth:`Rendezvous.join` answer that carries one."""
    kind = {"BadArgument": BadArgument, "CollectiveTimeout": CollectiveTimeout}.get(answer["error"], PeerLost)
    return kind(f"rank {rank}, rendezvous of {answer['message']}")


def transport_for(backend: str, members: list[dict[str, Any]], rank: int,
                  group_name: str) -> tuple[str, dict[str, Any]]:
    """The transport name and its options for ``rank``, the same choice on every member.

    Raises:
        BadArgument: ``backend`` is ``shm`` but the members are on several nodes.
    """
    nodes = sorted({m["node"] for m in members})
    if backend == "auto":
        backend = "shm" if len(nodes) == 1 else "zmq"
    if backend == "shm" and len(nodes) > 1:
        where = {n[:12]: [m["rank"] for m in members if m["node"] == n] for n in nodes}
        raise BadArgument(f"rank {rank}, group {group_name!r}: backend 'shm' needs every member on one node; "
                          f"ranks by node: {where}; use backend 'auto' or 'zmq'")
    if backend == "shm":
        return "shm", {}
    master = members[0]
    return "zmq", {"master_addr": master["host"], "master_port": master["port"], "addr": members[rank]["host"]}
