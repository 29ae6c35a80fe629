"""The ``sim`` transport: p virtual ranks in one process on a virtual clock.

The real algorithm code runs, one thread per rank, but only one rank runs at
a time: the one with the earliest virtual clock (a conservative
discrete-event simulation). Every message is scheduled when it is posted, in
virtual-time order, so the result is deterministic.

Cost model (seconds; ``alpha``, ``beta`` per byte, ``gamma`` per byte reduced):

* a message of n bytes occupies the network resources on its path for
  ``alpha + n * beta`` from ``start = max(post time, every resource free)``;
  it arrives, and the send completes, at ``start + alpha + n * beta``
  (eager: the transfer does not wait for the receive to be posted);
* a receive completes at ``max(arrival, post time of the receive)``;
* a rank that waits jumps its clock to the completion time of what it waits
  for; a reduction of n bytes (through an op from :func:`charged_op`)
  advances the reducing rank's clock by ``n * gamma``. Local copies cost
  nothing (the cost models' memory term is zero for the simulator).

One module per job:

==============  ==============================================================
``network``     :class:`SimParams`, the topologies (``full``, ``switch``,
                ``mesh``) and the resources a message holds
``world``       :class:`SimWorld`: the clocks, the scheduler, matching
``transport``   :class:`SimTransport`, one virtual rank; :func:`charged_op`
``simulation``  :func:`simulate` and :class:`SimResult`
==============  ==============================================================

Python API: :func:`simulate` runs one collective with one algorithm and
returns the virtual time and every rank's result. The transport also opens
through ``init(rank, size, transport="sim")`` from ``size`` threads of one
process (ranks of the same ``job`` share a world).
"""

from .network import TOPOLOGIES, SimParams
from .simulation import SimResult, simulate
from .transport import SimTransport, charged_op
from .world import SimWorld

__all__ = ["SimTransport", "SimParams", "SimWorld", "simulate", "SimResult", "charged_op", "TOPOLOGIES"]
