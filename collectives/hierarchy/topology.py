"""Where each rank runs: hosts, local ranks and node indices.

A *host* is a set of ranks that can share memory. Its identity
(:func:`host_identity`) is ``COLLECTIVES_HOST_ID`` where set, else derived
from what decides whether two processes can map the same shared-memory
segments and watch each other's process ids:

* the kernel's boot id (``/proc/sys/kernel/random/boot_id``): another
  machine, or the same one rebooted, is another host;
* the device and inode of the ``/dev/shm`` mount: containers with a
  ``/dev/shm`` of their own cannot share segments;
* the PID namespace: the shared-memory transport watches its peers by
  process id.

The network namespace is *not* part of it: two network namespaces on one
machine that see the same ``/dev/shm`` and process ids share memory, so
their ranks form one host. Tests that play hosts with network namespaces
set ``COLLECTIVES_HOST_ID`` per namespace.

:class:`Topology` is what every rank learns at init (the same on every
rank): the hosts in node order, each with its world ranks in local order.
Hosts are ordered by their lowest world rank, local ranks by world rank.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Sequence

from .. import config

__all__ = ["Topology", "host_identity", "host_cores"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_key(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_dev}:{st.st_ino}"


def host_identity() -> tuple[str, str]:
    """(identity, display name) of this process's host (see the module docstring)."""
    override = config.get("HOST_ID")
    name = socket.gethostname()
    if override:
        return f"id:{override}", override
    boot = _read("/proc/sys/kernel/random/boot_id") or _read("/etc/machine-id") or name
    parts = [boot, _stat_key("/dev/shm"), _stat_key("/proc/self/ns/pid")]
    return "auto:" + hashlib.sha1("|".join(parts).encode()).hexdigest()[:16], name


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Topology:
    """The hosts of a job, as every rank sees them.

    Attributes:
        hosts: the world ranks of each host, hosts in node order, each in local order.
        names: each host's display name (its host name, or ``COLLECTIVES_HOST_ID``).
        cores: the cores each host's ranks may run on (the most any of them reported).
        rank: this rank (world).
    """

    hosts: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    cores: tuple[int, ...]
    rank: int

    @classmethod
    def from_records(cls, records: Sequence[dict], rank: int) -> "Topology":
        """The topology from every rank's record (``{"id", "name", "cores"}``, in world rank order)."""
        order: dict[str, list[int]] = {}
        for r, rec in enumerate(records):
            order.setdefault(rec["id"], []).append(r)
        hosts = tuple(tuple(ranks) for ranks in order.values())  # first seen = lowest rank first
        names = tuple(records[h[0]]["name"] for h in hosts)
        cores = tuple(max(int(records[r]["cores"]) for r in h) for h in hosts)
        return cls(hosts, names, cores, rank)

    # ----------------------------------------------------------- where ranks are

    @property
    def size(self) -> int:
        """Ranks in the job."""
        return sum(len(h) for h in self.hosts)

    @property
    def nhosts(self) -> int:
        """Hosts in the job."""
        return len(self.hosts)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Ranks on each host, in node order."""
        return tuple(len(h) for h in self.hosts)

    def where(self, rank: int) -> tuple[int, int]:
        """(node index, local rank) of world rank ``rank``."""
        for node, ranks in enumerate(self.hosts):
            if rank in ranks:
                return node, ranks.index(rank)
        raise ValueError(f"rank {rank} is on no host")

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self._mine[0]

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host."""
        return self._mine[1]

    @property
    def local_size(self) -> int:
        """Ranks on this rank's host."""
        return len(self.hosts[self.node])

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The world ranks of this rank's host, in local order."""
        return self.hosts[self.node]

    @property
    def _mine(self) -> tuple[int, int]:
        return self.where(self.rank)

    # ---------------------------------------------------------------- shape

    @property
    def slices(self) -> int:
        """Local ranks of every host that drive a slice across hosts: the
        smallest host's size (m). Local rank l drives slot l for l < m."""
        return min(self.sizes)

    @property
    def uneven(self) -> bool:
        """Whether some host has more ranks than the smallest."""
        return max(self.sizes) != min(self.sizes)

    @property
    def hierarchical(self) -> bool:
        """Whether ranks span several hosts and some share one."""
        return self.nhosts > 1 and max(self.sizes) > 1

    @property
    def contiguous(self) -> bool:
        """Whether world ranks run host after host in node order (rank = host's first + local rank)."""
        return [r for h in self.hosts for r in h] == list(range(self.size))

    def group(self, slot: int) -> tuple[int, ...]:
        """The world ranks driving ``slot`` (local rank ``slot`` of every host), in node order."""
        return tuple(h[slot] for h in self.hosts)

    def slot_of(self, local_rank: int) -> int:
        """The slot whose driver serves ``local_rank`` (``local_rank mod m``)."""
        return local_rank % self.slices

    def dependents(self, node: int, slot: int) -> tuple[int, ...]:
        """The local ranks of host ``node`` served by the driver of ``slot``."""
        return tuple(range(slot, len(self.hosts[node]), self.slices))

    def slot_order(self) -> list[int]:
        """World ranks ordered by (slot, node, local rank): the blocks each slot's drivers carry, slot after slot."""
        m = self.slices
        return [h[l] for s in range(m) for h in self.hosts for l in range(s, len(h), m)]

    # ------------------------------------------------------------- display

    def shape(self) -> str:
        """``2x2`` for even hosts, ``2+1`` otherwise."""
        sizes = self.sizes
        if len(set(sizes)) == 1:
            return f"{len(sizes)}x{sizes[0]}"
        return "+".join(str(s) for s in sizes)

    def describe(self) -> str:
        """Several lines: every host, its ranks and cores, and this rank's place."""
        lines = [f"{self.nhosts} hosts, {self.size} ranks ({self.shape()}); {self.slices} local rank(s) per host "
                 f"drive slices across hosts" + (" (uneven hosts: the others go through them)" if self.uneven else "")]
        for node, (ranks, name, cores) in enumerate(zip(self.hosts, self.names, self.cores)):
            lines.append(f"  node {node}: {name}, ranks {_ranges(ranks)}, {cores} cores")
        lines.append(f"  this rank: {self.rank}, node {self.node}, local rank {self.local_rank} of {self.local_size}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.shape()} (node {self.node}, local rank {self.local_rank} of {self.local_size})"


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3, 6`` for [0, 1, 2, 3, 6]."""
    out, start, prev = [], None, None
    for r in list(ranks) + [None]:
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    return ", ".join(out)
