"""Hierarchical communicators: shared memory within hosts, the job's transport between them.

* :mod:`.topology`: host identity and the job's :class:`~.topology.Topology`;
* :mod:`.discovery`: the exchanges of init (who runs where);
* :mod:`.build`: what ``collectives.init()`` returns (:func:`~.build.communicator_for`);
* :mod:`.communicator`: :class:`~.communicator.HierarchicalCommunicator`;
* :mod:`.host`: the intra-host phases (a shared-memory communicator per host);
* :mod:`.group`: groups of world ranks as transports (the phases between hosts);
* :mod:`.checks`, :mod:`.agreement`: the check every call starts with;
* :mod:`.table`: the hierarchical algorithms by name; :mod:`.one_round`,
  :mod:`.reduction`, :mod:`.movement`, :mod:`.alltoall`: the algorithms;
  :mod:`.layout`: where blocks go;
* :mod:`.selection`: ``auto`` by the cost models (:mod:`collectives.cost_models.hierarchy`).

See docs/hierarchy.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HierarchicalCommunicator", "Topology", "communicator_for", "algorithms_for"]

_LAZY = {"HierarchicalCommunicator": ".communicator", "Topology": ".topology", "communicator_for": ".build",
         "algorithms_for": ".table"}


def __getattr__(name: str) -> Any:
    """The package's names, imported when first used (the cost models import its checks)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)
