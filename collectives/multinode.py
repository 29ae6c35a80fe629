"""``collectives run --nnodes N``: one launcher per node, one job.

Every node runs ``collectives run --nnodes N --node-rank R --master-addr
HOST --master-port PORT -n K script.py``. The launchers meet
(:mod:`collectives.node_rendezvous`): node 0 assigns the global ranks in
node order, the job id and, unless the user gave one, the job secret. Each
launcher then starts its ranks with the environment
:func:`collectives.init` reads (``COLLECTIVES_LOCAL=0``: the transport is
TCP or RDMA) and torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``: node 0's address and the port of the
transports' rendezvous, not the launchers').

While the job runs, the launchers stay connected to node 0's:

* a rank that fails on any node stops every node's ranks (unless
  ``on_failure="continue"``); so does a launcher's ``--timeout`` (124), a
  stop signal to any launcher (128 + N), a node whose ranks cannot start
  (127, 126), and a launcher that is gone (1: its connection closed, or TCP
  keepalive found its host unreachable, in about 30 s);
* node 0 decides the job's status: the first failure it learns of (a rank
  killed by signal N: 128 + N), or 0 once every node's ranks succeeded; it
  tells every node, and every launcher exits with that status;
* with ``continue``, failures are reported and the job's status is the
  first failure's once every rank on every node has ended.

A rendezvous that fails (a node that never arrives, a wrong secret) ends
every launcher that took part with status 1 and a message naming the
missing nodes; no rank is started.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time
from typing import Sequence

from . import config
from .launcher import (GRACE_SECONDS, POLL_SECONDS, _describe_end, _record_stop_signals, _returncode,
                       _signal_name, rank_cpus, rank_environment, run_processes, shell_status)
from .node_link import Link, close_links
from .node_rendezvous import Assignment, NodeSpec, RendezvousError, join, serve

__all__ = ["launch_nodes", "node_environments"]

#: how long a node that reported a failure waits for node 0's verdict before it exits on its own
VERDICT_SECONDS = 2 * GRACE_SECONDS + 5.0
#: how long node 0 waits, after its verdict, for the other launchers to close their connections
CLOSE_SECONDS = 2.0


def _say(message: str) -> None:
    sys.stderr.write(f"collectives run: {message}\n")
    sys.stderr.flush()


def node_environments(assignment: Assignment, transport: str | None = None,
                      base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each of this node's ranks, in local rank order."""
    a = assignment
    return [rank_environment(rank, a.size, job=a.job, secret=a.secret, master_port=a.master_port,
                             transport=transport, base=base, local_rank=i, local_size=a.nprocs,
                             node_rank=a.node_rank, nnodes=a.nnodes, master_addr=a.master_addr)
            for i, rank in enumerate(a.ranks)]


def launch_nodes(command: Sequence[str], nprocs: int, *, nnodes: int, node_rank: int, master_addr: str,
                 master_port: int, join_timeout: float = 300.0, transport: str | None = None,
                 prefix: bool = True, timeout: float | None = None, bind: str | None = None,
                 on_failure: str = "stop", secret: str | None = None) -> int:
    """This node's part of a job over ``nnodes`` nodes; returns the job's exit status.

    Args:
        command, nprocs, transport, prefix, timeout, bind, on_failure: as
            :func:`collectives.launcher.launch`, for this node's ranks
            (``nprocs`` may differ from node to node).
        nnodes: the number of nodes (launchers), at least 2.
        node_rank: this node's index, 0 to ``nnodes - 1``; node 0 serves the
            rendezvous.
        master_addr, master_port: where node 0's launcher listens.
        join_timeout: seconds for every node to join.
        secret: the job secret, the same on every node (default
            ``COLLECTIVES_SECRET``); None: node 0 generates one and sends it.

    Returns:
        The status node 0 decided, the same on every node (see the module
        docstring); 1 if the nodes could not meet; 128 + N if this launcher
        got signal N before the ranks started.
    """
    _check_arguments(nprocs, nnodes, node_rank, master_port, on_failure)
    secret = secret if secret is not None else (config.get("SECRET") or None)
    spec = NodeSpec(nnodes, node_rank, master_addr, master_port, nprocs, join_timeout, secret)
    cpus = rank_cpus(nprocs, bind)
    received, restore = _record_stop_signals()
    try:
        try:
            session = _Coordinator(spec, received) if node_rank == 0 else _Member(spec, received)
        except RendezvousError as exc:
            _say(f"node {node_rank}: {exc}")
            return exc.status
        a = session.assignment
        mine = f"ranks {a.ranks[0]} to {a.ranks[-1]}" if a.nprocs > 1 else f"rank {a.ranks[0]}"
        _say(f"node {node_rank} of {nnodes} ({spec.host}): {mine} of {a.size}, job {a.job}")
        try:
            status = run_processes(command, node_environments(a, transport), list(a.ranks), cpus, prefix,
                                   lambda procs: session.supervise(procs, timeout, on_failure))
            return session.finish(status)
        finally:
            session.close()
    finally:
        restore()


def _check_arguments(nprocs: int, nnodes: int, node_rank: int, master_port: int, on_failure: str) -> None:
    if nprocs < 1:
        raise ValueError("nprocs must be >= 1")
    if nnodes < 2:
        raise ValueError(f"nnodes must be >= 2 for a job over several nodes, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is not one of 0 to {nnodes - 1}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master port {master_port} is not a TCP port")
    if on_failure not in ("stop", "continue"):
        raise ValueError(f"on_failure must be 'stop' or 'continue', got {on_failure!r}")


class _Session:
    """What both kinds of node do: watch the local ranks and the links."""

    def __init__(self, spec: NodeSpec, received: list[int]) -> None:
        self.spec, self.received = spec, received
        self.assignment: Assignment
        self.verdict: tuple[int, str] | None = None  # (status, why), once known

    def _stopped(self) -> int | None:
        return self.received[0] if self.received else None

    def _local(self, procs: Sequence[subprocess.Popen]) -> tuple[list[tuple[int, int]], bool]:
        """This node's ranks that failed ((global rank, return code)), and whether all ended."""
        codes = [_returncode(p) for p in procs]
        ranks = self.assignment.ranks
        return [(ranks[i], c) for i, c in enumerate(codes) if c not in (None, 0)], None not in codes

    def _rank_end(self, rank: int, code: int) -> str:
        return f"rank {rank} on {self.assignment.node_name(self.spec.node_rank)} {_describe_end(code)}"

    def _links(self) -> list[Link]:
        raise NotImplementedError

    def _pause(self) -> None:
        """Wait for a message, at most one poll interval."""
        links = [link for link in self._links() if not link.closed]
        if links:
            select.select(links, [], [], POLL_SECONDS)
        else:
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        close_links(self._links(), CLOSE_SECONDS)


class _Coordinator(_Session):
    """Node 0: decides the job's status and tells every node."""

    def __init__(self, spec: NodeSpec, received: list[int]) -> None:
        super().__init__(spec, received)
        self.assignment, self.links = serve(spec, self._stopped)
        self.done = [False] * spec.nnodes
        self.failures: list[tuple[int, str]] = []  # (status, why), in the order node 0 learnt them

    def _links(self) -> list[Link]:
        return self.links

    def supervise(self, procs: Sequence[subprocess.Popen], timeout: float | None, on_failure: str) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        told: set[int] = set()
        while True:
            if self.received:
                return self._decide(128 + self.received[0], f"node 0's launcher got {_signal_name(self.received[0])}")
            failed, ended = self._local(procs)
            for rank, code in failed:
                if rank not in told:
                    told.add(rank)
                    if on_failure == "stop":
                        return self._decide(shell_status(code), self._rank_end(rank, code))
                    self._note_failure(shell_status(code), self._rank_end(rank, code))
            self.done[0] = ended
            decided = self._read_links(on_failure)
            if decided is not None:
                return decided
            if all(self.done):
                if not self.failures:
                    return self._decide(0, "every rank succeeded")
                status, why = self.failures[0]
                count = len(self.failures)
                return self._decide(status, f"{count} rank{'s' if count > 1 else ''} failed, the first: {why}")
            if deadline is not None and time.monotonic() > deadline:
                return self._decide(124, f"timeout after {timeout:g}s on node 0")
            self._pause()

    def _note_failure(self, status: int, why: str) -> None:
        self.failures.append((status, why))
        _say(f"{why}; the other ranks go on (--on-failure continue)")

    def _read_links(self, on_failure: str) -> int | None:
        """Handle what the other nodes said; the status if that ends the job."""
        for node, link in enumerate(self.links, start=1):
            for m in link.receive():
                kind, status, why = m.get("type"), m.get("status"), str(m.get("why", ""))
                if type(status) is not int:
                    continue
                if kind == "stop":
                    return self._decide(status, why)
                if kind == "failed":
                    self._note_failure(status, why)
                elif kind == "done":
                    self.done[node] = True
            if link.closed and not self.done[node]:
                return self._decide(1, f"the launcher of {self.assignment.node_name(node)} is gone "
                                       "(its connection closed" + (" after garbage)" if link.garbled else ")"))
        return None

    def _decide(self, status: int, why: str) -> int:
        """The job's end: tell every node, say why here."""
        self.verdict = (status, why)
        for link in self.links:
            link.send({"type": "end", "status": status, "why": why})
        if status:
            _say(f"{why}; the job ends with status {status}")
        return status

    def finish(self, status: int) -> int:
        """The job's status once this node's ranks are stopped (``status``:
        what :func:`run_processes` returned)."""
        if self.verdict is None:  # this node's ranks could not start
            self._decide(status, f"{self.assignment.node_name(0)} could not start its ranks")
        return self.verdict[0]


class _Member(_Session):
    """Node 1 and up: reports to node 0 and follows its verdict."""

    def __init__(self, spec: NodeSpec, received: list[int]) -> None:
        super().__init__(spec, received)
        self.assignment, self.link = join(spec, self._stopped)
        self.reported: tuple[int, str] | None = None  # what this node asked node 0 to stop for

    def _links(self) -> list[Link]:
        return [self.link]

    def supervise(self, procs: Sequence[subprocess.Popen], timeout: float | None, on_failure: str) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        me = self.assignment.node_name(self.spec.node_rank)
        told: set[int] = set()
        sent_done = False
        while True:
            if self.received:
                return self._report(128 + self.received[0], f"the launcher of {me} got "
                                    f"{_signal_name(self.received[0])}")
            failed, ended = self._local(procs)
            for rank, code in failed:
                if rank not in told:
                    told.add(rank)
                    if on_failure == "stop":
                        return self._report(shell_status(code), self._rank_end(rank, code))
                    self.link.send({"type": "failed", "status": shell_status(code), "why": self._rank_end(rank, code)})
            if ended and not sent_done:
                sent_done = True
                self.link.send({"type": "done", "status": shell_status(failed[0][1]) if failed else 0})
            verdict = self._read_verdict()
            if verdict is not None:
                return verdict
            if deadline is not None and time.monotonic() > deadline:
                return self._report(124, f"timeout after {timeout:g}s on {me}")
            self._pause()

    def _report(self, status: int, why: str) -> int:
        """Ask node 0 to end the job (this node's ranks are stopped next)."""
        self.reported = (status, why)
        self.link.send({"type": "stop", "status": status, "why": why})
        _say(f"{why}; asking every node to stop")
        return status

    def _read_verdict(self) -> int | None:
        for m in self.link.receive():
            if m.get("type") == "end" and type(m.get("status")) is int:
                self.verdict = (m["status"], str(m.get("why", "")))
                if self.verdict[0] and self.reported is None:
                    _say(f"{self.verdict[1]}; the job ends with status {self.verdict[0]}")
                return self.verdict[0]
        if self.link.closed:
            self.verdict = (1, f"lost node 0's launcher at {self.spec.where} (its connection closed)")
            _say(f"{self.verdict[1]}; stopping the ranks of this node")
            return 1
        return None

    def finish(self, status: int) -> int:
        """The job's status once this node's ranks are stopped: node 0's
        verdict, waited for at most :data:`VERDICT_SECONDS` after this node
        reported a failure (its own status if none comes)."""
        if self.verdict is not None:
            return self.verdict[0]
        if self.reported is None:  # the ranks could not start
            self._report(status, f"{self.assignment.node_name(self.spec.node_rank)} could not start its ranks")
        end = time.monotonic() + VERDICT_SECONDS
        while time.monotonic() < end:
            verdict = self._read_verdict()
            if verdict is not None:
                return verdict
            self._pause()
        _say(f"node 0's launcher did not answer within {VERDICT_SECONDS:g}s; exiting with this node's status")
        return status
