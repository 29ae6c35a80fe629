"""Shared-memory transport: the default when every rank runs on one host.

Each rank creates one segment in ``/dev/shm`` named after the job and its
rank, maps every other rank's, and unlinks its name as soon as every rank
has mapped it, so nothing is left behind even if a process is killed later.
Point-to-point messages go through one byte ring per pair of ranks; the
collectives' ``shared_window`` algorithms go through the shared window
(every rank's region and allocation pool, mapped by every rank). The
internals, with the measurements behind them: ``docs/shared-memory.md``.

One module per job:

==============  ==============================================================
``layout``      where everything lies in a segment: control-page words,
                :class:`~.layout.Layout`, :class:`~.layout.Segment`, names,
                default sizes
``segments``    setup and cleanup: settings, creating, attaching and
                unlinking segments, the cross-memory-attach probe, cores
``rings``       byte rings: streaming messages, the one-piece fast paths
``matching``    sends and receives, matching arrivals, unexpected messages
``requests``    request objects and waiting for them
``waking``      the backoff policy, futex sleep words, waiting on counters
``liveness``    dead, closed, aborted and diverging peers; aborting
``cma``         cross-memory copies (process_vm_readv/_writev), the skew bounce
``pool``        the shared allocation pool's allocator
``pages``       huge-page queries and adoption of private buffers' pages
``records``     every rank's call records (signatures, refusals, waits)
``window``      :class:`ShmWindow`, the shared window
``transport``   :class:`SharedMemoryTransport`, the parts put together
==============  ==============================================================
"""

from .cma import BOUNCE_BYTES, SKEW_SLOW_BYTES, skewed
from .layout import SHM_DIR, WINDOW_HEADER_BYTES, default_ring_bytes, segment_path
from .pages import HUGE_PAGE, PAGE, Adoptions, huge_pages
from .records import CallRecords
from .segments import shm_free_bytes
from .transport import SharedMemoryTransport
from .window import ShmWindow

__all__ = ["SharedMemoryTransport", "ShmWindow", "CallRecords", "Adoptions", "segment_path", "skewed",
           "huge_pages", "shm_free_bytes", "default_ring_bytes", "SHM_DIR", "PAGE", "HUGE_PAGE", "BOUNCE_BYTES",
           "SKEW_SLOW_BYTES", "WINDOW_HEADER_BYTES"]
