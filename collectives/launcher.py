"""``collectives run``: start N local ranks, like ``torchrun --standalone``.

Each rank gets the environment :func:`collectives.init` reads (and torch's
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, so torch scripts run unchanged);
with more than one rank, ``OMP_NUM_THREADS=1`` unless it is set (as torchrun
does; OpenBLAS and torch follow it).
Output is streamed with a rank prefix. If one rank fails, the others are
stopped and the launcher exits with that rank's status.

Binding (``bind``, or ``COLLECTIVES_BIND``): with ``auto`` (the default),
when the ranks outnumber the cores this process may use, rank i is bound to
the i-th of them, round robin, as MPI launchers bind: left to itself, the
kernel sometimes crowds three of four ranks onto one of two cores, and
every collective then takes two to three times as long. ``core`` binds
that way always, ``none`` never.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

__all__ = ["launch", "rank_environment", "free_port", "rank_cpus"]

GRACE_SECONDS = 3.0
BIND_CHOICES = ("auto", "core", "none")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_environment(rank: int, size: int, *, job: str, secret: str, master_port: int,
                     transport: str | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one local rank."""
    env = dict(os.environ if base is None else base)
    env.update({
        "COLLECTIVES_RANK": str(rank), "COLLECTIVES_SIZE": str(size), "COLLECTIVES_JOB": job,
        "COLLECTIVES_SECRET": secret, "COLLECTIVES_LOCAL": "1",
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    })
    if transport:
        env["COLLECTIVES_TRANSPORT"] = transport
    if size > 1:  # as torchrun does: ranks sharing a host do not each start a thread per core
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def rank_cpus(nprocs: int, bind: str | None = None) -> list[set[int]] | None:
    """The cores each of ``nprocs`` ranks is bound to, or None (unbound); see
    the module docstring for ``bind`` (default: ``COLLECTIVES_BIND`` or auto)."""
    bind = bind or os.environ.get("COLLECTIVES_BIND", "auto")
    if bind not in BIND_CHOICES:
        raise ValueError(f"bind must be one of {', '.join(BIND_CHOICES)}, got {bind!r}")
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if bind == "none" or (bind == "auto" and nprocs <= len(cores)) or not cores:
        return None
    return [{cores[r % len(cores)]} for r in range(nprocs)]


def _bind(proc: subprocess.Popen, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(proc.pid, cpus)
    except OSError:  # it exited already, or the kernel refuses: it runs unbound
        pass


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every live rank's process group, then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + GRACE_SECONDS
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.02)


def launch(command: Sequence[str], nprocs: int, *, transport: str | None = None,
           prefix: bool = True, timeout: float | None = None, bind: str | None = None) -> int:
    """Run ``command`` as ``nprocs`` local ranks and return the job's exit status.

    Args:
        command: argv of one rank, e.g. ``[sys.executable, "train.py"]``.
        nprocs: number of ranks.
        transport: transport name for every rank (default: automatic).
        prefix: prefix each output line with ``[rank N]``.
        timeout: seconds after which every rank is stopped (status 124).
        bind: ``auto``, ``core`` or ``none`` (see the module docstring).

    Returns:
        0 if every rank succeeded, else the first failing rank's status.
    """
    if nprocs < 1:
        raise ValueError("nprocs must be >= 1")
    cpus = rank_cpus(nprocs, bind)
    job, secret, port = secrets.token_hex(6), secrets.token_hex(16), free_port()
    out = sys.stdout.buffer
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    status = 0
    restore = _stop_on_signals()
    try:
        for r in range(nprocs):
            env = rank_environment(r, nprocs, job=job, secret=secret, master_port=port, transport=transport)
            p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            if cpus is not None:
                _bind(p, cpus[r])
            t = threading.Thread(target=_pump, daemon=True,
                                 args=(p.stdout, f"[rank {r}] ".encode() if prefix else b"", out, lock))
            t.start()
            pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, status = failed[0]
                if any(c is None for c in codes):
                    sys.stderr.write(f"collectives run: rank {r} exited with status {status}; "
                                     "stopping the other ranks\n")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(f"collectives run: timeout after {timeout}s; stopping every rank\n")
                status = 124
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        status = 130
    except _Terminated as exc:
        sys.stderr.write(f"collectives run: {signal.Signals(exc.signum).name}; stopping every rank\n")
        status = 128 + exc.signum
    finally:
        _stop(procs)
        restore()
        for t in pumps:
            t.join(timeout=1.0)
    return status


class _Terminated(Exception):
    """The launcher was told to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals():
    """Turn SIGTERM and SIGHUP into :class:`_Terminated` while ranks run (the
    ranks sit in sessions of their own, so a signal to the launcher alone
    would leave them behind). Returns the function that restores the old
    handlers; a no-op off the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_terminated(signum, frame):
        raise _Terminated(signum)

    old = {sig: signal.signal(sig, raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]
