"""Run a function on p real processes with a hard deadline.

``run_ranks(fn, p, *args)`` forks p processes; each builds a Communicator
with :func:`collectives.init` (the environment our launcher would set),
calls ``fn(comm, *args)`` and sends back its return value or its error.
If any rank fails, or any rank is still running at the deadline, every
rank is killed and the test fails with each rank's outcome.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from collectives.launcher import free_port, rank_environment

__all__ = ["run_ranks", "Outcome", "RankFailure", "attempt", "wait_until", "mark_done", "resume_when_done",
           "stopped_after_its_post"]

def attempt(call: Callable[[], Any]) -> dict:
    """Run one collective call inside a rank: its ``outcome`` ("ok" or the
    error's class name), ``message`` and ``elapsed`` seconds."""
    from collectives import CollectiveError

    t0 = time.monotonic()
    try:
        call()
        outcome, message = "ok", ""
    except CollectiveError as exc:
        outcome, message = type(exc).__name__, str(exc)
    return {"outcome": outcome, "message": message, "elapsed": time.monotonic() - t0}


def wait_until(ready: Callable[[], bool], deadline: float, what: str) -> None:
    """Yield until ``ready()`` (an event another process makes), failing with
    ``what`` at ``deadline`` (a time.monotonic() value)."""
    while not ready():
        assert time.monotonic() < deadline, what
        os.sched_yield()


def mark_done(marker: str) -> None:
    """Tell another rank (:func:`resume_when_done`) that this rank's call returned or raised."""
    with open(marker, "w") as f:
        f.write("done")


def resume_when_done(pid: int, marker: str, deadline: float) -> None:
    """Resume the stopped process ``pid`` (SIGCONT) and wait until it marked
    ``marker`` (:func:`mark_done`)."""
    os.kill(pid, signal.SIGCONT)
    wait_until(lambda: os.path.exists(marker), deadline, "rank 1 never finished")


def stopped_after_its_post(comm, call: Callable[[float | None], Any], limit: float, marker: str,
                           reuse: Callable[[], None]) -> dict:
    """Two ranks: rank 1 makes ``call(None)`` (``call(timeout)`` makes the
    collective) and marks ``marker`` once it returned or raised; rank 0
    waits until rank 1 posted that call, stops it (SIGSTOP), makes
    ``call(limit)``, then ``reuse()`` (its caller uses its buffer again),
    resumes rank 1 and waits for its mark. Each rank's :func:`attempt`."""
    if comm.rank == 1:
        got = attempt(lambda: call(None))
        mark_done(marker)
        return got
    from collectives.transports.shm.layout import Q_PID, Q_POST
    own, peer = comm.transport._segs[0].q, comm.transport._segs[1].q
    deadline = time.monotonic() + 30
    wait_until(lambda: peer[Q_POST] > own[Q_POST], deadline, "rank 1 never posted")  # its call's post
    pid = int(peer[Q_PID])
    os.kill(pid, signal.SIGSTOP)
    got = attempt(lambda: call(limit))
    reuse()
    resume_when_done(pid, marker, deadline)
    return got


_CTX = mp.get_context("fork")
#: The job id of the latest run_ranks (its shared-memory segments are named after it).
last_job = ""


@dataclass
class Outcome:
    """What one rank did: its return value, or its error."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    elapsed: float = 0.0

    def __str__(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok ({self.elapsed:.2f}s)"
        return f"rank {self.rank}: {self.error_type}: {self.message} ({self.elapsed:.2f}s)\n{self.traceback}"


class RankFailure(AssertionError):
    """One or more ranks failed or did not finish in time."""


#: A rank's exit status when closing its communicators raised.
CLOSE_FAILED = 3


def _child(conn, rank: int, size: int, env: dict, transport: str, comm_timeout: float,
           fn: Callable, args: tuple, kwargs: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    import collectives

    start = time.monotonic()
    comm = None
    try:
        comm = collectives.init(transport=transport, timeout=comm_timeout)
        value = fn(comm, *args, **kwargs)
        conn.send(Outcome(rank, True, value, elapsed=time.monotonic() - start))
    except BaseException as exc:  # reported to the parent, never swallowed
        if comm is not None:
            comm.abort(f"{type(exc).__name__}: {exc}")
        conn.send(Outcome(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc(),
                          time.monotonic() - start))
    finally:
        status = 0
        try:
            if comm is not None:
                comm.close()
            from collectives.communicator import live_communicators

            for other in live_communicators():  # e.g. one a shrink made: closed as a normal exit would
                other.close()
        except BaseException:  # the parent fails the run on this status (CLOSE_FAILED)
            traceback.print_exc()
            status = CLOSE_FAILED
        finally:
            conn.close()
            os._exit(status)


def run_ranks(fn: Callable, nprocs: int, *args: Any, transport: str = "shm", timeout: float = 60.0,
              comm_timeout: float = 20.0, expect_errors: bool = False, **kwargs: Any) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``nprocs`` processes.

    Args:
        fn: a module-level function; its return value must pickle.
        nprocs: number of ranks.
        transport: transport name passed to ``collectives.init``.
        timeout: hard deadline of the whole run in seconds.
        comm_timeout: the communicators' default timeout.
        expect_errors: return every rank's :class:`Outcome` instead of
            failing when a rank raises.

    Returns:
        The ranks' return values in rank order (or their Outcomes).

    Raises:
        RankFailure: a rank raised (unless expect_errors) or the deadline passed.
    """
    global last_job
    job = last_job = f"t{secrets.token_hex(5)}"
    secret, port = secrets.token_hex(8), free_port()
    procs, conns = [], []
    for r in range(nprocs):
        env = rank_environment(r, nprocs, job=job, secret=secret, master_port=port, transport=transport)
        parent, child = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=_child, args=(child, r, nprocs, env, transport, comm_timeout, fn, args, kwargs),
                         daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    outcomes: list[Outcome | None] = [None] * nprocs
    deadline = time.monotonic() + timeout
    try:
        pending = set(range(nprocs))
        while pending and time.monotonic() < deadline:
            ready = mp.connection.wait([conns[r] for r in pending], timeout=0.05)
            for c in ready:
                r = conns.index(c)
                try:
                    outcomes[r] = c.recv()
                except EOFError:
                    procs[r].join(timeout=2.0)  # the pipe closes a moment before the process is reaped
                    code = procs[r].exitcode
                    outcomes[r] = Outcome(r, False, None, "ProcessDied", f"exit code {code}")
                pending.discard(r)
            for r in list(pending):
                if not procs[r].is_alive() and not conns[r].poll():
                    outcomes[r] = Outcome(r, False, None, "ProcessDied", f"exit code {procs[r].exitcode}")
                    pending.discard(r)
    finally:
        killed = set()
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            if p.is_alive():
                killed.add(r)
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        for c in conns:
            c.close()
    for r, o in enumerate(outcomes):  # returned, then crashed or failed while closing: a failure too
        code = procs[r].exitcode
        if o is not None and o.ok and r not in killed and code not in (0, None):
            why = "closing raised (see its stderr)" if code == CLOSE_FAILED else f"exit code {code}"
            outcomes[r] = Outcome(r, False, None, "ClosedBadly", f"returned, then {why}", "", o.elapsed)
    missing = [r for r, o in enumerate(outcomes) if o is None]
    if missing:
        report = "\n".join(str(o) for o in outcomes if o is not None)
        raise RankFailure(f"ranks {missing} did not finish within {timeout}s (killed)\n{report}")
    if expect_errors:
        return outcomes
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RankFailure("\n".join(str(o) for o in failed))
    return [o.value for o in outcomes]
