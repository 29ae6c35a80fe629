"""``collectives.init``: a Communicator from arguments or from the environment.

Launchers recognised, in this order:

* ours (``collectives run``): ``COLLECTIVES_RANK``, ``COLLECTIVES_SIZE``,
  ``COLLECTIVES_JOB``, ``COLLECTIVES_TRANSPORT``, ``COLLECTIVES_SECRET``;
* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``;
* mpiexec: ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI) or
  ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI).

``transport="auto"`` picks shared memory when every rank is on this host,
MPI under mpiexec, and ZeroMQ/TCP otherwise.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from . import config, debug_log
from .communicator import Communicator, live_communicators
from .errors import BadArgument, TransportUnavailable
from .registry import transport_class

__all__ = ["init", "LaunchInfo", "detect_launch"]

log = logging.getLogger("collectives")


@dataclass
class LaunchInfo:
    """What the environment says about this process's place in the job."""

    rank: int
    size: int
    launcher: str  # "collectives", "torchrun", "mpiexec" or "none"
    job: str
    all_local: bool
    options: dict[str, Any] = field(default_factory=dict)
    transport: str | None = None


def _int(env: dict, key: str) -> int | None:
    v = env.get(key)
    return int(v) if v not in (None, "") else None


def _job_from(*parts: str) -> str:
    return hashlib.sha1(":".join(parts).encode()).hexdigest()[:12]


def detect_launch(env: dict[str, str] | None = None) -> LaunchInfo:
    """Read rank, size, job id and rendezvous options from ``env`` (default os.environ)."""
    env = dict(os.environ if env is None else env)
    opts: dict[str, Any] = {}
    for key, opt in (("MASTER_ADDR", "master_addr"), ("MASTER_PORT", "master_port"),
                     ("COLLECTIVES_SECRET", "secret"), ("COLLECTIVES_SOCKET_IFNAME", "ifname")):
        if env.get(key):
            opts[opt] = env[key]
    if _int(env, "COLLECTIVES_RANK") is not None:
        return LaunchInfo(_int(env, "COLLECTIVES_RANK"), _int(env, "COLLECTIVES_SIZE") or 1, "collectives",
                          env.get("COLLECTIVES_JOB", "default"), env.get("COLLECTIVES_LOCAL", "1") == "1",
                          opts, env.get("COLLECTIVES_TRANSPORT") or None)
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        size = _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_WORLD_SIZE")
        job = _job_from(env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                        env.get("TORCHELASTIC_RUN_ID", ""))
        return LaunchInfo(_int(env, "RANK"), size, "torchrun", job, local == size, opts,
                          env.get("COLLECTIVES_TRANSPORT") or None)
    for rk, sk in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if _int(env, rk) is not None:
            return LaunchInfo(_int(env, rk), _int(env, sk) or 1, "mpiexec", "mpi", False, opts,
                              env.get("COLLECTIVES_TRANSPORT") or None)
    return LaunchInfo(0, 1, "none", f"single-{os.getpid()}", True, opts, env.get("COLLECTIVES_TRANSPORT") or None)


def _choose_transport(info: LaunchInfo) -> str:
    if info.transport and info.transport != "auto":
        return info.transport
    if info.launcher == "mpiexec":
        return "mpi"
    if info.all_local:
        return "shm"
    return "rdma" if _rdma_usable() else "zmq"


def _rdma_usable() -> bool:
    """True when the rdma plugin is installed and a port is active; else log why and return False."""
    try:
        ok, why = transport_class("rdma").available()
    except TransportUnavailable as exc:
        ok, why = False, str(exc)
    if not ok:
        log.info("RDMA is not usable (%s); using TCP (zmq)", why)
    return ok


_hooks_installed = False
_hook_lock = threading.Lock()


def _install_failure_hooks() -> None:
    """An uncaught exception on this rank aborts its communicators, so that
    every peer raises PeerLost at once instead of waiting for its timeout."""
    global _hooks_installed
    with _hook_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    previous = sys.excepthook

    def hook(tp, value, tb):
        for comm in live_communicators():
            try:
                comm.abort(f"uncaught {tp.__name__}: {value}")
            except Exception:
                pass
        previous(tp, value, tb)

    sys.excepthook = hook
    atexit.register(lambda: [c.close() for c in live_communicators()])


def init(rank: int | None = None, size: int | None = None, *, transport: str = "auto",
         job: str | None = None, timeout: float = 60.0, **options: Any) -> Communicator:
    """Build a Communicator.

    Args:
        rank, size: this process's rank and the number of ranks; read from
            the environment (see the module docstring) when None.
        transport: a registered transport name (``shm``, ``zmq``, ``mpi``,
            ...) or ``"auto"``.
        job: an id shared by the ranks of one job (default: from the launcher).
        timeout: default timeout of every blocking call, in seconds.
        **options: transport options (``master_addr``, ``master_port``,
            ``secret``, ``ifname``, ``store``, ...) and Communicator options
            (``selector``, ``segment_bytes``).

    Returns:
        A Communicator.

    Raises:
        BadArgument for inconsistent arguments; TransportUnavailable when
        the transport cannot run here (the message says why).
    """
    info = detect_launch()
    rank = info.rank if rank is None else int(rank)
    debug_log.configure(rank)
    config.log_settings(logging.getLogger("collectives.init"))
    size = info.size if size is None else int(size)
    if size < 1 or not 0 <= rank < size:
        raise BadArgument(f"rank {rank} is not in a world of {size} ranks")
    if transport == "auto" and size == 1 and info.launcher == "none":
        info.all_local = True
    name = transport if transport != "auto" else _choose_transport(info)
    comm_opts = {k: options.pop(k) for k in ("selector", "segment_bytes") if k in options}
    topts = {**info.options, **options}
    cls = transport_class(name)
    ok, why = cls.available()
    if not ok:
        raise TransportUnavailable(f"transport {name!r} is not available here: {why}")
    tr = cls.open(rank, size, job=job or info.job, timeout=timeout, options=topts)
    log.debug("rank %d/%d: transport %s (launcher %s)", rank, size, name, info.launcher)
    _install_failure_hooks()
    comm = Communicator(tr, timeout=timeout, job=job or info.job, options=topts, **comm_opts)
    init_log = logging.getLogger("collectives.init")
    if init_log.isEnabledFor(logging.INFO):
        selector = comm.selector
        params = getattr(selector, "params", None)  # a cost-model selector's calibration profile
        profile = getattr(params, "source", None)
        init_log.info("%s", debug_log.init_summary(comm, info.launcher, profile))
    return comm
