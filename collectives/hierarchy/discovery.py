"""The exchanges of init, before any collective call: who runs where, and
whether every host could open its shared memory.

They are :mod:`collectives.bootstrap`'s exchanges over the world transport
(no sequence number taken). Rank 0 gathers every rank's record and answers every
rank with all of them (and with the cost-model parameters every rank must
use alike, since ``auto`` must choose alike everywhere).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from ..bootstrap import AGREEMENT_TAG, DISCOVERY_TAG, gather_and_answer
from ..transport import Transport
from .topology import Topology, host_cores, host_identity

__all__ = ["discover", "all_agree", "DISCOVERY_TAG", "AGREEMENT_TAG"]


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

    reply = json.loads(gather_and_answer(t, mine, answer, DISCOVERY_TAG, deadline))
    return Topology.from_records(reply["records"], t.rank), reply["params"]


def all_agree(t: Transport, ok: bool, timeout: float) -> bool:
    """Whether ``ok`` holds on every rank (the same answer everywhere)."""
    deadline = time.monotonic() + timeout
    reply = gather_and_answer(t, b"1" if ok else b"0", lambda everyone: b"1" if all(b == b"1" for b in everyone)
                               else b"0", AGREEMENT_TAG, deadline)
    return reply == b"1"
