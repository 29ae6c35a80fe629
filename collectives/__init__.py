"""Collective communication for Python: many algorithms, many transports.

Quick start::

    import numpy as np, collectives
    comm = collectives.init()              # from the launcher's environment
    x = np.ones(1024, np.float32)
    comm.allreduce(x, op="sum")            # in place

Run ``collectives run -n 4 script.py`` to start four local ranks.
"""

import importlib
from typing import Any


def _load() -> None:
    """Import the public names (and, with the communicator, every algorithm,
    which registers itself) into this package."""
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

    globals().update({k: v for k, v in locals().items() if k in __all__})


def __getattr__(name: str) -> Any:
    # The public names load on first use, so that the launcher (``collectives
    # run``), which needs none of them, starts without importing numpy and
    # every algorithm (0.4 s per process). Any other name is a submodule.
    if name in __all__:
        _load()
        return globals()[name]
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
