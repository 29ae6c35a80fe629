"""Surviving a lost rank: agree, shrink to the survivors and carry on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from collectives import PeerLost
from harness import run_ranks

TIMEOUT = 5.0


def loop_until_a_rank_dies(comm, victim: int, at: int, second: int | None):
    """Allreduces; ``victim`` dies at step ``at``; the survivors shrink and go on
    to 40 steps; ``second`` (if any) dies while the others shrink."""
    x = np.ones(1000, np.float32)
    step, t_fail, shrink_s, resync = 0, None, None, False
    while step < 40:
        if comm.rank == victim and step == at and comm.epoch == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if resync:  # a survivor may have finished the step the others failed in: go on from the lowest
                steps = np.array([step], np.int64)
                comm.allreduce(steps, op="min")
                step, resync = int(steps[0]), False
            x[:] = comm.rank + 1
            comm.allreduce(x)
            want = sum(r + 1 for r in range(comm.size))
            if not np.all(x == want):
                return "wrong", float(x[0]), want
            step += 1
        except PeerLost:
            t_fail = time.monotonic()
            if second is not None and comm.rank == second:
                threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
            new = comm.shrink()
            shrink_s = time.monotonic() - t_fail
            comm.close()
            comm = new
            resync = True
    return "done", comm.rank, comm.size, comm.original_ranks, comm.epoch, shrink_s


@pytest.mark.parametrize("transport,p,victim", [("shm", 4, 2), ("shm", 4, 0), ("shm", 3, 1),
                                               ("zmq", 4, 2), ("zmq", 4, 0)])
def test_survivors_shrink_and_finish_with_correct_results(transport, p, victim):
    outcomes = run_ranks(loop_until_a_rank_dies, p, victim, 10, None, timeout=90, comm_timeout=TIMEOUT,
                         expect_errors=True, transport=transport)
    survivors = [o for o in outcomes if o.rank != victim]
    assert not outcomes[victim].ok
    assert sorted(o.value[1] for o in survivors) == list(range(p - 1)), [str(o) for o in outcomes]
    for o in survivors:
        assert o.ok and o.value[0] == "done", str(o)
        _, rank, size, original, epoch, shrink_s = o.value
        assert size == p - 1 and epoch == 1 and original == [r for r in range(p) if r != victim]
        assert original[rank] == o.rank  # the old order
        assert shrink_s < TIMEOUT + 2, shrink_s


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_second_failure_during_the_shrink_still_converges(transport):
    outcomes = run_ranks(loop_until_a_rank_dies, 4, 2, 10, 1, timeout=90, comm_timeout=TIMEOUT,
                         expect_errors=True, transport=transport)
    done = [o for o in outcomes if o.ok and o.value[0] == "done"]
    assert {o.rank for o in done} == {0, 3}, [str(o) for o in outcomes]
    for o in done:
        _, rank, size, original, epoch, _ = o.value
        assert size == 2 and original == [0, 3] and epoch in (1, 2), o.value


def agree_among_survivors(comm):
    """Rank 3 dies; the others agree on (rank != 1) and on who failed."""
    x = np.ones(4)
    try:  # rank 3 may die before a peer has finished the first allreduce: then it fails there
        comm.allreduce(x)
        if comm.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)
    except PeerLost:
        pass
    all_true = comm.agree(True)
    one_false = comm.agree(comm.rank != 1)
    failed = sorted(comm.failed_ranks())
    comm.agree(True)  # nobody leaves (and looks failed) before every survivor looked
    return all_true, one_false, failed


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_agree_is_an_and_over_the_survivors_with_the_same_failed_set(transport):
    outcomes = run_ranks(agree_among_survivors, 4, timeout=60, comm_timeout=TIMEOUT, expect_errors=True,
                         transport=transport)
    for o in outcomes[:3]:
        assert o.ok and o.value == (True, False, [3]), str(o)


def _inject_with_old_credentials(old, new):
    """Connect to new rank 1 as old rank 0 would (the old job's credentials,
    routing id 0) and send a message of the new epoch's first allreduce: the
    new transport must refuse the connection."""
    import zmq
    import zmq.utils.monitor

    from collectives.transports.rendezvous import JobCredentials
    from collectives.transports.zmq.wire import HEADER, KIND_DATA

    creds = JobCredentials(os.environ["COLLECTIVES_SECRET"], scope=old._job)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id = b"0"
    creds.client(sock)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(new.transport._peers[1].endpoint)
    sock.send(HEADER.pack(KIND_DATA, 3, 64, 0, 0, 0, 0) + np.full(8, 99.0).tobytes())
    assert mon.poll(10_000), "no handshake outcome within 10 s"
    event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
    sock.close(0)
    mon.close(0)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event


def old_epoch_messages(comm):
    """After a shrink, a message sent on the old communicator never reaches the new one."""
    x = np.ones(8)
    try:  # rank 2 may die before a peer has finished the first allreduce: then it fails there
        comm.allreduce(x)
        if comm.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)
    except PeerLost:
        pass
    new = comm.shrink()
    if comm.rank == 0:  # an old-epoch message with the new epoch's first collective tag, to rank 1
        if comm.transport.name == "zmq":
            _inject_with_old_credentials(comm, new)
        else:
            comm.transport.isend(np.full(8, 99.0), 1, 3)
    y = np.full(8, new.rank + 1.0)
    new.allreduce(y)
    new.barrier()
    return float(y[0])


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_old_epoch_messages_are_never_delivered_into_the_new_one(transport):
    outcomes = run_ranks(old_epoch_messages, 3, timeout=60, comm_timeout=TIMEOUT, expect_errors=True,
                         transport=transport)
    assert [o.value for o in outcomes[:2]] == [3.0, 3.0], [str(o) for o in outcomes]


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, collectives
    from collectives import PeerLost
    timeout = float(sys.argv[1])
    comm = collectives.init(timeout=timeout)
    x = np.ones(100, np.float32)
    step, wrong, shrunk_at = 0, 0, None
    while step < 30:
        if comm.rank == 1 and step == 5 and comm.epoch == 0:
            print(f"KILLED {time.monotonic()!r}", flush=True)  # one clock for every process of the machine
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x[:] = comm.original_ranks[comm.rank] + 1
            comm.allreduce(x)
            wrong += int(np.count_nonzero(x != sum(r + 1 for r in comm.original_ranks)))
            step += 1
        except PeerLost:
            new = comm.shrink(timeout=timeout)
            shrunk_at = time.monotonic()
            comm.close()
            comm = new
            steps = np.array([step], np.int64)  # a survivor may have finished the failed step: the lowest
            comm.allreduce(steps, op="min")
            step = int(steps[0])
    print(f"DONE {comm.original_ranks[comm.rank]} {comm.size} {comm.original_ranks} {wrong} {shrunk_at!r}",
          flush=True)
""")


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_the_launcher_lets_survivors_carry_on_and_reports_the_failure(tmp_path, transport):
    script = tmp_path / "elastic.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "4", "--transport", transport,
                           "--on-failure", "continue", str(script), str(TIMEOUT)],
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    killed = [float(line.split()[-1]) for line in proc.stdout.splitlines() if "KILLED" in line]
    done = sorted(line.split("DONE ", 1)[1].split(" ") for line in proc.stdout.splitlines() if "DONE" in line)
    assert len(killed) == 1 and len(done) == 3, out
    # Survivors 0, 2 and 3: 3 ranks, every allreduce right (over 4 ranks, then 3).
    assert [d[:-1] for d in done] == [[str(r), "3", "[0,", "2,", "3]", "0"] for r in (0, 2, 3)], out
    for d in done:
        assert float(d[-1]) - killed[0] < TIMEOUT + 2, (d, killed, out)  # shrunk within timeout + 2 s
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "rank 1 was killed by SIGKILL" in proc.stderr and "1 of 4 ranks failed" in proc.stderr, proc.stderr


LOST_BEFORE_JOINING = textwrap.dedent("""
    # Rank 1 dies; rank 2 dies after the survivors' agreement, before it opens
    # their new transport. The launcher leaves both unreaped (zombies).
    import os, signal, sys, time, numpy as np, collectives
    from collectives import PeerLost
    comm = collectives.init(timeout=float(sys.argv[1]))
    me = comm.rank
    cls = type(comm.transport)
    opened = cls.open.__func__
    def open_(cls, rank, size, *, job, timeout, options):
        if me == 2 and ".e1." in job:
            os.kill(os.getpid(), signal.SIGKILL)
        return opened(cls, rank, size, job=job, timeout=timeout, options=options)
    cls.open = classmethod(open_)
    x = np.ones(10)
    try:
        comm.allreduce(x)  # every rank is past init (a death during init fails init)
        if me == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)
        comm.allreduce(x)
    except PeerLost:
        t = time.monotonic()
        new = comm.shrink()
        took = time.monotonic() - t
        y = np.full(10, new.rank + 1.0)
        new.allreduce(y)
        print(f"DONE {me} {new.rank} {new.size} {new.original_ranks} {y[0]} {took:.3f}", flush=True)
""")


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_survivor_lost_before_it_joins_the_shrunk_transport_under_the_launcher(tmp_path, transport):
    """The launcher's --on-failure continue leaves dead ranks as zombies: they
    count as dead, so the survivors agree again at once (no timeout)."""
    script = tmp_path / "lost_before_joining.py"
    script.write_text(LOST_BEFORE_JOINING)
    timeout = 20.0
    proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "4", "--transport", transport,
                           "--on-failure", "continue", str(script), str(timeout)],
                          capture_output=True, text=True, timeout=120)
    done = sorted(line.split("DONE ", 1)[1] for line in proc.stdout.splitlines() if "DONE" in line)
    assert [d.rsplit(" ", 1)[0] for d in done] == ["0 0 2 [0, 3] 3.0", "3 1 2 [0, 3] 3.0"], proc.stdout + proc.stderr
    took = [float(d.rsplit(" ", 1)[1]) for d in done]
    assert max(took) < timeout / 2, (took, proc.stdout)  # agreed again, did not wait out the timeout
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "2 of 4 ranks failed" in proc.stderr, proc.stderr


def test_a_zombie_counts_as_dead():
    """A process that exited but is not reaped yet (as the launcher leaves a
    failed rank under --on-failure continue) is dead to shared memory's checks."""
    from collectives.transports.shm.liveness import PeerWatch, exited

    assert not exited(os.getpid()) and not PeerWatch({0: os.getpid()}).dead()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    watch = PeerWatch({1: child.pid})
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    with open(f"/proc/{child.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    try:
        assert exited(child.pid)
        assert watch.dead() == {1}
        assert PeerWatch({1: child.pid}).dead() == {1}
    finally:
        watch.close()
        child.wait(timeout=10)
    assert exited(child.pid)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_the_elastic_numpy_example_finishes_on_the_survivors(transport):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "elastic_numpy.py")
    proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "3", "--transport", transport,
                           "--on-failure", "continue", example, "--steps", "60", "--kill-rank", "1", "--kill-step", "20"],
                          capture_output=True, text=True, timeout=120)
    finals = [line for line in proc.stdout.splitlines() if "final loss" in line]
    assert len(finals) == 2 and all("of 2" in line and "epoch 1" in line for line in finals), proc.stdout
    losses = {line.rsplit(" ", 1)[1] for line in finals}
    assert len(losses) == 1 and float(losses.pop()) < 1e-3, finals  # the same model on both survivors
