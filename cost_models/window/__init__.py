"""Formulas of the shared-window algorithms (:mod:`collectives.algorithms.window`),
one module per collective, as the algorithms are.

Their cost is memory traffic and fences, not messages: ``copy(m)`` is a
local copy of m bytes at the memory bandwidth, ``F`` one fence (a barrier
through shared memory), gamma the reduction of one byte; n is the
selector's size (the p blocks together for gather, scatter and alltoall).
Below each collective's ``DIRECT_FROM`` (see
:func:`collectives.algorithms.window.tuning.direct_from`) data goes through
the window (copy in, fence, copy out) in pieces of at most ``PIECE_BYTES``
per rank; from it on, ranks publish their buffers (one fence) and read
each other's directly (one copy), with a closing fence (for allgather,
alltoall, bcast, gather and scatter in one compiled call: docs/shared-memory.md,
"Reads out of the pool"); so do allgather,
alltoall, scatter, bcast and gather in their spans of ``COMPILED_DIRECT``
(one compiled call, cross-memory attach), and allreduce in its span, which
reduces peers' pooled buffers in place and writes into them. Where the
algorithms read directly only from buffers in huge pages
(``DIRECT_FROM``'s ``huge``), the models assume such buffers, as
calibration's are; on 4 KiB pages the pieces run instead.
"""

from . import allgather, allreduce, alltoall, barrier, bcast, gather, reduce, reduce_scatter, scatter  # noqa: F401
from .common import direct, filled, one_fence, pieces

__all__ = ["direct", "filled", "one_fence", "pieces"]
