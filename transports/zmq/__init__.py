"""ZeroMQ over TCP: the transport for many machines.

Sockets: each rank binds one ROUTER (inbound) and connects one DEALER to
every peer's ROUTER (outbound), so each ordered pair of ranks has its own
TCP connection and messages between them keep their order. Every socket
authenticates with the job's credentials during the ZeroMQ handshake (see
:mod:`collectives.transports.rendezvous`); a stranger is refused by libzmq
before any of its bytes reach the application, and logged. At the
rendezvous every rank also publishes its host name and process id, so that
errors name a peer as ``rank 2 (host h, pid 123)``, never by address alone.

Data: unless the job asked for encryption (CURVE) or turned them off
(``zmq_lanes`` / ``COLLECTIVES_ZMQ_LANES=0``), every message travels on a
direct TCP lane per pair of ranks (:mod:`collectives.transports.zmq.lanes`),
authenticated with the job's secret and driven by the waiting thread, with
no I/O thread in between: on loopback here an 8-byte exchange takes a
tenth, and 16 MiB half, of the time the same takes over ZeroMQ sockets.
ZeroMQ keeps the rendezvous, the abort and goodbye messages, the status
queries and the heartbeats. Otherwise the data goes over ZeroMQ as follows.

Messages: a message is cut into segments of ``zmq_segment_bytes`` (4 MiB by
default). Each segment is one ZeroMQ message ``[header, payload]`` where the
header is ``(kind, tag, total bytes, offset, signature)``; the segments of
one message are queued together, so they reach the peer back to back. Small
messages travel as one frame (header and payload copied together); large
ones are sent zero-copy (``copy=False``) and their send request completes
when libzmq has released the memory. Receives are matched by (peer, tag),
first come first served per (peer, tag); a segment whose receive is posted
lands straight in the user's buffer (``recv_into``), one that arrives early
is kept (zero-copy frame) in an unexpected-message queue.

Signatures: every message (lane or ZeroMQ, and one a rank sends itself)
carries its call's signature, compared with the receive's by
:func:`~collectives.signature.check_message` when the two meet (on arrival
for a posted receive, when posted for an early message). A receive that
fails the check gets the error; the message's bytes are still read off the
stream and dropped, never written into the buffer, so the stream stays in
step. A collective message (odd tag) from a peer for another call than the
one a posted receive from that peer waits for fails that receive
(:func:`~collectives.signature.out_of_step`); so does posting a collective
receive while only another call's message from that peer waits.

Progress: there is no data thread. Whichever thread waits drives the
inbound socket (one at a time; the others sleep on a condition), so a
single-threaded rank pays no thread hand-off. libzmq's own I/O thread
sends, keeps heartbeats and notices dead connections.

Failures, and how they are named:

* A peer whose process dies: its lane ends without a goodbye (end of file
  or reset), which is :class:`PeerLost` at once: ``rank 2 (host h, pid p)
  died or closed its connection``. Without lanes, its ZeroMQ connection
  drops and reconnecting is refused; it is declared after a grace period
  (``GRACE_SECONDS``) that lets a goodbye arrive first.
* A cut link (or a host that is down): no reset, the heartbeats stop, and
  ZeroMQ drops the connection after ``zmq_heartbeat_timeout`` (default
  10 s) while the lane stays open: ``no traffic from rank 2 (host h at
  10.0.0.3) for 10 s: the link is cut or the host is down``.
* A hung peer, or one that never arrives: the collective's own deadline
  fires first (heartbeats may still be flowing). The rank whose wait timed
  out asks every peer where it is (a status query over ZeroMQ, answered by
  whichever thread of the peer drives its progress: the call's sequence
  number and signature, which peer it waits for, whether it is diagnosing
  a timeout too) and waits ``QUERY_SECONDS`` for the answers. A peer that
  does not answer (stopped, hung, busy outside the library) has not
  arrived; if every peer answers, those in an earlier call have not; if
  all are in this call, their signatures are compared (ranks that only
  wait, such as roots that disagree, exchange no message that would show
  it). The verdict names them and says where each rank is; it is raised as
  :class:`CollectiveTimeout` (:class:`MismatchedCollective` for differing
  signatures) and sent to every peer as this rank's abort, so that every
  survivor raises the same verdict. When several ranks time out together,
  the lowest diagnosing rank decides: a rank that learns of a lower one
  diagnosing (from its answer or its own query) waits ``DEFER_SECONDS``
  for that rank's abort first. So a rank waiting for a live rank that
  waits for the hung one never blames the live rank.
* :meth:`ZmqTransport.abort` sends its text, with the first call this rank
  did not complete, over ZeroMQ and in-band on every lane; peers raise
  :func:`~collectives.errors.from_abort` (the aborting rank's kind of
  error) at once, but for operations of earlier calls, which may finish.
  Every later operation of an aborted or broken transport raises its first
  error again. A rank that a peer aborted does not pass the abort on,
  but for one copy to each peer as it closes (naming the aborting rank),
  so that no peer takes the end of its connections for a death.
* A call starts (:meth:`ZmqTransport.begin_call`) by looking for messages
  of earlier calls that no receive took (two ranks that both only sent in
  a call they disagreed on): a mismatch. A wait on several requests ends
  as soon as one of them fails.

Options (``options`` dict; all ranks must agree where it matters):
``secret`` (job secret, set by the launcher), ``auth`` (``"plain"`` or
``"curve"``), ``addr`` / ``ifname`` (listening address), ``store``,
``master_addr``, ``master_port`` (rendezvous), ``zmq_segment_bytes``,
``zmq_heartbeat_timeout`` (seconds), ``zmq_lanes`` (default true),
``zmq_reuse_buffers`` (default true;
``COLLECTIVES_ZMQ_REUSE_BUFFERS=0`` turns it off): see
:func:`reuse_message_buffers`.
"""

from .options import reuse_message_buffers
from .transport import ZmqTransport
from .wire import SEGMENT_BYTES

__all__ = ["ZmqTransport", "SEGMENT_BYTES", "reuse_message_buffers"]
