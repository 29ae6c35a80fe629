"""One rank of the MPI failure tests (see ``tests/test_mpi_failures.py``).

Run as ``mpiexec -n P python tests/mpi_failure_main.py OUTDIR SCENARIO [ALGORITHM [COUNT]]``.
Each rank writes ``OUTDIR/rank-N.json`` (the ranks' standard outputs
interleave): for every case it ran, its outcome (ok, or the error's type
and message), when it ended (``time.time()``: ranks of one host share the
clock) and how long it took; the victim of a scenario also writes when it
acted, before it acts.

Scenarios: ``raise``, ``exit``, ``abort``, ``kill`` (the last rank raises,
calls ``sys.exit(0)``, calls ``comm.abort("x")`` or kills itself with
SIGKILL in the middle of a loop of allreduces; under ``kill`` the others
also write the time to ``OUTDIR/alive-N`` every millisecond, to show when
mpiexec ended them); ``mismatch`` (rank 0 calls
another dtype, op or collective than the others, through the Communicator);
``transport`` (the same disagreements, and sizes, call numbers, refusals
and an abort that lets an earlier call finish, between raw MPI transports
with explicit signatures).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import collectives  # noqa: E402
from collectives import errors, signature  # noqa: E402
from collectives.bench.faults import mapped_shm_files  # noqa: E402
from collectives.context import CallContext  # noqa: E402
from collectives.errors import CollectiveError  # noqa: E402
from collectives.ops import get_op  # noqa: E402

#: The communicators' timeout: every failure must be seen long before it.
TIMEOUT = 30.0
#: The loop iteration at which the victim acts.
ACT_AT = 2


class Record:
    """What this rank did, written to OUTDIR/rank-N.json after every case."""

    def __init__(self, outdir: str, rank: int, size: int) -> None:
        self.path = os.path.join(outdir, f"rank-{rank}.json")
        # (MPICH's segments: a job whose rank was killed leaves them, and the test removes them)
        self.data: dict = {"rank": rank, "size": size, "cases": {}, "acted_at": None, "signed": None,
                           "shm_files": mapped_shm_files()}

    def run(self, name: str, body) -> None:
        """Run ``body()`` as case ``name`` and record its outcome."""
        start = time.time()
        try:
            body()
            outcome = {"ok": True, "error_type": "", "message": ""}
        except CollectiveError as exc:
            outcome = {"ok": False, "error_type": type(exc).__name__, "message": str(exc)}
        now = time.time()
        outcome.update(ended_at=now, elapsed=now - start)
        self.data["cases"][name] = outcome
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


# ------------------------------------------------------------- lifecycle


def heartbeat(outdir: str, rank: int) -> None:
    """Write the time to OUTDIR/alive-N every millisecond or so, from a daemon
    thread: when the rank stops, the file says when (a SIGKILL leaves no
    other trace)."""
    fd = os.open(os.path.join(outdir, f"alive-{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)

    def beat() -> None:
        while True:
            os.pwrite(fd, struct.pack("<d", time.time()), 0)
            time.sleep(0.001)

    threading.Thread(target=beat, daemon=True).start()


def lifecycle(record: Record, scenario: str, algorithm: str, count: int, outdir: str) -> None:
    """A loop of allreduces of ``count`` floats; the last rank acts at iteration ACT_AT."""
    comm = collectives.init(transport="mpi", timeout=TIMEOUT)
    victim = comm.size - 1
    if scenario == "kill" and comm.rank != victim:
        heartbeat(outdir, comm.rank)
    x = np.ones(count, np.float32)

    def loop() -> None:
        for i in range(5):
            if comm.rank == victim and i == ACT_AT:
                act(record, comm, scenario)
            comm.allreduce(x, algorithm=algorithm)

    record.run(scenario, loop)
    comm.close()


def act(record: Record, comm, scenario: str) -> None:
    """What the victim does (recorded first: it may not come back)."""
    record.data["acted_at"] = time.time()
    record.save()
    if scenario == "raise":
        raise RuntimeError("boom on purpose")  # uncaught: the excepthook aborts the communicator
    if scenario == "exit":
        sys.exit(0)  # atexit closes the communicator
    if scenario == "abort":
        comm.abort("x")
        return
    if scenario == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------- mismatches


def _calls(rank: int, kind: str, algorithm: str):
    """This rank's call in a mismatch of ``kind``: rank 0 differs from the others."""
    n = 1024
    if kind == "dtype":
        x = np.ones(n, np.float32 if rank == 0 else np.int32)
        return lambda comm: comm.allreduce(x, "sum", algorithm=algorithm)
    if kind == "op":
        x = np.ones(n, np.float32)
        return lambda comm: comm.allreduce(x, "sum" if rank == 0 else "max", algorithm=algorithm)
    if kind == "collective":
        x = np.ones(n, np.float32)
        if rank == 0:
            return lambda comm: comm.allreduce(x, "sum", algorithm=algorithm)
        bcast = "native" if algorithm == "native" else "binomial"
        return lambda comm: comm.bcast(x, 0, algorithm=bcast)
    raise ValueError(kind)


MISMATCH_CASES = [(kind, algorithm) for kind in ("dtype", "op", "collective")
                  for algorithm in ("ring", "recursive_doubling", "native")]


def mismatch(record: Record) -> None:
    """Each case on a fresh communicator (the last one is aborted by its error)."""
    comm = collectives.init(transport="mpi", timeout=TIMEOUT)
    comm.barrier()
    record.data["signed"] = comm.transport.call_signature != signature.NO_SIG
    record.save()
    comm.close()
    if not record.data["signed"]:
        return
    for kind, algorithm in MISMATCH_CASES:
        comm = collectives.init(transport="mpi", timeout=TIMEOUT)
        call = _calls(comm.rank, kind, algorithm)
        record.run(f"{kind}/{algorithm}", lambda: call(comm))
        comm.close()


# ------------------------------------------------- transport-level checks


def _sig(collective: str, dtype, count: int, seq: int, op: str | None = "sum", root: int | None = None,
         algorithm: str = "ring") -> signature.Sig:
    return signature.with_seq(signature.make(collective, algorithm, op, root, np.dtype(dtype), count), seq)


SEQ = 5
TAG = 2 * SEQ + 1
SMALL, LARGE = 1024, 1 << 18  # elements of 4 bytes: one message; a header and a payload message
F32 = _sig("allreduce", np.float32, SMALL, SEQ)
F32_LARGE = _sig("allreduce", np.float32, LARGE, SEQ)

#: name -> (sender's bytes, sender's sig, sender's tag, receiver's bytes, receiver's sig, receiver's tag)
TRANSPORT_CASES = {
    "dtype": (4 * SMALL, F32, TAG, 4 * SMALL, _sig("allreduce", np.int32, SMALL, SEQ), TAG),
    "dtype-large": (4 * LARGE, F32_LARGE, TAG, 4 * LARGE, _sig("allreduce", np.int32, LARGE, SEQ), TAG),
    "op": (4 * SMALL, F32, TAG, 4 * SMALL, _sig("allreduce", np.float32, SMALL, SEQ, "max"), TAG),
    "op-large": (4 * LARGE, F32_LARGE, TAG, 4 * LARGE, _sig("allreduce", np.float32, LARGE, SEQ, "max"), TAG),
    "collective": (4 * SMALL, F32, TAG, 4 * SMALL, _sig("bcast", np.float32, SMALL, SEQ, None, 0, "binomial"),
                   TAG),
    "larger": (8 * SMALL, F32, TAG, 4 * SMALL, F32, TAG),
    "smaller": (2 * SMALL, F32, TAG, 4 * SMALL, F32, TAG),
    "larger-large": (8 * LARGE, F32_LARGE, TAG, 4 * LARGE, F32_LARGE, TAG),
    "large-into-small": (4 * LARGE, F32, TAG, 4 * SMALL, F32, TAG),
    "small-into-large": (4 * SMALL, F32_LARGE, TAG, 4 * LARGE, F32_LARGE, TAG),
    "out-of-step": (4 * SMALL, _sig("allreduce", np.float32, SMALL, SEQ + 1), TAG + 2, 4 * SMALL, F32, TAG),
    "out-of-step-large": (4 * LARGE, _sig("allreduce", np.float32, LARGE, SEQ + 1), TAG + 2, 4 * LARGE,
                          F32_LARGE, TAG),
    "refused": (4 * SMALL, signature.refused(_sig("bcast", np.float32, SMALL, SEQ, None, 0, "binomial")), TAG,
                4 * SMALL, _sig("bcast", np.float32, SMALL, SEQ, None, 0, "binomial"), TAG),
    "agree": (4 * SMALL, F32, TAG, 4 * SMALL, F32, TAG),
    "agree-large": (4 * LARGE, F32_LARGE, TAG, 4 * LARGE, F32_LARGE, TAG),
    "point-to-point": (4 * SMALL, signature.NO_SIG, 2, 4 * SMALL, signature.NO_SIG, 2),
    "empty": (0, signature.NO_SIG, 4, 0, signature.NO_SIG, 4),
}


def _open_transport():
    from mpi4py import MPI

    from collectives.transports.mpi import MpiTransport

    return MpiTransport(MPI.COMM_WORLD, timeout=TIMEOUT)


def transport_case(t, name: str) -> None:
    """Rank 0 sends, rank 1 receives (twice: the second message must still
    arrive whole after a refused first one); the others watch."""
    nsend, ssig, stag, nrecv, rsig, rtag = TRANSPORT_CASES[name]
    deadline = 10.0
    if t.rank == 0:
        payload = (np.arange(nsend, dtype=np.int64) % 251).astype(np.uint8)
        t.isend(payload, 1, stag, ssig).wait(deadline)
        t.isend(np.full(16, 7, np.uint8), 1, 1000, signature.NO_SIG).wait(deadline)
    elif t.rank == 1:
        got = np.zeros(nrecv, np.uint8)
        try:
            t.irecv(got, 0, rtag, rsig).wait(deadline)
            if not np.array_equal(got, (np.arange(nsend, dtype=np.int64) % 251).astype(np.uint8)):
                raise AssertionError(f"{name}: the payload arrived changed")
        finally:
            after = np.zeros(16, np.uint8)
            t.irecv(after, 0, 1000, signature.NO_SIG).wait(deadline)
            if not (after == 7).all():
                raise AssertionError(f"{name}: the next message arrived changed: {after}")


def native_case(t, name: str, reason: str | None) -> None:
    """MPI's own allreduce (or, refused, bcast) with explicit signatures:
    rank 0's signature differs (dtype) or rank 0, the root, refused."""
    n = 256
    x = np.ones(n, np.float32 if t.rank == 0 or name != "native-dtype" else np.int32)
    if name == "native-dtype":
        sig = _sig("allreduce", x.dtype, n, SEQ, algorithm="native")
    else:
        sig = _sig("bcast", x.dtype, n, SEQ, None, 0, "native")
        if t.rank == 0:
            sig = signature.refused(sig)
    t.begin_call(SEQ, sig, reason if t.rank == 0 else None)
    ctx = CallContext(t, TAG, time.monotonic() + 10.0, sig=sig)
    if name == "native-dtype":
        t.native("allreduce")(ctx, x, get_op("sum"))
    else:
        t.native("bcast")(ctx, x, 0)


REFUSAL = "recvbuf too small on purpose"


def abort_case(t) -> None:
    """Rank 0 aborts with call SEQ + 1 as the first it did not complete, then
    still sends call SEQ's message: rank 1 receives it whole, and its receive
    of call SEQ + 1 raises the abort, as does every later call on rank 0."""
    x = np.arange(64, dtype=np.uint8)
    if t.rank == 0:
        t.abort(errors.abort_reason(errors.PeerLost("gave up on purpose", 0)), SEQ + 1)
        t.isend(x, 1, TAG, F32).wait(10.0)
        t.irecv(np.zeros(64, np.uint8), 1, TAG + 2, F32)  # raises at once
    elif t.rank == 1:
        got = np.zeros(64, np.uint8)
        t.irecv(got, 0, TAG, F32).wait(10.0)
        if not np.array_equal(got, x):
            raise AssertionError("call #5's message arrived changed")
        t.irecv(np.zeros(64, np.uint8), 0, TAG + 2, F32).wait(10.0)


def transport_checks(record: Record) -> None:
    """Every case on a fresh transport (MpiTransport duplicates COMM_WORLD: in step)."""
    for name in TRANSPORT_CASES:
        t = _open_transport()
        record.run(name, lambda: transport_case(t, name))
        t.close()
    for name in ("native-dtype", "native-refused"):
        t = _open_transport()
        record.run(name, lambda: native_case(t, name, REFUSAL))
        t.close()
    t = _open_transport()
    record.run("abort-after-call", lambda: abort_case(t))
    t.close()


def main() -> None:
    from mpi4py import MPI

    outdir, scenario = sys.argv[1], sys.argv[2]
    algorithm = sys.argv[3] if len(sys.argv) > 3 else "auto"
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
    record = Record(outdir, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    record.save()
    if scenario in ("raise", "exit", "abort", "kill"):
        lifecycle(record, scenario, algorithm, count, outdir)
    elif scenario == "mismatch":
        mismatch(record)
    elif scenario == "transport":
        transport_checks(record)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
