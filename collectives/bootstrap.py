"""Exchanges of init, before any collective call: rank 0 hears from every
rank and answers, or tells every rank what it knows.

They use point-to-point messages on reserved even tags (the images of the
highest user tags, which nothing can send before init returns), so that
they take no sequence number: a job's first collective is still call #1.
Each message is its length, then its bytes.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .execution import TAG_SPACE
from .transport import Transport

__all__ = ["gather_and_answer", "from_rank_zero", "DISCOVERY_TAG", "AGREEMENT_TAG", "PROFILE_TAG"]

#: Where ranks run (collectives.hierarchy.discovery).
DISCOVERY_TAG = 2 * (TAG_SPACE - 1)
#: Whether every host could open its shared memory.
AGREEMENT_TAG = 2 * (TAG_SPACE - 2)
#: Rank 0's calibration profile, which every rank's ``auto`` uses.
PROFILE_TAG = 2 * (TAG_SPACE - 3)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-6)


def _send(t: Transport, data: bytes, peer: int, tag: int) -> list:
    """Start sending ``data`` to ``peer``: its length, then its bytes."""
    length = np.array([len(data)], np.uint64)
    body = np.frombuffer(data, np.uint8).copy() if data else np.zeros(0, np.uint8)
    return [t.isend(length, peer, tag), t.isend(body, peer, tag)]


def _receive(t: Transport, peer: int, tag: int, deadline: float) -> bytes:
    length = np.zeros(1, np.uint64)
    t.irecv(length, peer, tag).wait(_left(deadline))
    body = np.empty(int(length[0]), np.uint8)
    t.irecv(body, peer, tag).wait(_left(deadline))
    return body.tobytes()


def _finish(sends: list, deadline: float) -> None:
    for s in sends:
        s.wait(_left(deadline))


def gather_and_answer(t: Transport, mine: bytes, answer: Callable[[list[bytes]], bytes], tag: int,
                      deadline: float) -> bytes:
    """Rank 0 gathers every rank's bytes and sends every rank ``answer(all)``;
    every rank returns that answer.

    Raises:
        CollectiveTimeout, PeerLost: a rank did not take part by ``deadline``, or died.
    """
    if t.rank != 0:
        sends = _send(t, mine, 0, tag)
        reply = _receive(t, 0, tag, deadline)
        _finish(sends, deadline)
        return reply
    everyone = [mine] + [_receive(t, r, tag, deadline) for r in range(1, t.size)]
    reply = answer(everyone)
    _finish([s for r in range(1, t.size) for s in _send(t, reply, r, tag)], deadline)
    return reply


def from_rank_zero(t: Transport, data: Callable[[], bytes], tag: int, deadline: float) -> bytes:
    """Rank 0's ``data()`` on every rank, passed down a binomial tree (log2 p
    message times; only rank 0 calls ``data``).

    Raises:
        CollectiveTimeout, PeerLost: as :func:`gather_and_answer`.
    """
    rank, size = t.rank, t.size
    got = data() if rank == 0 else b""
    mask = 1
    while mask < size:  # receive from the parent: the rank with this rank's lowest set bit cleared
        if rank & mask:
            got = _receive(t, rank - mask, tag, deadline)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:  # send to the children below that bit
        if rank + mask < size:
            sends += _send(t, got, rank + mask, tag)
        mask >>= 1
    _finish(sends, deadline)
    return got
