"""The debug log: ``COLLECTIVES_DEBUG=WARN|INFO|TRACE``, like NCCL_DEBUG.

Lines go to standard error (or ``COLLECTIVES_DEBUG_FILE``, where ``%h``
becomes the host name, ``%p`` the process id and ``%r`` the rank: one file
per rank), each prefixed with host, process id and rank::

    node3:4242:1 collectives INFO init: transport shm (window), compiled on, ...

``COLLECTIVES_DEBUG_SUBSYS=init,shm,tcp,select`` keeps only those
subsystems (loggers ``collectives.<subsys>``; ``^shm`` drops one). At INFO,
every rank says once how it started (:func:`init_summary`) and, the first
time for each collective and size, which algorithm ``auto`` chose. TRACE
adds every call.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from . import config

__all__ = ["configure", "TRACE", "init_summary", "SUBSYSTEMS"]

#: Below DEBUG: every call.
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
SUBSYSTEMS = ("init", "select", "call", "shm", "tcp", "mpi", "torch")
#: Subsystem names users type, by the logger each one is (``collectives.<logger>``).
_LOGGERS = {"tcp": "zmq"}
_LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG,
           "TRACE": TRACE, "ERROR": logging.ERROR}
_configured: tuple | None = None


class _Prefix(logging.Filter):
    """Adds host:pid:rank, and keeps only the chosen subsystems."""

    def __init__(self, rank: int, keep: set[str] | None, drop: set[str]) -> None:
        super().__init__()
        self.prefix = f"{socket.gethostname()}:{os.getpid()}:{rank}"
        self.keep, self.drop = keep, drop

    def filter(self, record: logging.LogRecord) -> bool:
        parts = record.name.split(".")
        sub = parts[1] if len(parts) > 1 else ""
        if (self.keep is not None and sub not in self.keep) or sub in self.drop:
            return False
        record.where = self.prefix
        return True


def configure(rank: int | None = None) -> None:
    """Set up the ``collectives`` loggers from the environment (once per rank;
    nothing when ``COLLECTIVES_DEBUG`` is unset)."""
    global _configured
    level_name = (config.get("DEBUG") or "").upper()
    if not level_name:
        return
    if rank is None:
        rank = config.get("RANK") or int(os.environ.get("RANK", "0") or 0)
    key = (level_name, rank, config.get("DEBUG_SUBSYS"), config.get("DEBUG_FILE"))
    if _configured == key:
        return
    _configured = key
    level = _LEVELS.get(level_name, logging.INFO)
    subsys = [s.strip() for s in (config.get("DEBUG_SUBSYS") or "").split(",") if s.strip()]
    keep = {_LOGGERS.get(s, s) for s in subsys if not s.startswith("^")} or None
    drop = {_LOGGERS.get(s[1:], s[1:]) for s in subsys if s.startswith("^")}
    target = config.get("DEBUG_FILE")
    if target:
        path = target.replace("%h", socket.gethostname()).replace("%p", str(os.getpid())).replace("%r", str(rank))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(where)s %(name)s %(levelname)s %(message)s"))
    handler.addFilter(_Prefix(rank, keep, drop))
    root = logging.getLogger("collectives")
    for old in [h for h in root.handlers if getattr(h, "_collectives_debug", False)]:
        root.removeHandler(old)
    handler._collectives_debug = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def init_summary(comm, launcher: str, profile: str | None) -> str:
    """The line every rank logs at INFO when it starts."""
    from . import compiled

    t = comm.transport
    caps = ",".join(sorted(t.capabilities)) or "none"
    return (f"init: rank {comm.rank} of {comm.size}, transport {t.name} ({caps}), launcher {launcher}, "
            f"compiled fast path {'on' if compiled.enabled() is not None else 'off'}, "
            f"calibration profile {profile or 'none (the default rule chooses)'}, timeout {comm.timeout:g} s, "
            f"flight recorder {comm._recorder.capacity if comm._recorder else 'off'}")
