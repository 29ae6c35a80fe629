"""Alpha-beta-gamma cost models, one module per collective (installed as ``collectives.cost_models``).

Each algorithm of ``collectives.algorithms`` has a formula of the same
(collective, name) here (see :mod:`.model`); :mod:`.calibrate` measures the
parameters on a live transport, :mod:`.selector` chooses the algorithm with
the least predicted time and :mod:`.explain` says why.
"""

from __future__ import annotations

import importlib

from .model import MODELS, CostModel, Params, cost_model, predict

__all__ = ["MODELS", "CostModel", "Params", "cost_model", "predict", "FORMULA_MODULES"]

#: The modules that register formulas (one per collective, plus the window
#: package, itself one module per collective, and the native ones).
FORMULA_MODULES = ("bcast", "scatter", "gather", "allgather", "reduce", "allreduce",
                   "reduce_scatter", "alltoall", "barrier", "window", "native")

_loaded = False


def _load() -> None:
    """Import every formula module once (registration happens on import)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in FORMULA_MODULES:
            importlib.import_module(f"{__name__}.{name}")
