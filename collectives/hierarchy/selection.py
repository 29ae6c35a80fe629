"""``algorithm="auto"`` on a hierarchical communicator: flat or hierarchical, by the cost models.

The flat selector (the communicator's ``selector``) names the flat
algorithm it would run; :class:`Chooser` prices it and every hierarchical
algorithm of the collective on the job's topology
(:mod:`collectives.cost_models.hierarchy`) and takes the fastest. Decisions
are cached per (collective, size bucket, element size, flat choice) and
made on the bucket's least size, with the parameters rank 0 sent at init,
so every rank decides alike.
"""

from __future__ import annotations

import logging

import numpy as np

from ..cost_models.hierarchy import HierParams, Shape, choose, explain_hier, HierExplanation
from ..selection import bucket_floor, size_bucket
from .topology import Topology

__all__ = ["Chooser"]

_log = logging.getLogger("collectives.select")


class Chooser:
    """Chooses between the flat selector's algorithm and the hierarchical ones.

    Args:
        topology: the job's topology.
        params: parameters within and between hosts (the same on every rank).
    """

    def __init__(self, topology: Topology, params: HierParams) -> None:
        self.shape = Shape(topology.sizes)
        self.params = params
        self.rank = topology.rank
        self._cache: dict[tuple, str] = {}

    def choose(self, collective: str, nbytes: int, dtype: np.dtype, flat: str) -> str:
        """``flat`` or the name of the hierarchical algorithm to run."""
        key = (collective, size_bucket(nbytes), np.dtype(dtype).itemsize, flat)
        name = self._cache.get(key)
        if name is None:
            name = choose(collective, bucket_floor(key[1]), self.shape, self.params, flat, dtype)
            self._cache[key] = name
            if _log.isEnabledFor(logging.INFO):
                _log.info("rank %d: auto chose %s for %s of %d B on hosts %s (flat choice: %s)", self.rank, name,
                          collective, nbytes, self.shape, flat)
        return name

    def explain(self, collective: str, nbytes: int, dtype: np.dtype, flat: list[str]) -> HierExplanation:
        """Every candidate's predicted time on this job's topology."""
        return explain_hier(collective, nbytes, self.shape, self.params, flat, dtype)
