"""The hierarchical algorithms, by (collective, name).

They are kept apart from the registry of flat algorithms
(:mod:`collectives.registry`): they run only on a
:class:`~collectives.hierarchy.communicator.HierarchicalCommunicator`,
which offers them beside the flat ones (by name, and to ``auto``). A
hierarchical algorithm is ``func(h, ctx, *args)``: the hierarchical
communicator ``h``, the world call's context and the flat algorithm's
arguments (see docs/architecture.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from ..registry import COLLECTIVES, algorithms_for as flat_algorithms
from ..signature import algorithm_code

__all__ = ["HierAlgorithm", "hierarchical", "algorithms_for", "names_for", "CHECK", "ONE_ROUND", "SLICED"]

#: The algorithm named in the signature of the check's messages between hosts.
CHECK = "hierarchical_check"
#: The small-message algorithm of every collective (one round of messages between hosts).
ONE_ROUND = "hierarchical_one_round"
#: The large-message algorithm of every collective (phases over slices or leaders).
SLICED = "hierarchical"

_MODULES = ("collectives.hierarchy.one_round", "collectives.hierarchy.reduction",
            "collectives.hierarchy.movement", "collectives.hierarchy.alltoall")


@dataclass(frozen=True)
class HierAlgorithm:
    """A hierarchical algorithm.

    Attributes:
        collective, name: what it implements and the name users pass.
        func: ``func(h, ctx, *args)``.
        description: one line.
    """

    collective: str
    name: str
    func: Callable = field(compare=False)
    description: str = ""


_TABLE: dict[str, dict[str, HierAlgorithm]] = {c: {} for c in COLLECTIVES}
_loaded = False


def hierarchical(collective: str, name: str, description: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``func`` as hierarchical algorithm ``name`` of ``collective``."""
    def deco(func: Callable) -> Callable:
        clash = [n for n in flat_algorithms(collective) if algorithm_code(n) == algorithm_code(name)]
        if clash:  # signatures carry an 8-bit code of the name
            raise ValueError(f"{collective} algorithm {name!r} has the signature code of {clash[0]!r}")
        _TABLE[collective][name] = HierAlgorithm(collective, name, func, description)
        return func
    return deco


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _MODULES:
            importlib.import_module(module)


def algorithms_for(collective: str) -> dict[str, HierAlgorithm]:
    """Every hierarchical algorithm of ``collective``, by name."""
    _load()
    return _TABLE[collective]


def names_for(collective: str) -> dict[int, str]:
    """Algorithm names by signature code: the flat ones, the hierarchical ones and the check."""
    if collective not in _TABLE:
        return {}
    names = {algorithm_code(n): n for n in flat_algorithms(collective)}
    for n in [*algorithms_for(collective), CHECK]:
        names[algorithm_code(n)] = n
    return names
