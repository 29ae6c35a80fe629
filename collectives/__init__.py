"""Collective communication for Python: many algorithms, many transports.

Quick start::

    import numpy as np, collectives
    comm = collectives.init()              # from the launcher's environment
    x = np.ones(1024, np.float32)
    comm.allreduce(x, op="sum")            # in place

Run ``collectives run -n 4 script.py`` to start four local ranks.
"""

from .communicator import Communicator
from .environment import detect_launch, init
from .errors import (
    BadArgument,
    CollectiveError,
    CollectiveTimeout,
    MismatchedCollective,
    PeerLost,
    TransportUnavailable,
)
from .handles import Handle
from .ops import OPS, Op, get_op
from .registry import COLLECTIVES, algorithms_for, all_algorithms, transport_names

__all__ = [
    "init",
    "Communicator",
    "Handle",
    "Op",
    "OPS",
    "get_op",
    "COLLECTIVES",
    "algorithms_for",
    "all_algorithms",
    "transport_names",
    "detect_launch",
    "CollectiveError",
    "BadArgument",
    "CollectiveTimeout",
    "PeerLost",
    "MismatchedCollective",
    "TransportUnavailable",
]

__version__ = "0.1.0"
