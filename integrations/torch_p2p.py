"""Point-to-point calls of the torch backend: send, recv, and receiving from any source.

Receiving from any source (``dist.recv(t)`` without ``src``, ``irecv``):
the transports match messages by sender and tag and cannot cancel a
receive, so every ``send`` of this backend is preceded by a zero-byte
notice to the same rank on a tag of its own (``2**25 + tag``). A receive
from any source keeps one notice receive posted per peer and takes the
first that completes; a named receive takes the next notice from its
sender. Notices are taken in the order receives were posted, per sender
and tag, so a named receive and one from any source never take each
other's message. The cost: one more (empty) message per send, one more
receive per ``recv``; a receive from any source polls its peers' notices
(spinning, then yielding, then sleeping up to a millisecond).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from collectives import Communicator
from collectives.errors import BadArgument
from collectives.waiting import wait_until

from .torch_tensors import Staged, as_numpy, check_cpu, mark_written
from .torch_work import CollectivesWork

__all__ = ["TAG_LIMIT", "NOTICE_TAG_BASE", "MONITORED_TAG_BASE", "user_tag", "Notices",
           "PointToPoint"]

#: The backend's tag space. Tags of send/recv: [0, 2**25). Their notices
#: (see the module's docstring) travel on 2**25 + tag, monitored barriers
#: (:mod:`.torch_monitored`) on 2**26 + 2**25 + two tags per call.
TAG_LIMIT = 1 << 25
NOTICE_TAG_BASE = 1 << 25
MONITORED_TAG_BASE = (1 << 26) + (1 << 25)  # monitored barriers: two tags per call
_NOTICE = np.empty(0, np.uint8)


def user_tag(tag: Any) -> int:
    """A send/recv tag, checked: an integer in [0, 2**25)."""
    if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < TAG_LIMIT:
        raise BadArgument(f"the collectives backend takes send/recv tags in [0, {TAG_LIMIT}), got {tag!r}")
    return int(tag)


class Notices:
    """The notices that precede every message of the backend (see the module's
    docstring), received per sender and tag in the order receives ask for them.

    Every method is called holding the group's post lock.

    Args:
        comm: the group's communicator.
        timeout: the group's timeout (of the notices' receives), seconds.
    """

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self._comm = comm
        self._timeout = timeout
        self._posted: dict[tuple[int, int], collections.deque] = {}

    def _post(self, peer: int, tag: int) -> Any:
        return self._comm.irecv(_NOTICE, peer, NOTICE_TAG_BASE + tag, timeout=self._timeout)

    def take(self, peer: int, tag: int) -> Any:
        """The next notice from ``peer`` with ``tag`` (a receive posted earlier
        and not taken yet, or a new one)."""
        queue = self._posted.get((peer, tag))
        if queue:
            return queue.popleft()
        return self._post(peer, tag)

    def heads(self, tag: int) -> dict[int, Any]:
        """The next notice with ``tag`` from every peer, posting one where none is."""
        heads = {}
        for peer in range(self._comm.size):
            if peer == self._comm.rank:
                continue
            queue = self._posted.setdefault((peer, tag), collections.deque())
            if not queue:
                queue.append(self._post(peer, tag))
            heads[peer] = queue[0]
        return heads

    def claim(self, peer: int, tag: int, head: Any) -> bool:
        """Take ``head`` if it is still the next notice from ``peer`` with ``tag``."""
        queue = self._posted.get((peer, tag))
        if queue and queue[0] is head:
            queue.popleft()
            return True
        return False


class PointToPoint:
    """The process group's ``send``, ``recv`` and ``recv_anysource`` (a part of
    :class:`~.torch_backend.CollectivesProcessGroup`, whose ``comm``, ``_lock``,
    ``_notices``, ``_p2p_work``, ``_fail``, ``_finish`` and ``_in_thread`` they use)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """``dist.send``/``isend`` to group rank ``dst`` (a notice, then the tensor)."""
        check_cpu(tensors)
        tag, dst = user_tag(tag), int(dst)
        src = Staged.readable(tensors[0])

        def start() -> list[Any]:
            notice = self.comm.isend(_NOTICE, dst, NOTICE_TAG_BASE + tag, timeout=self.timeout)
            return [notice, self.comm.isend(as_numpy(src), dst, tag, timeout=self.timeout)]

        return self._p2p(f"send to rank {dst}", "send", tensors, start, peer=("Dst Rank", dst))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` from group rank ``src`` (its notice, then the tensor)."""
        check_cpu(tensors)
        tag, src = user_tag(tag), int(src)
        staged = Staged()
        buf = staged.writable(tensors[0])
        mark_written(tensors)

        def start() -> list[Any]:
            if not 0 <= src < self.size() or src == self.rank():
                raise BadArgument(f"recv: rank {src} is not a peer of rank {self.rank()} "
                                  f"in a group of {self.size()}")
            notice = self._notices.take(src, tag)
            return [notice, self.comm.irecv(as_numpy(buf), src, tag, timeout=self.timeout)]

        return self._p2p(f"recv from rank {src}", "recv", tensors, start, staged.finisher, source_rank=src,
                         peer=("Src Rank", src))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``dist.recv``/``irecv`` without ``src``: from whichever peer's message
        with ``tag`` comes first (``work._source_rank()`` names it)."""
        check_cpu(tensors)
        tag = user_tag(tag)
        staged = Staged()
        buf = staged.writable(tensors[0])
        mark_written(tensors)
        with self._lock:
            work = self._p2p_work(f"recv from any source (tag {tag})", "recvAnySource", tensors)

        def receive() -> None:
            work.set_source_rank(self._receive_from_any(as_numpy(buf), tag))

        return self._in_thread(work, receive, staged.finisher)

    def _receive_from_any(self, buf: np.ndarray, tag: int) -> int:
        """Receive into ``buf`` the message with ``tag`` of whichever peer's notice
        arrives first; return that peer."""
        deadline = time.monotonic() + self.timeout
        what = f"Timed out: rank {self.rank()}: recv from any source (tag {tag}) after {self.timeout:.3g}s"
        while True:
            with self._lock:
                heads = self._notices.heads(tag)
            wait_until(lambda: any(h.done() for h in heads.values()), deadline, what=what)
            with self._lock:
                for peer, head in heads.items():
                    if head.done() and self._notices.claim(peer, tag, head):
                        payload = self.comm.irecv(buf, peer, tag, timeout=max(deadline - time.monotonic(), 0.01))
                        break
                else:  # a named receive took that notice first
                    continue
            payload.wait()
            return peer

    def _p2p(self, what: str, event: str, tensors: list[torch.Tensor], start: Callable[[], list[Any]],
             finish: Callable[[], None] | None = None, source_rank: int | None = None,
             peer: tuple[str, int] | None = None) -> dist.Work:
        """Point-to-point requests as one Work; a thread waits for them unless they are done already."""
        work: CollectivesWork | None = None
        try:
            with self._lock:
                work = self._p2p_work(what, event, tensors, source_rank, peer)
                requests = start()
        except BadArgument as exc:
            if work is not None:
                work.complete(exc)
            raise
        except BaseException as exc:
            work = work if work is not None else CollectivesWork(tensors, what, self.comm.rank)
            self._fail(work, exc)
            return work
        try:
            done = all(r.done() for r in requests)
        except BaseException as exc:
            self._fail(work, exc)
            return work
        if not done:
            return self._in_thread(work, lambda: [r.wait() for r in requests], finish)
        self._finish(work, finish)
        return work
