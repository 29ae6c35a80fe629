"""``collectives explain``: every candidate's predicted time, the parameters and the choice.

    collectives explain allreduce --bytes 4M -n 8 [--transport shm] [--dtype float32] [--profile PATH]
    collectives explain allreduce --bytes 16M --hosts 2x4 [--transport zmq] [--intra-profile PATH]

From Python: ``ModelSelector(transport="shm").explain("allreduce", 4 << 20, 8)``
or :func:`explain` here. With ``--hosts`` (ranks per host: ``2x4``, ``2+1``),
the job runs on several hosts: the topology, the parameters within hosts
(the shm profile) and between them (``--transport``'s), every flat and
hierarchical candidate and the choice a hierarchical communicator's
``auto`` makes (:mod:`.hierarchy`); inside a job, ``comm.explain(...)``
says the same for its own topology.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

from collectives.arithmetic import parse_bytes
from collectives.registry import COLLECTIVES

from .profile import load_profile
from .selector import Explanation, ModelSelector

__all__ = ["main", "explain", "explain_hosts", "parse_bytes", "transport_capabilities"]

def transport_capabilities(name: str) -> frozenset[str]:
    """The capabilities a transport plugin declares (empty if it cannot be loaded)."""
    from collectives.registry import transport_class

    try:
        return frozenset(transport_class(name).capabilities)
    except Exception:
        return frozenset()


def explain(collective: str, nbytes: int, p: int, dtype: Any = np.float32, transport: str = "shm",
            profile: str | None = None) -> Explanation:
    """Why ``algorithm="auto"`` picks what it picks: every candidate's
    predicted time, and what ``auto`` runs (the models' choice where this
    host has a profile of ``transport``, else the rule's, as in a job whose
    rank 0 runs here).

    Args:
        collective: the collective.
        nbytes: message size (the selector's convention).
        p: number of ranks.
        dtype: element type.
        transport: whose profile and capabilities to use.
        profile: a profile file instead of the transport's.

    Returns:
        An :class:`~collectives.cost_models.selector.Explanation` (``.table()`` prints it).
    """
    from dataclasses import replace

    from .agreed import explain_choice, local_selector

    auto = ModelSelector(load_profile(transport, profile), transport) if profile else local_selector(transport)
    found = explain_choice(auto, transport, collective, nbytes, p, dtype, transport_capabilities(transport))
    return found if profile else replace(found, how=found.how + " (in a job, rank 0's host decides)")


def main(argv: Sequence[str] | None = None) -> int:
    """``collectives explain COLLECTIVE --bytes N -n P [--transport NAME] [--dtype T] [--profile PATH]``."""
    ap = argparse.ArgumentParser(prog="collectives explain",
                                 description="predicted time of every algorithm and the choice")
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("--bytes", default="1M", help="message size, e.g. 512, 64K, 4M (default 1M)")
    ap.add_argument("-n", "--nprocs", type=int, default=8, help="number of ranks (default 8)")
    ap.add_argument("--transport", default="shm", help="transport (profile and capabilities; default shm)")
    ap.add_argument("--dtype", default="float32", help="element type (default float32)")
    ap.add_argument("--profile", default=None, help="a calibration profile file")
    ap.add_argument("--hosts", default=None, help="ranks on several hosts, e.g. 2x4 or 2+1: flat and hierarchical "
                                                  "candidates (--transport between hosts, default zmq; -n ignored)")
    ap.add_argument("--intra-profile", default=None, help="with --hosts: the shm profile within hosts")
    ns = ap.parse_args(argv)
    try:
        nbytes = parse_bytes(ns.bytes)
    except ValueError as exc:
        ap.error(str(exc))
    from collectives.ops import BFLOAT16

    dtype = BFLOAT16 if ns.dtype == "bfloat16" else np.dtype(ns.dtype)
    if ns.hosts:
        try:
            print(explain_hosts(ns.collective, nbytes, ns.hosts, dtype, ns.transport, ns.profile,
                                ns.intra_profile).table())
        except ValueError as exc:
            ap.error(str(exc))
        return 0
    print(explain(ns.collective, nbytes, ns.nprocs, dtype, ns.transport, ns.profile).table())
    return 0


def explain_hosts(collective: str, nbytes: int, hosts: str, dtype: Any = np.float32, transport: str = "shm",
                  profile: str | None = None, intra_profile: str | None = None) -> Any:
    """:func:`explain` for ranks on several hosts (``hosts``: ``2x4``, ``2+1``):
    the flat rule's choice over every rank against the hierarchical algorithms.

    Returns:
        A :class:`~collectives.cost_models.hierarchy.HierExplanation`.
    """
    from .agreed import local_selector
    from .hierarchy import Shape, explain_hier, load_params

    between = "zmq" if transport == "shm" else transport
    shape = Shape.parse(hosts)
    params = load_params(between, intra_profile, profile)
    flat = local_selector(between).choose(collective, nbytes, shape.p, np.dtype(dtype),
                                          transport_capabilities(between))
    return explain_hier(collective, nbytes, shape, params, [flat], dtype)


if __name__ == "__main__":
    sys.exit(main())
