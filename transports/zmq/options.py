"""Options of the TCP transport: the job secret, whether lanes carry the
data, listening addresses, and glibc's reuse of libzmq's receive buffers."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import warnings
from typing import Any

from collectives import config
from collectives.transports.rendezvous import JobCredentials

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_reused_up_to = 0


def reuse_message_buffers(largest: int) -> bool:
    """Let glibc serve libzmq's receive buffers of up to ``largest`` bytes from
    its heaps, reused message after message, instead of a fresh ``mmap`` each,
    whose pages the kernel zeroes on first touch: on loopback that zeroing was
    a tenth of a 64 MiB allreduce's CPU time. Process-wide (freed memory up
    to 4 x ``largest`` stays with the process, as MPI libraries arrange too);
    done once per size. Returns False where the C library is not glibc.
    """
    global _reused_up_to
    if largest <= _reused_up_to:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    threshold = min(largest + (1 << 20), 32 << 20)  # glibc refuses more than 32 MiB
    if not (mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, 4 * threshold)):
        return False
    _reused_up_to = largest
    return True


def lanes_wanted(options: dict[str, Any], credentials: JobCredentials) -> bool:
    """Direct TCP lanes carry the data unless turned off (``zmq_lanes`` or
    ``COLLECTIVES_ZMQ_LANES`` false) or the job asked for encryption (CURVE:
    the lanes authenticate but do not encrypt, so ZeroMQ carries the data)."""
    return credentials.mechanism != "curve" and bool(config.option(options, "zmq_lanes", "ZMQ_LANES"))


def job_secret(options: dict[str, Any], job: str) -> str:
    secret = options.get("secret")
    if secret:
        return str(secret)
    warnings.warn("no job secret (COLLECTIVES_SECRET or secret=...): deriving one from the job id, "
                  "which anyone who knows the job id can reproduce", RuntimeWarning, stacklevel=3)
    return hashlib.sha256(f"collectives-job:{job}".encode()).hexdigest()


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


