"""Shared-window algorithms: ranks read each other's memory directly.

For transports that offer a :class:`~collectives.window_contract.SharedWindow`
(shared memory now; CUDA IPC and RDMA later): every collective registered
as ``shared_window``, one module each. Data goes through the window regions
in pieces that fit one half, copy in, fence, copy out, the halves used in
turns (:mod:`.state`) so that a half is rewritten only once every rank is
done with its last use.

Where the window offers compiled calls (feature ``"compiled_calls"``), the
one-piece cases run as one compiled call each, every rank alike: copies in, a post,
a wait for every rank's post, copies out or a reduction (:mod:`.compiled_calls`).
The prepared calls (``prepare``) of repeated calls are the same compiled calls.

From a size per collective (:mod:`.tuning`, which depends on the ranks per
core) on, when every rank's buffer can be reached directly (it lies in the
shared pool, feature ``"pool"``, or the window reads and writes private
memory, feature ``"direct_access"``), the collectives publish their
buffers' addresses (one fence) and copy straight between the ranks'
buffers: one copy instead of two, and a final fence so that no rank changes
its buffer while another still uses it (:mod:`.direct`).

==================  ===========================================================
``tuning``          the switch points (sizes), one table
``state``           the region layout, the halves and turns, per-window caches
``pieces``          blocks per rank and pieces per half
``reduction``       reductions in rank order (compiled or numpy)
``compiled_calls``  describing a case as a compiled call; prepared calls
``direct``          the direct-access protocol (published buffers, readers)
``allreduce`` ...   one module per collective
==================  ===========================================================
"""

from . import (  # noqa: F401  (importing registers the algorithms)
    allgather,
    allreduce,
    alltoall,
    barrier,
    bcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from .tuning import DIRECT_FROM, PIECE_BYTES, SMALL_BYTES, SMALL_TOTAL_BYTES, direct_from

__all__ = ["DIRECT_FROM", "PIECE_BYTES", "SMALL_BYTES", "SMALL_TOTAL_BYTES", "direct_from"]
