"""``collectives.init``: a Communicator from arguments or from the environment.

Launchers recognised, in this order:

* ours (``collectives run``): ``COLLECTIVES_RANK``, ``COLLECTIVES_SIZE``,
  ``COLLECTIVES_JOB``, ``COLLECTIVES_TRANSPORT``, ``COLLECTIVES_SECRET``;
* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``;
* mpiexec: ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI) or
  ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI);
* srun (Slurm): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_ID``
  and ``SLURM_STEP_ID`` (the job id), the master from the first host of
  ``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST`` (unless ``MASTER_ADDR``
  is set) and the port from ``MASTER_PORT`` or derived from the job and step
  ids (:func:`slurm_port`). Only a step's tasks count: a batch script
  (``SLURM_PROCID`` but no ``SLURM_STEP_ID``) is not a rank of a job.

``transport="auto"`` picks shared memory when every rank is on this host,
MPI under mpiexec, and ZeroMQ/TCP otherwise. Where the ranks then span
several hosts and some share one, init returns a hierarchical communicator
(shared memory within each host, that transport between hosts; see
:mod:`collectives.hierarchy` and ``COLLECTIVES_HIERARCHY``).
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

from . import config, debug_log, hostlist
from .communicator import Communicator, live_communicators
from .errors import BadArgument, TransportUnavailable
from .registry import transport_class

__all__ = ["init", "LaunchInfo", "detect_launch", "slurm_port"]

log = logging.getLogger("collectives")


@dataclass
class LaunchInfo:
    """What the environment says about this process's place in the job."""

    rank: int
    size: int
    launcher: str  # "collectives", "torchrun", "mpiexec", "slurm" or "none"
    job: str
    all_local: bool
    options: dict[str, Any] = field(default_factory=dict)
    transport: str | None = None
    local_rank: int | None = None  # the rank among those of this host, where the launcher says
    node_rank: int | None = None  # the index of this host in the job, where the launcher says


def _int(env: dict, key: str) -> int | None:
    """A launcher's integer variable (RANK, WORLD_SIZE, PMI_RANK, ...), None when unset."""
    v = env.get(key)
    return int(v) if v not in (None, "") else None


def _job_from(*parts: str) -> str:
    return hashlib.sha1(":".join(parts).encode()).hexdigest()[:12]


def detect_launch(env: dict[str, str] | None = None) -> LaunchInfo:
    """Read rank, size, job id and rendezvous options from ``env`` (default
    os.environ), trying the launchers in the module docstring's order.

    Raises:
        BadArgument: an srun step whose node list is missing or invalid.
    """
    env = dict(os.environ if env is None else env)
    opts: dict[str, Any] = {}
    for key, opt in (("MASTER_ADDR", "master_addr"), ("MASTER_PORT", "master_port")):
        if env.get(key):
            opts[opt] = env[key]
    for name, opt in (("SECRET", "secret"), ("SOCKET_IFNAME", "ifname")):
        if config.get(name, env=env):
            opts[opt] = config.get(name, env=env)
    transport = config.get("TRANSPORT", env=env)
    transport = None if transport in ("", "auto") else transport
    if config.get("RANK", env=env) is not None:
        return LaunchInfo(config.get("RANK", env=env), config.get("SIZE", env=env) or 1, "collectives",
                          config.get("JOB", env=env) or "default", config.get("LOCAL", env=env), opts, transport,
                          _int(env, "LOCAL_RANK"), _int(env, "NODE_RANK"))
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        size = _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_WORLD_SIZE")
        job = _job_from(env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                        env.get("TORCHELASTIC_RUN_ID", ""))
        return LaunchInfo(_int(env, "RANK"), size, "torchrun", job, local == size, opts, transport,
                          _int(env, "LOCAL_RANK"), _int(env, "GROUP_RANK"))
    for rk, sk in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if _int(env, rk) is not None:
            return LaunchInfo(_int(env, rk), _int(env, sk) or 1, "mpiexec", "mpi", False, opts, transport)
    slurm = _detect_slurm(env, opts, transport)
    if slurm is not None:
        return slurm
    return LaunchInfo(0, 1, "none", f"single-{os.getpid()}", True, opts, transport)


#: the ports :func:`slurm_port` derives lie in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN),
#: below Linux's ephemeral range (32768 and up)
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 15000


def slurm_port(job_id: str, step_id: str) -> int:
    """The rendezvous port of a Slurm job step when ``MASTER_PORT`` is not set:
    the same on every task of the step, and most likely another for the next
    step or job (15000 to 29999)."""
    digest = hashlib.sha1(f"slurm:{job_id}.{step_id}".encode()).digest()
    return SLURM_PORT_BASE + int.from_bytes(digest[:4], "big") % SLURM_PORT_SPAN


def _detect_slurm(env: dict[str, str], opts: dict[str, Any], transport: str | None = None) -> LaunchInfo | None:
    """A task of an ``srun`` step (None when ``env`` is not one)."""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if _int(env, "SLURM_PROCID") is None or not step:
        return None
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    size = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS") or 1
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")
    opts = dict(opts)
    if "master_addr" not in opts:
        if not nodelist:
            raise BadArgument("srun set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set MASTER_ADDR "
                              "to the host of rank 0")
        opts["master_addr"] = hostlist.first_host(nodelist)
    opts.setdefault("master_port", str(slurm_port(job_id, step)))
    all_local = nodes == 1 if nodes is not None else len(hostlist.expand(nodelist or "")) <= 1
    return LaunchInfo(_int(env, "SLURM_PROCID"), size, "slurm", f"slurm-{job_id}.{step}", all_local, opts,
                      transport, _int(env, "SLURM_LOCALID"),
                      _int(env, "SLURM_NODEID"))


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
    from .hierarchy.build import communicator_for  # shared memory within hosts where ranks span several

    try:
        comm = communicator_for(tr, name, timeout=timeout, job=job or info.job, options=topts, **comm_opts)
    except BaseException:
        tr.close()
        raise
    init_log = logging.getLogger("collectives.init")
    if init_log.isEnabledFor(logging.INFO):
        selector = comm.selector
        params = getattr(selector, "params", None)  # a cost-model selector's calibration profile
        profile = getattr(params, "source", None)
        init_log.info("%s", debug_log.init_summary(comm, info.launcher, profile))
    return comm
