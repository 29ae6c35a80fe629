"""Failures over the MPI transport under ``mpiexec`` (the mpich wheel's hydra).

A rank that raises, calls ``sys.exit(0)``, aborts or is killed in the
middle of a loop of allreduces; ranks whose calls disagree with equal byte
counts (dtype, op, collective), through the Communicator with our
algorithms and MPI's own; ranks that disagree on a rooted call's root; a
rank stopped with SIGSTOP (one verdict on every survivor, naming it, its
host and pid, and where each rank is); and the transport's own checks with
explicit signatures. Every run has a hard deadline (past it the whole process group
of mpiexec is killed) and every rank's outcome and time is checked; each
rank writes them to a file (see ``tests/mpi_failure_main.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from launched import environment_without

from collectives.bench.faults import remove_left

HERE = os.path.dirname(__file__)
MAIN = os.path.join(HERE, "mpi_failure_main.py")
MPIEXEC = shutil.which("mpiexec")
#: The ranks' communicator timeout (mpi_failure_main.TIMEOUT): no failure may wait for it.
COMM_TIMEOUT = 30.0
#: How long after the victim acts every other rank must have raised (generous: the machine is busy).
PROMPT = 3.0
#: Hard deadline of one mpiexec run.
DEADLINE = COMM_TIMEOUT + 60.0

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (mpich wheel) is not installed")


@dataclass
class Run:
    """One mpiexec run: its exit status, output, wall time and each rank's record."""

    returncode: int
    output: str
    wall: float
    ranks: dict[int, dict] = field(default_factory=dict)
    alive: dict[int, float] = field(default_factory=dict)

    def outcome(self, rank: int, case: str) -> dict:
        cases = self.ranks.get(rank, {}).get("cases", {})
        assert case in cases, f"rank {rank} recorded no outcome of {case!r}\n{self.output[-3000:]}"
        return cases[case]

    def acted_at(self, rank: int) -> float:
        at = self.ranks.get(rank, {}).get("acted_at")
        assert at is not None, f"rank {rank} did not record when it acted\n{self.output[-3000:]}"
        return at


def launch(tmp_path, p: int, *args: str) -> Run:
    """Run ``mpiexec -n p python mpi_failure_main.py OUTDIR *args`` within DEADLINE."""
    env = environment_without(("COLLECTIVES_", "PMI_"))
    cmd = [MPIEXEC, "-n", str(p), sys.executable, MAIN, str(tmp_path), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpiexec {' '.join(args)} was still running after {DEADLINE}s (killed)\n{output[-3000:]}")
    run = Run(proc.returncode, output, time.monotonic() - start)
    if args[0] != "kill":  # no rank, MPI_Finalize included, waited for a timeout
        assert run.wall < COMM_TIMEOUT, f"mpiexec took {run.wall:.1f}s\n{output[-3000:]}"
    for r in range(p):
        path = tmp_path / f"rank-{r}.json"
        if path.exists():
            run.ranks[r] = json.loads(path.read_text())
            remove_left(run.ranks[r].get("shm_files", []))  # the job has ended: what MPICH left of it goes
        beat = tmp_path / f"alive-{r}"
        if beat.exists() and beat.stat().st_size >= 8:
            run.alive[r] = struct.unpack("<d", beat.read_bytes()[:8])[0]
    return run


def _expect_prompt_error(run: Run, rank: int, case: str, since: float, kind: str, *words: str) -> float:
    """Rank ``rank`` raised ``kind`` naming ``words`` within PROMPT of ``since``; returns the delay."""
    out = run.outcome(rank, case)
    assert not out["ok"], f"rank {rank} completed {case!r}; it should have raised {kind}"
    assert out["error_type"] == kind, f"rank {rank}: {out['error_type']}: {out['message']}"
    for word in words:
        assert word in out["message"], f"rank {rank}: {word!r} not in {out['message']!r}"
    assert "MPI_Abort" not in out["message"]
    delay = out["ended_at"] - since
    assert delay < PROMPT, f"rank {rank} raised {delay:.3f}s after the victim acted (timeout {COMM_TIMEOUT}s)"
    return delay


def _report(what: str, delays: dict[int, float]) -> None:
    print(f"{what}: " + ", ".join(f"rank {r} {d * 1000:.1f} ms" for r, d in sorted(delays.items())))


# ------------------------------------------------------------- lifecycle

#: (algorithm, floats per allreduce): small messages, MPI's own, and 4 MiB
#: in segments (header and payload messages, receives held behind others).
LOOPS = [("auto", "1024"), ("native", "1024"), ("ring", str(1 << 20))]


@pytest.mark.parametrize("algorithm,count", LOOPS)
@pytest.mark.parametrize("p", [2, 3])
def test_a_rank_that_raises_is_named_by_every_other(p, algorithm, count, tmp_path):
    run = launch(tmp_path, p, "raise", algorithm, count)
    victim = p - 1
    acted = run.acted_at(victim)
    delays = {r: _expect_prompt_error(run, r, "raise", acted, "PeerLost", f"rank {victim} aborted",
                                      "RuntimeError: boom on purpose")
              for r in range(p) if r != victim}
    assert "raise" not in run.ranks[victim]["cases"]  # it raised out of the loop, uncaught
    assert "MPI_Abort" not in run.output
    assert run.returncode == 1, run.output[-3000:]  # the victim's status; no one was killed
    _report(f"raise, p={p}, {algorithm} x {count}", delays)


@pytest.mark.parametrize("algorithm,count", LOOPS)
@pytest.mark.parametrize("p", [2, 3])
def test_sys_exit_before_a_collective_is_peer_lost_at_once(p, algorithm, count, tmp_path):
    run = launch(tmp_path, p, "exit", algorithm, count)
    victim = p - 1
    acted = run.acted_at(victim)
    delays = {r: _expect_prompt_error(run, r, "exit", acted, "PeerLost",
                                      f"rank {victim} closed its communicator", "call #3")
              for r in range(p) if r != victim}
    assert "exit" not in run.ranks[victim]["cases"]
    assert run.returncode == 0, run.output[-3000:]
    _report(f"sys.exit(0), p={p}, {algorithm} x {count}", delays)


@pytest.mark.parametrize("algorithm,count", LOOPS)
@pytest.mark.parametrize("p", [2, 3])
def test_abort_reaches_every_rank(p, algorithm, count, tmp_path):
    run = launch(tmp_path, p, "abort", algorithm, count)
    victim = p - 1
    acted = run.acted_at(victim)
    delays = {r: _expect_prompt_error(run, r, "abort", acted, "PeerLost", f"rank {victim} aborted: x")
              for r in range(p) if r != victim}
    own = run.outcome(victim, "abort")  # its next call raises its own abort at once
    assert not own["ok"] and own["error_type"] == "PeerLost" and "x" in own["message"], own
    assert run.returncode == 0, run.output[-3000:]
    _report(f"abort, p={p}, {algorithm} x {count}", delays)


@pytest.mark.parametrize("algorithm", ["auto", "native"])
def test_sigkill_ends_the_job_through_mpiexec(algorithm, tmp_path):
    """Hydra kills every rank when one dies without MPI_Finalize: the library
    gets no say. Recorded: the exit status, the banner, and when each other
    rank stopped (its heartbeat). Asserted: the job ended (no hang) and no
    other rank finished the loop it could not finish."""
    p = 3
    run = launch(tmp_path, p, "kill", algorithm)
    victim = p - 1
    acted = run.acted_at(victim)
    seen = {r: run.ranks[r]["cases"].get("kill") for r in range(p) if r != victim}
    stopped = {r: run.alive[r] - acted for r in run.alive}
    print(f"SIGKILL, {algorithm}: mpiexec exited {run.returncode} after {run.wall:.2f}s; "
          f"banner: {'BAD TERMINATION' in run.output}; outcomes of the others: {seen}; "
          "the others' last heartbeat after the kill: "
          + ", ".join(f"rank {r} {d * 1000:.1f} ms" for r, d in sorted(stopped.items())))
    for r, out in seen.items():
        assert out is None or not out["ok"], f"rank {r} finished a loop whose peer was killed: {out}"
    assert run.returncode != 0


# ------------------------------------------------------------- mismatches

MISMATCH_WORDS = {"dtype": ("float32", "int32"), "op": ("op", "sum", "max"), "collective": ("allreduce", "bcast")}


@pytest.mark.parametrize("p", [2, 3])
def test_mismatches_with_equal_byte_counts_through_the_communicator(p, tmp_path):
    run = launch(tmp_path, p, "mismatch")
    assert run.returncode == 0, run.output[-3000:]
    assert run.ranks[0]["signed"], "the calls carried no signature"
    from mpi_failure_main import MISMATCH_CASES

    for kind, algorithm in MISMATCH_CASES:
        case = f"{kind}/{algorithm}"
        for r in range(p):
            out = run.outcome(r, case)
            assert not out["ok"], f"rank {r} completed {case}"
            assert out["error_type"] == "MismatchedCollective", f"{case}, rank {r}: {out}"
            for word in MISMATCH_WORDS[kind]:
                assert word in out["message"], f"{case}, rank {r}: {word!r} not in {out['message']!r}"
            assert out["elapsed"] < PROMPT, f"{case}, rank {r} took {out['elapsed']:.3f}s"


#: case -> (error type or "" for success, words the receiver's message names)
TRANSPORT_EXPECTED = {
    "dtype": ("MismatchedCollective", ("rank 0 has float32 x 1024", "rank 1 has int32 x 1024")),
    "dtype-large": ("MismatchedCollective", ("float32 x 262144", "int32 x 262144")),
    "op": ("MismatchedCollective", ("op: rank 0 has sum, rank 1 has max",)),
    "op-large": ("MismatchedCollective", ("op: rank 0 has sum, rank 1 has max",)),
    "collective": ("MismatchedCollective", ("collective: rank 0 has allreduce, rank 1 has bcast",)),
    "larger": ("MismatchedCollective", ("expected 4096 bytes from rank 0, got 8192",)),
    "smaller": ("MismatchedCollective", ("expected 4096 bytes from rank 0, got 2048",)),
    "larger-large": ("MismatchedCollective", ("expected 1048576 bytes from rank 0, got 2097152",)),
    "large-into-small": ("MismatchedCollective", ("expected 4096 bytes from rank 0, got 1048576",)),
    "small-into-large": ("MismatchedCollective", ("expected 1048576 bytes from rank 0, got 4096",)),
    "out-of-step": ("MismatchedCollective", ("waits for a message of call #5 from rank 0",
                                             "sent one of allreduce #6")),
    "out-of-step-large": ("MismatchedCollective", ("waits for a message of call #5 from rank 0",
                                                   "sent one of allreduce #6")),
    "refused": ("BadArgument", ("refused by its root, rank 0",)),
    "agree": ("", ()),
    "agree-large": ("", ()),
    "point-to-point": ("", ()),
    "empty": ("", ()),
}


def test_transport_checks_explicit_signatures(tmp_path):
    """Rank 0 sends, rank 1 receives with its own signature and size; the
    next message on that pair must still arrive whole. MPI's own collectives
    agree on the signature first, and a refusing root's reason reaches every
    rank. An abort lets the peers finish the calls before the first one the
    aborting rank did not complete."""
    p = 2
    run = launch(tmp_path, p, "transport")
    assert run.returncode == 0, run.output[-3000:]
    for case, (kind, words) in TRANSPORT_EXPECTED.items():
        sender, receiver = run.outcome(0, case), run.outcome(1, case)
        assert sender["ok"], f"{case}: the sender failed: {sender}"
        assert sender["elapsed"] < PROMPT and receiver["elapsed"] < PROMPT, (case, sender, receiver)
        if not kind:
            assert receiver["ok"], f"{case}: {receiver}"
            continue
        assert not receiver["ok"] and receiver["error_type"] == kind, f"{case}: {receiver}"
        for word in words:
            assert word in receiver["message"], f"{case}: {word!r} not in {receiver['message']!r}"
    for r in range(p):
        dtype = run.outcome(r, "native-dtype")
        assert dtype["error_type"] == "MismatchedCollective", dtype
        assert "rank 0 has float32 x 256, rank 1 has int32 x 256" in dtype["message"], dtype
        refused = run.outcome(r, "native-refused")
        assert refused["error_type"] == "BadArgument", refused
        assert "recvbuf too small on purpose" in refused["message"] and "rank 0" in refused["message"], refused
        assert dtype["elapsed"] < PROMPT and refused["elapsed"] < PROMPT
    for r in range(p):  # rank 1 got call #5's message whole, then call #6 raised rank 0's abort
        aborted = run.outcome(r, "abort-after-call")
        assert aborted["error_type"] == "PeerLost", aborted
        assert "rank 0 aborted: gave up on purpose" in aborted["message"], aborted
        assert aborted["elapsed"] < PROMPT, aborted


# ------------------------------------------- rank programs in this module


def _launch_here(tmp_path, p: int, main: str, *args: str) -> subprocess.Popen:
    """``mpiexec -n p`` of this module's function ``main(OUTDIR, *args)``."""
    call = ", ".join(repr(a) for a in (str(tmp_path), *args))
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_mpi_failures as t; t.{main}({call})"
    env = environment_without(("COLLECTIVES_", "PMI_"))
    return subprocess.Popen([MPIEXEC, "-n", str(p), sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _write(outdir: str, rank: int, out: dict) -> None:
    path = os.path.join(outdir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def roots_main(outdir: str, collective: str, roots: str) -> None:
    """One rank of :func:`test_ranks_that_disagree_on_the_root_raise_in_that_call`:
    rank r takes ``roots[r]`` (comma-separated) for the root of ``collective``."""
    import numpy as np

    import collectives
    from collectives.errors import CollectiveError

    comm = collectives.init(transport="mpi", timeout=COMM_TIMEOUT)
    x = np.zeros(16, np.float32)
    comm.allreduce(x)
    root = [int(r) for r in roots.split(",")][comm.rank]
    start = time.monotonic()
    try:
        if collective == "bcast":
            comm.bcast(x, root=root)
        else:
            comm.gather(x, np.zeros(16 * comm.size, np.float32) if comm.rank == root else None, root=root)
        out = {"ok": True, "error_type": "", "message": ""}
    except CollectiveError as exc:
        out = {"ok": False, "error_type": type(exc).__name__, "message": str(exc)}
    out["elapsed"] = time.monotonic() - start
    _write(outdir, comm.rank, out)
    comm.close()


@pytest.mark.parametrize("collective", ["bcast", "gather"])
@pytest.mark.parametrize("roots,said", [("0,1", "root: rank 0 has 0, rank 1 has 1"),
                                        ("1,0,0", "root: rank 0 has 1, ranks 1, 2 have 0")])
def test_ranks_that_disagree_on_the_root_raise_in_that_call(collective, roots, said, tmp_path):
    """Ranks that each take themselves for the root (each would only send),
    or each another (each would only wait): every rank raises
    MismatchedCollective in that call, at once, naming the ranks' roots."""
    p = len(roots.split(","))
    proc = _launch_here(tmp_path, p, "roots_main", collective, roots)
    try:
        output, _ = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpiexec was still running after {DEADLINE}s (killed)\n{output[-3000:]}")
    for r in range(p):
        path = tmp_path / f"rank-{r}.json"
        assert path.exists(), f"rank {r} wrote nothing\n{output[-3000:]}"
        out = json.loads(path.read_text())
        assert out["error_type"] == "MismatchedCollective", f"rank {r}: {out}"
        assert said in out["message"] and f"{collective} #2" in out["message"], f"rank {r}: {out}"
        assert out["elapsed"] < PROMPT, f"rank {r} took {out['elapsed']:.2f}s"


# ------------------------------------------------------------- a hung rank

#: The communicators' timeout in the stopped-rank test.
STOP_TIMEOUT = 2.0


def stopped_main(outdir: str) -> None:
    """One rank of :func:`test_a_stopped_rank_is_named_by_one_verdict` (run
    under mpiexec): after one allreduce, the last rank writes its pid and
    stops itself (SIGSTOP) before the next; every rank writes its outcome of
    that next allreduce to OUTDIR/rank-N.json (the stopped one once the test
    continues it)."""
    import numpy as np

    import collectives
    from collectives.errors import CollectiveError

    comm = collectives.init(transport="mpi", timeout=STOP_TIMEOUT)
    x = np.ones(1024, np.float32)
    comm.allreduce(x)
    victim = comm.size - 1
    if comm.rank == victim:
        with open(os.path.join(outdir, "victim.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(outdir, "victim.tmp"), os.path.join(outdir, "victim"))
        os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it once the others have written
    start = time.monotonic()
    try:
        comm.allreduce(x)
        out = {"ok": True, "error_type": "", "message": ""}
    except CollectiveError as exc:
        out = {"ok": False, "error_type": type(exc).__name__, "message": str(exc)}
    out.update(elapsed=time.monotonic() - start, pid=os.getpid())
    _write(outdir, comm.rank, out)
    comm.close()


def test_a_stopped_rank_is_named_by_one_verdict(tmp_path):
    """Rank 2 of 3 is stopped (SIGSTOP) before a call: ranks 0 and 1 raise
    CollectiveTimeout within the timeout and a second, with the same verdict:
    rank 2, its host and pid, has not arrived (no answer), and where each
    rank is (its collective and call number); "timed out" is said once. The
    stopped rank raises too once it runs again (the verdict aborted the job)."""
    p, victim = 3, 2
    proc = _launch_here(tmp_path, p, "stopped_main")
    done = [tmp_path / f"rank-{r}.json" for r in range(p) if r != victim]
    try:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline and proc.poll() is None and not all(d.exists() for d in done):
            time.sleep(0.05)  # polls for the ranks' files; orders nothing
        if (tmp_path / "victim").exists():
            os.kill(int((tmp_path / "victim").read_text()), signal.SIGCONT)
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpiexec was still running after {DEADLINE}s (killed)\n{output[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    outs = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(p)
            if (tmp_path / f"rank-{r}.json").exists()}
    assert set(outs) == set(range(p)), f"ranks {sorted(set(range(p)) - set(outs))} wrote nothing\n{output[-3000:]}"
    pid = outs[victim]["pid"]
    verdicts = set()
    for r in range(p):
        out = outs[r]
        assert out["error_type"] == "CollectiveTimeout", f"rank {r}: {out}"
        message = out["message"]
        if r == victim:
            assert "aborted" in message, f"the stopped rank: {message}"
            continue
        assert out["elapsed"] < STOP_TIMEOUT + 1.0, f"rank {r} took {out['elapsed']:.2f}s: {message}"
        assert re.search(rf"rank {victim} \(host [^,()]+, pid {pid}\) has not arrived: no answer", message), message
        assert re.search(r"where each rank is: rank 0 in allreduce #2 \(\w+\): sum of float32 x 1024 for [\d.]+ s, "
                         r"waiting for rank \d; rank 1 in allreduce #2 .* for [\d.]+ s, waiting for rank \d; "
                         rf"rank {victim} did not answer", message), message
        assert message.count("timed out") == 1, message
        verdicts.add(message[message.index("verdict: "):])
    assert len(verdicts) == 1, verdicts
