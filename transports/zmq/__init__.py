"""ZeroMQ over TCP: the transport for many machines.

Each rank binds one ROUTER and connects a DEALER to every peer's, all
authenticated with the job's secret; the data travels on direct TCP lanes
(:mod:`.lanes`) unless the job asked for encryption. Every message carries
its call's signature. Whichever thread waits drives the progress (no data
thread). A dead process, a cut link and a hung peer are told apart and
named by rank, host and pid, with one verdict on every survivor.

The modules: :mod:`.transport` (opening, sending, receiving),
:mod:`.progress`, :mod:`.failures`, :mod:`.diagnosis`, :mod:`.agreement`,
:mod:`.lanes`, :mod:`.requests`, :mod:`.wire`, :mod:`.options`. How it all
works, and its options: docs/tcp.md.
"""

from .options import reuse_message_buffers
from .transport import ZmqTransport
from .wire import SEGMENT_BYTES

__all__ = ["ZmqTransport", "SEGMENT_BYTES", "reuse_message_buffers"]
