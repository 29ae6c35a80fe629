"""What travels on the ZeroMQ sockets: frame layout, message kinds, tuning
constants, and the small helpers every part of the TCP transport shares."""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import NamedTuple

import numpy as np
import zmq

from collectives.arithmetic import byte_view
from collectives.errors import BadArgument, CollectiveError, PeerLost
from collectives.signature import NO_SIG, SEQ_MASK, Sig, fields

log = logging.getLogger("collectives.zmq")

#: Large messages travel in segments of this many bytes.
SEGMENT_BYTES = 4 << 20
#: Below this size a payload is copied into one frame with its header.
COPY_BELOW = 64 << 10
#: A disconnected peer that has not said goodbye is declared lost after this long.
GRACE_SECONDS = 0.5
#: Longest single poll, so that other threads' progress and aborts are seen.
POLL_SLICE = 0.05
#: Seconds between looks at the connection monitors (peer loss, handshakes).
MONITOR_EVERY = 0.02
#: Seconds of yielding the CPU (each yield followed by a look at the socket) before a blocking poll.
YIELD_SECONDS = 0.0002
#: Seconds a rank whose collective timed out waits for its peers' status
#: (a live peer answers in milliseconds; this leaves room for a busy host).
QUERY_SECONDS = 0.4
#: Seconds it then waits for the verdict of a lower rank diagnosing the same hang.
DEFER_SECONDS = 0.5
#: Seconds a clean close listens for the goodbyes of peers closing at about the same time.
BYE_GRACE = 0.02
#: Linger (seconds) of a broken transport's sockets when it closes: its abort must get out.
ABORT_LINGER = 0.3
#: Longest abort text sent.
ABORT_TEXT_BYTES = 2000

yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))

HEADER = struct.Struct("<BqQQQQQ")  # kind, tag, total bytes, offset, signature (three words)
#: A status reply's body: query id, call seq (-1: none), signature, peer waited for (-1: none),
#: flags, seconds in the call.
STATUS = struct.Struct("<qqQQQqBd")
ZMQ_EVENTS, ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum flags cost microseconds
KIND_DATA, KIND_ABORT, KIND_BYE, KIND_QUERY, KIND_STATUS = 1, 2, 3, 4, 5
#: Surviving failures (see .agreement): a state of an agreement, a decision, a rendezvous key.
KIND_AGREE, KIND_DECIDED, KIND_KV = 6, 7, 8
DIAGNOSING = 1  # status flag: this rank's collective timed out and it is asking its peers


class PeerStatus(NamedTuple):
    """A peer's answer to a status query."""

    seq: int  # its current call's sequence number (-1: none yet)
    sig: Sig
    waiting: int  # the peer it waits for (-1: none)
    diagnosing: bool  # its own collective timed out
    seconds: float  # how long it has been in that call



def copy_error(err: CollectiveError) -> CollectiveError:
    """A fresh error of ``err``'s kind and message (raised again and again)."""
    new = PeerLost(str(err), err.peer) if isinstance(err, PeerLost) else type(err)(str(err))
    new.origin = err.origin
    return new


def older(seq: int, than: int) -> bool:
    """Whether call ``seq`` comes before call ``than`` (sequence numbers wrap; -1: no call)."""
    return seq < 0 or 0 < ((than - seq) & SEQ_MASK) <= SEQ_MASK >> 1


def call_name(seq: int, sig: Sig) -> str:
    """``allreduce #12`` (``call #12`` without a signature)."""
    if seq < 0:
        return "no collective yet"
    if sig != NO_SIG:
        return f"{fields(sig, {})['collective']} #{seq}"
    return f"call #{seq}"



def bytes_view(buf: np.ndarray, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of the C-contiguous array ``buf``."""
    if not buf.flags.c_contiguous:
        raise BadArgument("zmq transport needs C-contiguous buffers")
    if writable and not buf.flags.writeable:
        raise BadArgument("receive buffer is read-only")
    return byte_view(buf) if buf.size else np.empty(0, np.uint8)  # writable even when empty
