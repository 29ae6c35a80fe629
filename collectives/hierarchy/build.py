"""What ``collectives.init()`` builds over an open world transport.

Unless init was given a selector, every rank first agrees on what
``algorithm="auto"`` follows (:mod:`collectives.cost_models.agreed`: rank
0's calibration profile, or the rule).

With ``COLLECTIVES_HIERARCHY=auto`` (the default), a world transport that
is not shared memory itself, and more than one rank, init discovers the
topology (:mod:`.discovery`). Where the ranks span several hosts and some
share one, every host with several ranks opens a shared-memory transport
among them; if every host could, the ranks agree to go hierarchical and
get a :class:`~.communicator.HierarchicalCommunicator`; if any host could
not, every rank gets the flat communicator (and the reason is logged).
Otherwise the flat communicator, with the discovered ``topology``
attribute. ``COLLECTIVES_HIERARCHY=off``: the flat communicator, nothing
discovered.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import config
from ..communicator import Communicator
from ..errors import CollectiveError
from ..registry import transport_class
from ..transport import Transport
from .discovery import all_agree, discover
from .host import HostCommunicator, SharedHost, SoloHost
from .topology import Topology

__all__ = ["communicator_for", "wants_hierarchy"]

log = logging.getLogger("collectives.init")

#: World transports that are already one host's shared memory (or a simulation).
_SINGLE_HOST = frozenset({"shm", "sim"})


def wants_hierarchy(transport_name: str, size: int) -> bool:
    """Whether init looks for hosts at all (see the module docstring)."""
    return config.get("HIERARCHY") != "off" and transport_name not in _SINGLE_HOST and size > 1


def _open_host(topo: Topology, job: str, timeout: float, options: dict[str, Any]) -> tuple[Any, str]:
    """This rank's host (None and why, when its shared memory cannot be opened)."""
    if topo.local_size == 1:
        return SoloHost(topo), ""
    try:
        cls = transport_class("shm")
        ok, why = cls.available()
        if not ok:
            return None, why
        tr = cls.open(topo.local_rank, topo.local_size, job=f"{job}.node{topo.node}", timeout=timeout,
                      options=options)
    except (CollectiveError, OSError) as exc:  # TransportUnavailable included
        return None, f"{type(exc).__name__}: {exc}"
    comm = HostCommunicator(tr, timeout=timeout, job=f"{job}.node{topo.node}", options=options)
    if comm._recorder is not None:  # its records name world ranks
        comm._recorder.peers = list(topo.local_ranks)
    return SharedHost(topo, comm), ""


def communicator_for(transport: Transport, name: str, *, timeout: float, job: str,
                     options: dict[str, Any], **comm_options: Any) -> Communicator:
    """The communicator over the open world ``transport`` (registered as ``name``).

    Raises:
        CollectiveTimeout, PeerLost: a rank did not take part in the discovery in time, or died.
    """
    if comm_options.get("selector") is None:  # every rank follows rank 0's profile, or the rule
        from ..cost_models.agreed import agreed_selector

        comm_options["selector"] = agreed_selector(transport, name, timeout)
    kwargs = dict(timeout=timeout, job=job, options=options, **comm_options)
    if not wants_hierarchy(name, transport.size):
        return Communicator(transport, **kwargs)
    from ..cost_models.hierarchy import HierParams, load_params

    topo, params = discover(transport, timeout, lambda: load_params(name).as_dict())
    if topo.hierarchical:
        host, why = _open_host(topo, job, timeout, options)
        if all_agree(transport, host is not None, timeout):
            from .communicator import HierarchicalCommunicator

            log.info("rank %d: hierarchical: %s", transport.rank, topo.describe().replace("\n", ";"))
            return HierarchicalCommunicator(transport, topo, host, HierParams.from_dict(params), **kwargs)
        if host is not None:
            host.close()
        log.warning("rank %d: shared memory within hosts is not available on every host (%s); every rank "
                    "stays flat", transport.rank, why or "another host could not open it")
    comm = Communicator(transport, **kwargs)
    comm.topology = topo
    return comm
