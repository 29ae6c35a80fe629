"""Formulas of ``native`` (the transport's own collectives, e.g. MPI's).

MPICH picks among the same classic algorithms by fixed size-and-p rules
(Thakur et al. 2005), so the native collective is predicted as the
algorithm :func:`collectives.selection.rule` picks, without a shared
window. A calibration of the ``mpi`` transport gives its alpha and beta.
"""

from __future__ import annotations

from collectives.registry import COLLECTIVES
from collectives.selection import rule

from .model import MODELS, Params, cost_model


def _native(collective: str):
    def formula(p: int, n: int, P: Params) -> float:
        name = rule(collective, n, p, P.itemsize, frozenset())
        return MODELS[(collective, name)].func(p, n, P)

    formula.__doc__ = f"The {collective} algorithm MPICH's rule picks for (n, p)."
    return formula


for _c in COLLECTIVES:
    cost_model(_c, "native")(_native(_c))
