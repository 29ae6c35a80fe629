"""The exchanges of init, before any collective call: who runs where, and
whether every host could open its shared memory.

They use point-to-point messages on two reserved even tags over the world
transport, so that they take no sequence number: the job's first collective
call is still call #1. Rank 0 gathers every rank's record and answers every
rank with all of them (and with the cost-model parameters every rank must
use alike, since ``auto`` must choose alike everywhere).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import numpy as np

from ..execution import TAG_SPACE
from ..transport import Transport
from .topology import Topology, host_cores, host_identity

__all__ = ["discover", "all_agree", "DISCOVERY_TAG", "AGREEMENT_TAG"]

#: Point-to-point tags (even) of the init exchanges: the last two a user's tag can map to.
DISCOVERY_TAG = 2 * (TAG_SPACE - 1)
AGREEMENT_TAG = 2 * (TAG_SPACE - 2)


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


def _gather_and_answer(t: Transport, mine: bytes, answer: Callable[[list[bytes]], bytes], tag: int,
                       deadline: float) -> bytes:
    """Rank 0 gathers every rank's bytes and sends every rank ``answer(all)``; every rank returns that answer."""
    if t.rank != 0:
        sends = _send(t, mine, 0, tag)
        reply = _receive(t, 0, tag, deadline)
        for s in sends:
            s.wait(_left(deadline))
        return reply
    everyone = [mine] + [_receive(t, r, tag, deadline) for r in range(1, t.size)]
    reply = answer(everyone)
    sends = [s for r in range(1, t.size) for s in _send(t, reply, r, tag)]
    for s in sends:
        s.wait(_left(deadline))
    return reply


def discover(t: Transport, timeout: float, params: Callable[[], dict[str, Any]]) -> tuple[Topology, dict]:
    """Every rank's host, and rank 0's ``params()`` (see the module docstring).

    Raises:
        CollectiveTimeout, PeerLost: a rank did not take part in time, or died.
    """
    deadline = time.monotonic() + timeout
    ident, name = host_identity()
    mine = json.dumps({"id": ident, "name": name, "cores": host_cores()}).encode()

    def answer(everyone: list[bytes]) -> bytes:
        return json.dumps({"records": [json.loads(b) for b in everyone], "params": params()}).encode()

    reply = json.loads(_gather_and_answer(t, mine, answer, DISCOVERY_TAG, deadline))
    return Topology.from_records(reply["records"], t.rank), reply["params"]


def all_agree(t: Transport, ok: bool, timeout: float) -> bool:
    """Whether ``ok`` holds on every rank (the same answer everywhere)."""
    deadline = time.monotonic() + timeout
    reply = _gather_and_answer(t, b"1" if ok else b"0", lambda everyone: b"1" if all(b == b"1" for b in everyone)
                               else b"0", AGREEMENT_TAG, deadline)
    return reply == b"1"
