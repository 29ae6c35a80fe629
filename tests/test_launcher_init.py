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


def test_rank_cpus_gives_each_rank_a_share_or_a_core_round_robin(monkeypatch):
    from collectives.launcher import cpu_shares, rank_cpus

    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    assert rank_cpus(1, "auto") is None  # one rank: left to the kernel
    if n >= 2:  # a share each: disjoint, every allowed CPU used
        shares = rank_cpus(n, "auto")
        assert shares == cpu_shares(cores, n) and len(shares) == n
        assert sorted(c for share in shares for c in share) == cores
        two = rank_cpus(2, "auto")
        assert not two[0] & two[1] and two[0] | two[1] == set(cores)
    assert rank_cpus(n + 1, "none") is None
    bound = rank_cpus(2 * n + 1, "auto")  # more ranks than CPUs: one each, round robin
    assert bound == [{cores[r % n]} for r in range(2 * n + 1)]
    assert rank_cpus(1, "core") == [{cores[0]}]
    monkeypatch.setenv("COLLECTIVES_BIND", "core")
    assert rank_cpus(1) == [{cores[0]}]
    with pytest.raises(ValueError, match="bind must be one of"):
        rank_cpus(2, "sockets")


def _topology(root, siblings: dict[int, str], packages: dict[int, int]) -> str:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
        if cpu in packages:
            (d / "physical_package_id").write_text(f"{packages[cpu]}\n")
    return str(root)


def test_cpu_shares_keep_a_cores_threads_together_and_packages_apart(tmp_path):
    from collectives.launcher import cpu_shares

    # 2 packages of 2 cores of 2 threads; the kernel numbers a core's threads n and n + 4
    siblings = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}
    packages = {c: (c % 4) // 2 for c in range(8)}
    topo = _topology(tmp_path / "smt", siblings, packages)
    cpus = list(range(8))
    assert cpu_shares(cpus, 2, topo) == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert cpu_shares(cpus, 4, topo) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert cpu_shares(cpus, 3, topo) == [{0, 1, 4, 5}, {2, 6}, {3, 7}]  # as even as whole cores allow
    assert cpu_shares(cpus, 8, topo) == [{c} for c in cpus]  # fewer cores than ranks: a CPU each
    assert cpu_shares([0, 1, 2, 3], 2, topo) == [{0, 1}, {2, 3}]  # only the CPUs allowed (threads 4-7 are not)
    # a list in ranges, and CPUs the topology does not describe: a core each
    topo2 = _topology(tmp_path / "ranges", {0: "0-1", 1: "0-1"}, {0: 0, 1: 0})
    assert cpu_shares([0, 1, 2, 3], 2, topo2) == [{0, 1, 2}, {3}]  # three cores: the first rank gets two
    assert cpu_shares([0, 1, 2, 3], 3, topo2) == [{0, 1}, {2}, {3}]
    # no package numbers: the threads still go together
    topo3 = _topology(tmp_path / "nopackage", {c: f"{c % 2},{c % 2 + 2}" for c in range(4)}, {})
    assert cpu_shares([0, 1, 2, 3], 2, topo3) == [{0, 2}, {1, 3}]


def test_run_binds_each_rank_to_a_share_and_ranks_that_share_cores_round_robin(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    script = """
        import os, collectives
        comm = collectives.init()
        print("cpus", comm.rank, sorted(os.sched_getaffinity(0)), "shared", comm.transport.cores)
        comm.close()
    """
    if len(cores) >= 2:  # a share each, and the ranks count every core among them (so they spin)
        res = _run(["-n", "2"], script, tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        from collectives.launcher import cpu_shares

        for r, share in enumerate(cpu_shares(cores, 2)):
            assert f"cpus {r} {sorted(share)} shared {len(cores)}" in res.stdout, res.stdout
    n = len(cores) + 1
    res = _run(["-n", str(n)], script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(n):  # one core each, but the shared-memory ranks know they share all of them
        assert f"cpus {r} [{cores[r % len(cores)]}] shared {len(cores)}" in res.stdout
    res = _run(["-n", "2", "--bind", "none"], """
        import os
        print("cpus", os.environ["COLLECTIVES_RANK"], len(os.sched_getaffinity(0)))
    """, tmp_path)
    assert f"cpus 0 {len(cores)}" in res.stdout and f"cpus 1 {len(cores)}" in res.stdout


def test_a_rank_is_bound_before_its_program_starts():
    """The launcher binds each rank between fork and exec, so that even the
    first instruction of its program (here grep reading its own status) runs
    on the rank's cores; binding after the start raced with the program."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one CPU: ranks are left unbound")
    from collectives.launcher import _cpu_list, cpu_shares

    want = {r: ",".join(map(str, sorted(share))) for r, share in enumerate(cpu_shares(cores, 2))}
    for _ in range(5):
        res = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "2", "--timeout", "60",
                              "grep", "Cpus_allowed_list", "/proc/self/status"],
                             capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        for r in (0, 1):
            line = next(ln for ln in res.stdout.splitlines() if ln.startswith(f"[rank {r}]"))
            listed = line.split(":", 1)[1].strip()
            got = sorted(_cpu_list(listed))
            assert ",".join(map(str, got)) == want[r], (r, line)


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


def test_free_ports_lie_below_the_ephemeral_range_and_are_free():
    """The launcher's ports (MASTER_PORT, the tests' stores) come from below the
    kernel's ephemeral range: one from inside it could meanwhile become a
    rank's own outgoing connection to it (a TCP self-connect)."""
    import socket

    from collectives.launcher import PORTS_FROM, ephemeral_ports, free_port

    lo, hi = ephemeral_ports()
    assert 0 < lo <= hi
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, not one sequence every process repeats
    for port in ports:
        assert PORTS_FROM <= port < lo or lo <= PORTS_FROM, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
