"""``collectives run``: start N local ranks, like ``torchrun --standalone``
(several nodes: :mod:`collectives.multinode`, which uses :func:`run_processes`).

Each rank gets the environment :func:`collectives.init` reads (and torch's
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). Output is streamed with a rank
prefix; one rank's failure stops the others (or not, ``--on-failure
continue``) and becomes the launcher's exit status. No rank outlives the
launcher: each runs in a process group of its own (in the launcher's
session), gets SIGKILL from the kernel when the launcher dies
(``PR_SET_PDEATHSIG``), and a watchdog process stops what the ranks
started. Ranks are bound: each to a share of the cores of its own, or to a
core round robin where they outnumber the cores.
The statuses, the guarantees and what they do not cover: docs/launching.md.

This module imports only the standard library: it is also the watchdog's
script (``python -I -S launcher.py --watch PID``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Iterable, Sequence

__all__ = ["launch", "LaunchStopped", "run_processes", "rank_environment", "free_port", "rank_cpus", "cpu_shares",
           "shell_status"]

GRACE_SECONDS = 3.0
BIND_CHOICES = ("auto", "core", "none")
#: signals that stop the launcher and every rank (it exits with 128 + signal)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_SECONDS = 0.02
_PR_SET_PDEATHSIG = 1
#: the launcher's own settings: not passed on, so that a launcher a rank starts is not taken for a node
_LAUNCHER_ONLY = ("COLLECTIVES_NNODES", "COLLECTIVES_NODE_RANK", "COLLECTIVES_MASTER_ADDR",
                  "COLLECTIVES_MASTER_PORT", "COLLECTIVES_JOIN_TIMEOUT")
_WATCH_FLAG = "--watch"
_DONE = b"done\n"


#: Where :func:`free_port` looks first: above the well-known and registered
#: ports most services use, below the kernel's ephemeral range.
PORTS_FROM = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``, chosen below the
    kernel's ephemeral range where it can be. A port from that range may be
    given meanwhile to any outgoing connection, even to one a rank makes to
    that very port before its listener binds (a TCP self-connect), and the
    listener then fails with "Address already in use"."""
    lo, _ = ephemeral_ports()
    tried = secrets.SystemRandom().sample(range(PORTS_FROM, lo), min(64, lo - PORTS_FROM)) if lo > PORTS_FROM else []
    for port in tried + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


def rank_environment(rank: int, size: int, *, job: str, secret: str, master_port: int,
                     transport: str | None = None, base: dict[str, str] | None = None,
                     local_rank: int | None = None, local_size: int | None = None, node_rank: int = 0,
                     nnodes: int = 1, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The environment of one rank: ours, and torchrun's variables. On one
    node (``nnodes`` 1) the local rank and size are the rank and size."""
    local_rank = rank if local_rank is None else local_rank
    local_size = size if local_size is None else local_size
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _LAUNCHER_ONLY}
    env.update({
        "COLLECTIVES_RANK": str(rank), "COLLECTIVES_SIZE": str(size), "COLLECTIVES_JOB": job,
        "COLLECTIVES_SECRET": secret, "COLLECTIVES_LOCAL": "1" if nnodes == 1 else "0",
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size), "NODE_RANK": str(node_rank), "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    })
    if transport:
        env["COLLECTIVES_TRANSPORT"] = transport
    if local_size > 1:  # as torchrun does: ranks sharing a host do not each start a thread per core
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def shell_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_end(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    return f"exited with status {returncode}"


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copy a rank's lines to ``out`` with ``prefix``; once ``out`` is gone (a
    reader that stopped early, such as ``head``), go on reading and drop
    them, so that no rank blocks on a full pipe."""
    gone = False
    for line in iter(stream.readline, b""):
        if gone:
            continue
        with lock:
            try:
                out.write(prefix + line)
                out.flush()
            except (BrokenPipeError, ValueError):  # the reader closed it (ValueError: closed here)
                gone = True
    stream.close()


def rank_cpus(nprocs: int, bind: str | None = None) -> list[set[int]] | None:
    """The CPUs each of ``nprocs`` ranks is bound to, or None (unbound).

    ``core``: rank i to the i-th CPU this process may use, round robin.
    ``auto`` (the default, ``COLLECTIVES_BIND``): the same when the ranks
    outnumber the CPUs; else, from 2 ranks, each rank gets a share of its
    own (:func:`cpu_shares`); 1 rank is left unbound. ``none``: unbound.
    """
    if bind is None:
        from collectives import config  # here: the watchdog runs this file with the standard library only

        bind = config.get("BIND")
    if bind not in BIND_CHOICES:
        raise ValueError(f"bind must be one of {', '.join(BIND_CHOICES)}, got {bind!r}")
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if bind == "none" or not cpus or (bind == "auto" and nprocs < 2):
        return None
    if bind == "auto" and nprocs <= len(cpus):
        return cpu_shares(cpus, nprocs)
    return [{cpus[r % len(cpus)]} for r in range(nprocs)]


def cpu_shares(cpus: Sequence[int], nprocs: int,
               topology: str = "/sys/devices/system/cpu") -> list[set[int]]:
    """``cpus`` split into ``nprocs`` disjoint shares, one per rank (needs
    ``nprocs <= len(cpus)``): whole cores (a core's hardware threads stay
    together, as ``topology`` lists them) in order of package and number,
    as even as they divide; where there are fewer cores than ranks, single
    CPUs."""
    allowed = set(cpus)
    cores: dict[tuple[int, int], set[int]] = {}
    for cpu in cpus:
        siblings = _read(f"{topology}/cpu{cpu}/topology/thread_siblings_list", _cpu_list, set()) & allowed
        package = _read(f"{topology}/cpu{cpu}/topology/physical_package_id", int, 0)
        siblings.add(cpu)
        cores.setdefault((package, min(siblings)), set()).update(siblings)
    groups = [cores[k] for k in sorted(cores)]
    if len(groups) < nprocs:
        groups = [{cpu} for cpu in cpus]
    per, extra = divmod(len(groups), nprocs)
    shares, start = [], 0
    for r in range(nprocs):
        end = start + per + (1 if r < extra else 0)
        shares.append(set().union(*groups[start:end]))
        start = end
    return shares


def _read(path: str, parse: Callable, default):
    """``parse`` of the file's text, or ``default`` where it cannot be read or parsed."""
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, ValueError):
        return default


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``0-3,8,10-11``) as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


# -- process groups ------------------------------------------------------------

def _live_groups(pgids: Iterable[int]) -> set[int]:
    """Those of ``pgids`` that hold a process that has not exited (zombies,
    which keep a group's id taken until reaped, do not count)."""
    wanted = set(pgids)
    try:
        names = os.listdir("/proc")
    except OSError:
        return {g for g in wanted if _group_exists(g)}
    live = set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it exited while we looked
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        if int(fields[2]) in wanted and fields[0] not in (b"Z", b"X"):
            live.add(int(fields[2]))
    return live


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_until(done: Callable[[], bool], seconds: float) -> bool:
    """Poll ``done`` until it holds or ``seconds`` pass; returns its last value."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _stop_groups(pgids: Iterable[int]) -> None:
    """SIGTERM every live process in the groups ``pgids``, then SIGKILL those
    left after :data:`GRACE_SECONDS`; returns after at most twice that."""
    pgids = set(pgids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = _live_groups(pgids)
        if not live:
            return
        for pgid in live:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        _wait_until(lambda: not _live_groups(live), GRACE_SECONDS)


# -- the ranks -----------------------------------------------------------------

def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _rank_setup(parent: int, prctl: Callable[..., int] | None,
                cpus: set[int] | None) -> Callable[[], None]:
    """The function a rank runs between fork and exec: bind it to ``cpus``
    (before any thread of the program exists, so every thread inherits
    them; where the kernel refuses, it runs unbound), and SIGKILL it when
    the thread that started it, in the launcher ``parent``, ends (the
    launcher dies), or at once if the launcher died already."""
    def setup() -> None:
        if cpus is not None:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the death signal was set
            os.kill(os.getpid(), signal.SIGKILL)
    return setup


def _returncode(proc: subprocess.Popen) -> int | None:
    """The rank's return code as Popen gives it (-N: killed by signal N), or
    None while it runs. The rank is left unreaped, so that its group's id
    stays taken until :func:`_stop` has signalled the group."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): Popen knows what is known
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Stop every process left in the ranks' groups, then kill any rank that
    left its group, and reap them all (each wait bounded)."""
    _stop_groups(p.pid for p in procs)
    for p in procs:
        if _returncode(p) is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass


def _spawn(command: Sequence[str], nprocs: int, envs: Sequence[dict[str, str]],
           cpus: list[set[int]] | None, watchdog: "_Watchdog",
           procs: list[subprocess.Popen]) -> None:
    """Start the ranks, appending each to ``procs`` as soon as it exists."""
    parent, prctl = os.getpid(), _prctl()
    stdin = subprocess.DEVNULL if _terminal(sys.stdin) else None  # a background group reading it would stop
    for r in range(nprocs):
        setup = _rank_setup(parent, prctl, cpus[r] if cpus is not None else None)
        p = subprocess.Popen(list(command), env=envs[r], stdin=stdin, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, process_group=0, preexec_fn=setup)
        procs.append(p)
        watchdog.watch(p.pid)


def _terminal(stream: IO | None) -> bool:
    """Whether ``stream`` is a terminal."""
    try:
        return stream is not None and os.isatty(stream.fileno())
    except (ValueError, OSError):
        return False


def _start_pumps(procs: Sequence[subprocess.Popen], prefix: bool, labels: Sequence[int]) -> list[threading.Thread]:
    """A thread per rank that copies its output to ours, each line prefixed
    with ``[rank N]`` (N from ``labels``) when ``prefix``."""
    out, lock = sys.stdout.buffer, threading.Lock()
    pumps = []
    for r, p in zip(labels, procs):
        t = threading.Thread(target=_pump, daemon=True,
                             args=(p.stdout, f"[rank {r}] ".encode() if prefix else b"", out, lock))
        t.start()
        pumps.append(t)
    return pumps


def _supervise(procs: Sequence[subprocess.Popen], timeout: float | None, received: list[int],
               on_failure: str = "stop") -> int:
    """Wait until every rank succeeded, one failed (with ``on_failure``
    ``"stop"``; with ``"continue"``, until every rank ended), the timeout
    passed or the launcher got a stop signal; returns the job's exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failures: list[tuple[int, int]] = []  # (rank, code) in the order seen (by rank within one look)
    while True:
        if received:
            _say(f"{_signal_name(received[0])}; stopping every rank")
            return 128 + received[0]
        codes = [_returncode(p) for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and on_failure == "stop":
            r, code = failed[0]
            rest = "; stopping the other ranks" if None in codes else ""
            _say(f"rank {r} {_describe_end(code)}{rest}")
            return shell_status(code)
        seen = {r for r, _ in failures}
        for r, code in failed:
            if r not in seen:  # --on-failure continue: say so, let the others go on
                failures.append((r, code))
                _say(f"rank {r} {_describe_end(code)}; the other ranks go on (--on-failure continue)")
        if None not in codes:
            if not failures:
                return 0
            _say(f"{len(failures)} of {len(codes)} ranks failed: " + ", ".join(
                f"rank {r} {_describe_end(c)}" for r, c in failures)
                + ("; the job's status is the first's" if len(failures) > 1 else ""))
            return shell_status(failures[0][1])
        if deadline is not None and time.monotonic() > deadline:
            _say(f"timeout after {timeout}s; stopping every rank")
            return 124
        time.sleep(POLL_SECONDS)


def _say(message: str) -> None:
    sys.stderr.write(f"collectives run: {message}\n")
    sys.stderr.flush()


class LaunchStopped(KeyboardInterrupt):
    """:func:`launch` got a stop signal (:data:`STOP_SIGNALS`) and stopped
    every rank: the caller stops too, as it would have without the launcher's
    handlers (a program that runs jobs one after another must not take it
    for one job's failure and go on). ``status`` is what a shell reports,
    128 + the signal; ``collectives run`` exits with it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"the launcher got {_signal_name(signum)} and stopped every rank")
        self.signum, self.status = signum, 128 + signum


def launch(command: Sequence[str], nprocs: int, *, transport: str | None = None,
           prefix: bool = True, timeout: float | None = None, bind: str | None = None,
           on_failure: str = "stop") -> int:
    """Run ``command`` as ``nprocs`` local ranks and return the job's exit status.

    Args:
        command: argv of one rank, e.g. ``[sys.executable, "train.py"]``.
        nprocs: number of ranks.
        transport: transport name for every rank (default: automatic).
        prefix: prefix each output line with ``[rank N]``.
        timeout: seconds after which every rank is stopped (status 124).
        bind: ``auto``, ``core`` or ``none`` (see the module docstring).
        on_failure: ``"stop"`` (stop every rank when one fails, as torchrun)
            or ``"continue"`` (the others go on, e.g. to shrink to the
            survivors; the job fails at the end if any rank failed).

    Returns:
        0 if every rank succeeded, else the status of the first rank seen to
        fail (not the lowest-numbered) as a shell reports it (128 + N if
        signal N killed it); 124 on timeout; 127 or 126 if ``command`` could
        not be started.

    Raises:
        LaunchStopped: the launcher got a stop signal (SIGTERM, SIGINT,
            SIGHUP); every rank was stopped first.

    Several nodes: :func:`collectives.multinode.launch_nodes`.
    """
    if nprocs < 1:
        raise ValueError("nprocs must be >= 1")
    if on_failure not in ("stop", "continue"):
        raise ValueError(f"on_failure must be 'stop' or 'continue', got {on_failure!r}")
    cpus = rank_cpus(nprocs, bind)
    job, secret, port = secrets.token_hex(6), secrets.token_hex(16), free_port()
    envs = [rank_environment(r, nprocs, job=job, secret=secret, master_port=port, transport=transport)
            for r in range(nprocs)]
    received, restore = _record_stop_signals()
    status = 1
    try:
        status = run_processes(command, envs, list(range(nprocs)), cpus, prefix,
                               lambda procs: _supervise(procs, timeout, received, on_failure))
    finally:
        restore()
        if status or received:
            _remove_segments(job)
    if received:
        raise LaunchStopped(received[0])
    return status


def _remove_segments(job: str) -> None:
    """Every rank of ``job`` has ended, and one did not succeed: remove the
    shared-memory names that a rank stopped in a rendezvous left (one that
    completes or fails one removes them itself)."""
    try:
        from collectives.transports.shm.segments import unlink_job
    except ImportError:  # the transport is not there (not Linux)
        return
    unlink_job(job)


def run_processes(command: Sequence[str], envs: Sequence[dict[str, str]], labels: Sequence[int],
                  cpus: list[set[int]] | None, prefix: bool,
                  supervise: Callable[[list[subprocess.Popen]], int]) -> int:
    """Start one rank of ``command`` per environment of ``envs`` (named by
    ``labels`` in its output and errors), let ``supervise`` watch them and
    return the job's status, and stop every process left in the ranks'
    groups however it ends (a watchdog does so if this process dies).

    Returns:
        what ``supervise`` returns; 127 or 126 if a rank could not be
        started (``supervise`` is not called then).
    """
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    watchdog = _Watchdog()
    try:
        try:
            _spawn(command, len(envs), envs, cpus, watchdog, procs)
        except OSError as exc:
            _say(f"cannot start rank {labels[len(procs)]}: {command[0]}: {exc.strerror or exc}")
            return 127 if exc.errno == errno.ENOENT else 126
        pumps = _start_pumps(procs, prefix, labels)  # after the forks: no thread of ours runs across one
        return supervise(procs)
    finally:
        _stop(procs)
        watchdog.release()
        for t in pumps:
            t.join(timeout=1.0)


def _record_stop_signals() -> tuple[list[int], Callable[[], None]]:
    """While ranks run, a stop signal (:data:`STOP_SIGNALS`) is appended to the
    returned list instead of acting (the ranks sit in process groups of their
    own, so the launcher must stop them itself). Returns the list and the function
    that restores the old handlers; off the main thread, where handlers
    cannot be set, the list stays empty."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return received, lambda: None
    old = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOP_SIGNALS}
    return received, lambda: [signal.signal(sig, handler) for sig, handler in old.items()]


# -- the watchdog ----------------------------------------------------------------

class _Watchdog:
    """A process that stops the ranks' groups if the launcher dies first.

    The launcher writes each rank's group id to the watchdog's stdin and,
    once it has stopped the ranks itself, ``done``; a pipe that closes before
    ``done`` means the launcher died, and the watchdog stops every process
    left in those groups. Best effort: without it (it could not start), the
    ranks themselves still die with the launcher.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        if not sys.executable:
            return
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), _WATCH_FLAG, str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            self.proc = None

    def watch(self, pgid: int) -> None:
        """Add the process group ``pgid`` to those stopped if the launcher dies."""
        self._send(f"{pgid}\n".encode())

    def release(self) -> None:
        """Tell the watchdog the ranks are stopped, and let it exit."""
        if self.proc is None:
            return
        self._send(_DONE)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:  # stuck in the kernel: not worth failing the job for
                pass

    def _send(self, data: bytes) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError:  # it died: the ranks still die with the launcher
            pass


def _read_groups(fd: int) -> tuple[list[int], bool]:
    """The group ids the launcher sent on ``fd``, and whether it said ``done``
    (False: the pipe closed first, so the launcher died)."""
    data = b""
    while not data.endswith(_DONE):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    done = data.endswith(_DONE)
    lines = data.split(b"\n")
    return [int(w) for w in lines if w.strip().isdigit()], done


def _watch_main(argv: Sequence[str]) -> int:
    """The watchdog: ``launcher.py --watch LAUNCHER_PID`` (the pid only names it)."""
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are the launcher's to act on
        signal.signal(sig, signal.SIG_IGN)
    pgids, done = _read_groups(sys.stdin.fileno())
    if not done:
        _stop_groups(pgids)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == [_WATCH_FLAG]:
    sys.exit(_watch_main(sys.argv[2:]))
