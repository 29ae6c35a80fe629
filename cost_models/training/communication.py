"""The network in the training model: links and the gradient allreduces.

Per layer, an allreduce of the layer's weight gradients among the P nodes,
MST or BKT (the paper's closed forms) or one of the library's algorithms
(its cost models), on a star or a 2-D mesh (:func:`allreduce_time`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

__all__ = ["Link", "mesh_dims", "allreduce_time", "ALLREDUCE_MODELS", "LIBRARY_ALLREDUCES", "MODEL_SETS",
           "TOPOLOGIES"]


@dataclass(frozen=True)
class Link:
    """Network parameters of the alpha-beta-gamma model.

    Attributes:
        alpha: latency per message, seconds.
        beta: seconds per byte (1 / bandwidth).
        gamma: seconds per byte reduced (the arithmetic of a reduction).
        params: the calibration profile's full cost-model parameters
            (per-message overhead, size ranges, ...) when the link came
            from one; the library's allreduce models use them.
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    params: Any = field(default=None, compare=False)

    @classmethod
    def from_rate(cls, gbits_per_s: float, latency_us: float, gamma: float = 0.0) -> "Link":
        """Link of the given bandwidth (Gb/s) and latency (microseconds)."""
        return cls(latency_us * 1e-6, 8.0 / (gbits_per_s * 1e9), gamma)

    def cost_params(self) -> Any:
        """The library's cost-model parameters
        (:class:`~collectives.cost_models.model.Params`) of this link: those
        of the calibration profile it came from (``params``), else alpha,
        beta and gamma alone. Cluster nodes are separate machines, so a
        profile's sharing of one host's cores (``cores``, ``stretch``) is
        left out."""
        from ..model import Params

        if self.params is None:
            return Params(alpha=self.alpha, beta=self.beta, gamma=self.gamma, mem_bandwidth=math.inf)
        return replace(self.params, cores=0, stretch=())


def mesh_dims(nodes: int) -> tuple[int, int]:
    """The most square ``d1 x d2 = nodes`` factorisation (d1 <= d2); primes give 1 x P."""
    d1 = max(d for d in range(1, math.isqrt(nodes) + 1) if nodes % d == 0)
    return d1, nodes // d1


def _mst(nbytes: float, dims: Sequence[int], link: Link) -> float:
    """MST allreduce = binomial-tree reduce + broadcast, per dimension.

    Chan et al. (2007): reduce ``ceil(log2 d)(alpha + n beta + n gamma)``,
    broadcast ``ceil(log2 d)(alpha + n beta)``; on a mesh each runs along
    one dimension after the other with the whole message, so the costs
    sum over the dimensions.
    """
    steps = sum(math.ceil(math.log2(d)) for d in dims if d > 1)
    return steps * (2 * link.alpha + nbytes * (2 * link.beta + link.gamma))


def _bkt(nbytes: float, dims: Sequence[int], link: Link) -> float:
    """BKT allreduce = bucket (ring) reduce-scatter + allgather, per dimension.

    Chan et al. (2007): on a ring of d nodes with n bytes, reduce-scatter
    ``(d-1) alpha + (d-1)/d n (beta + gamma)``, allgather ``(d-1) alpha +
    (d-1)/d n beta``. On a mesh the reduce-scatter runs along dimension 1
    with n bytes, then dimension 2 with n/d1, ... (the allgather in reverse),
    so the latency terms sum to ``sum (d_i - 1)`` and the bandwidth terms to
    ``(P-1)/P n``.
    """
    total, share = 0.0, float(nbytes)
    for d in dims:
        if d > 1:
            total += 2 * (d - 1) * link.alpha + (d - 1) / d * share * (2 * link.beta + link.gamma)
            share /= d
    return total


#: allreduce name -> T(nbytes, dims, link); a star of P nodes is the 1-D case (P,).
ALLREDUCE_MODELS: dict[str, Callable[[float, Sequence[int], Link], float]] = {"mst": _mst, "bkt": _bkt}
#: The library's allreduce algorithms that need nothing but point-to-point
#: (``models="library"``; ``bkt`` names ``ring`` there).
LIBRARY_ALLREDUCES = ("mst", "ring", "recursive_doubling", "rabenseifner")
#: Which formulas price the allreduces: the paper's closed forms of MST and
#: BKT, or the library's per-algorithm cost models (:mod:`collectives.cost_models`).
MODEL_SETS = ("paper", "library")

TOPOLOGIES = ("star", "mesh")


def _library_allreduce(name: str, nbytes: float, dims: Sequence[int], params: Any) -> float:
    """The library's cost model of allreduce ``name`` over ``dims``.

    A star is one dimension. On a mesh the ring (BKT) reduce-scatters along
    each dimension in turn on a shrinking share and allgathers back, as the
    paper's BKT does; other algorithms run along each dimension with the
    whole message.
    """
    from ..model import predict

    n = int(nbytes)
    if name == "ring" and len(dims) > 1:
        total, share = 0.0, n
        for d in dims:
            if d > 1:
                total += (predict("reduce_scatter", "ring", d, share, params)
                          + predict("allgather", "ring", d, share, params))
                share //= d
        return total
    return sum(predict("allreduce", name, d, n, params) for d in dims if d > 1)


def allreduce_time(nbytes: float, nodes: int, link: Link, algorithm: str = "auto",
                   topology: str = "star", models: str = "paper") -> tuple[float, str]:
    """Predicted time of one allreduce of ``nbytes`` among ``nodes`` nodes.

    Args:
        nbytes: message size in bytes.
        nodes: P.
        link: alpha, beta, gamma of the network (and its calibration profile).
        algorithm: with ``models="paper"``: ``"mst"``, ``"bkt"`` or ``"auto"``
            (the faster of the two); with ``models="library"``: one of
            :data:`LIBRARY_ALLREDUCES` (``"bkt"`` is ``"ring"``) or ``"auto"``
            (the fastest of them).
        topology: ``"star"`` (all nodes one hop apart) or ``"mesh"`` (2-D
            mesh of :func:`mesh_dims`, per-dimension sums).
        models: ``"paper"`` or ``"library"`` (see :data:`MODEL_SETS`).

    Returns:
        (seconds, algorithm used).

    Raises:
        ValueError: unknown algorithm, topology or model set.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if models not in MODEL_SETS:
        raise ValueError(f"models must be one of {MODEL_SETS}, got {models!r}")
    known = LIBRARY_ALLREDUCES + ("bkt",) if models == "library" else tuple(ALLREDUCE_MODELS)
    if algorithm != "auto" and algorithm not in known:
        raise ValueError(f"allreduce must be 'auto' or one of {known} with models={models!r}, got {algorithm!r}")
    if nodes <= 1 or nbytes <= 0:
        return 0.0, "none"
    dims = (nodes,) if topology == "star" else mesh_dims(nodes)
    if models == "library":
        names = LIBRARY_ALLREDUCES if algorithm == "auto" else ("ring" if algorithm == "bkt" else algorithm,)
        params = link.cost_params()
        return min((_library_allreduce(name, nbytes, dims, params), name) for name in names)
    names = tuple(ALLREDUCE_MODELS) if algorithm == "auto" else (algorithm,)
    return min((ALLREDUCE_MODELS[name](nbytes, dims, link), name) for name in names)
