"""The launcher (collectives run) and init() from launchers' environments."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from collectives import BadArgument, detect_launch, init


def _run(args, script, tmp_path, timeout=90):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, "-m", "collectives.cli", "run", *args, str(path)],
                          capture_output=True, text=True, timeout=timeout)


def test_run_starts_ranks_with_prefixed_output(tmp_path):
    res = _run(["-n", "3"], """
        import numpy as np, collectives
        comm = collectives.init()
        x = np.array([comm.rank + 1.0])
        comm.allreduce(x)
        print("result", comm.rank, comm.size, comm.transport.name, x[0])
        comm.close()
    """, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(3):
        assert f"[rank {r}] result {r} 3 shm 6.0" in res.stdout


def test_run_stops_every_rank_when_one_fails(tmp_path):
    t0 = time.monotonic()
    res = _run(["-n", "3"], """
        import os, sys, time
        if os.environ["COLLECTIVES_RANK"] == "1":
            sys.exit(7)
        time.sleep(60)
    """, tmp_path)
    assert res.returncode == 7
    assert "rank 1 exited with status 7" in res.stderr
    assert time.monotonic() - t0 < 30


def test_rank_cpus_binds_round_robin_when_ranks_outnumber_cores(monkeypatch):
    from collectives.launcher import rank_cpus

    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    assert rank_cpus(n, "auto") is None  # a core each: left to the kernel
    assert rank_cpus(n + 1, "none") is None
    bound = rank_cpus(2 * n + 1, "auto")
    assert bound == [{cores[r % n]} for r in range(2 * n + 1)]
    assert rank_cpus(1, "core") == [{cores[0]}]
    monkeypatch.setenv("COLLECTIVES_BIND", "core")
    assert rank_cpus(1) == [{cores[0]}]
    with pytest.raises(ValueError, match="bind must be one of"):
        rank_cpus(2, "sockets")


def test_run_binds_ranks_that_share_cores(tmp_path):
    n = len(os.sched_getaffinity(0)) + 1
    res = _run(["-n", str(n)], """
        import os, collectives
        comm = collectives.init()
        print("cpus", comm.rank, sorted(os.sched_getaffinity(0)), "shared", comm.transport.cores)
        comm.close()
    """, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    cores = sorted(os.sched_getaffinity(0))
    for r in range(n):  # one core each, but the shared-memory ranks know they share all of them
        assert f"cpus {r} [{cores[r % len(cores)]}] shared {len(cores)}" in res.stdout
    res = _run(["-n", str(n), "--bind", "none"], """
        import os
        print("cpus", os.environ["COLLECTIVES_RANK"], len(os.sched_getaffinity(0)))
    """, tmp_path)
    assert f"cpus 0 {len(cores)}" in res.stdout


def test_failing_rank_turns_into_errors_on_the_others(tmp_path):
    res = _run(["-n", "3"], """
        import numpy as np, collectives
        comm = collectives.init(timeout=20)
        if comm.rank == 2:
            raise SystemExit(5)
        try:
            comm.allreduce(np.ones(10))
        except collectives.CollectiveError as exc:
            print("peer error", type(exc).__name__)
            raise SystemExit(4)
    """, tmp_path)
    assert res.returncode in (4, 5), res.stdout + res.stderr


def test_detect_ours():
    info = detect_launch({"COLLECTIVES_RANK": "2", "COLLECTIVES_SIZE": "4", "COLLECTIVES_JOB": "j",
                          "COLLECTIVES_TRANSPORT": "zmq", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (info.rank, info.size, info.launcher, info.job, info.transport) == (2, 4, "collectives", "j", "zmq")
    assert info.options["master_addr"] == "10.0.0.1"


def test_detect_torchrun():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    info = detect_launch(env)
    assert (info.rank, info.size, info.launcher, info.all_local) == (1, 4, "torchrun", True)
    assert detect_launch({**env, "LOCAL_WORLD_SIZE": "2"}).all_local is False
    assert detect_launch({**env, "RANK": "3"}).job == info.job


@pytest.mark.parametrize("env,want", [({"PMI_RANK": "3", "PMI_SIZE": "5"}, (3, 5)),
                                      ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, (0, 2))])
def test_detect_mpiexec(env, want):
    info = detect_launch(env)
    assert (info.rank, info.size, info.launcher) == (*want, "mpiexec")


def test_detect_nothing_is_a_single_rank():
    info = detect_launch({})
    assert (info.rank, info.size, info.launcher) == (0, 1, "none")


def test_init_rejects_bad_rank():
    with pytest.raises(BadArgument):
        init(rank=3, size=2, transport="shm")


def test_rank_environment_on_one_node_and_on_several():
    from collectives.launcher import rank_environment

    one = rank_environment(1, 3, job="j", secret="s", master_port=1234, base={})
    assert {k: one[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COLLECTIVES_LOCAL")} == {
        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "NODE_RANK": "0",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
        "COLLECTIVES_LOCAL": "1"}
    several = rank_environment(4, 5, job="j", secret="s", master_port=1234, base={}, local_rank=0, local_size=1,
                               node_rank=2, nnodes=3, master_addr="10.0.0.1")
    assert (several["RANK"], several["LOCAL_RANK"], several["LOCAL_WORLD_SIZE"], several["NODE_RANK"],
            several["GROUP_WORLD_SIZE"], several["MASTER_ADDR"], several["COLLECTIVES_LOCAL"]) == (
        "4", "0", "1", "2", "3", "10.0.0.1", "0")
    assert "OMP_NUM_THREADS" not in several  # alone on its node: no thread limit


def test_detect_reads_local_and_node_ranks():
    ours = detect_launch({"COLLECTIVES_RANK": "3", "COLLECTIVES_SIZE": "4", "COLLECTIVES_LOCAL": "0",
                          "LOCAL_RANK": "1", "NODE_RANK": "1"})
    assert (ours.local_rank, ours.node_rank, ours.all_local) == (1, 1, False)
    torch = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert (torch.local_rank, torch.node_rank) == (1, 1)
    assert detect_launch({}).local_rank is None
