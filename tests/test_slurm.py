"""Slurm: host lists, and ``collectives.init()`` under ``srun``.

The environment of an srun task is the one Slurm 22.05 sets (taken from a
real ``srun -n 2`` and a real batch script); tasks are real processes that
run collectives. Where a Slurm cluster answers here (``sinfo``), a real
``srun -n 2`` runs too; otherwise that test skips, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from launched import LAUNCH_NAMES, environment_without

from collectives import BadArgument, detect_launch
from collectives.environment import SLURM_PORT_BASE, SLURM_PORT_SPAN, slurm_port
from collectives.hostlist import MAX_HOSTS, expand, first_host
from collectives.launcher import free_port

DEADLINE = 90.0


# -- host lists ---------------------------------------------------------------------
# What `scontrol show hostnames` prints for each (Slurm 22.05).

@pytest.mark.parametrize("text,hosts", [
    ("vm", ["vm"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2]-b[3,5]", ["gpu-a1-b3", "gpu-a1-b5", "gpu-a2-b3", "gpu-a2-b5"]),
    ("n1,n[3-5]", ["n1", "n3", "n4", "n5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[1-2],b[3]", ["a1", "a2", "b3"]),
    ("n[1-3,5]x[7]", ["n1x7", "n2x7", "n3x7", "n5x7"]),
    ("a,,b", ["a", "b"]),
    (" a , b ", ["a", "b"]),
    ("a-b", ["a-b"]),
    ("", []),
])
def test_expand_as_scontrol_does(text, hosts):
    assert expand(text) == hosts
    if hosts:
        assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text,says", [
    ("a[2-1]", "range '2-1' ends before it starts"),
    ("a[1-2", "'[' without ']'"),
    ("a]1", "']' without '['"),
    ("a[[1]]", "nested '['"),
    ("a[]", "empty brackets"),
    ("a[1,,2]", "'' is not a number"),
    ("a[x-y]", "'x-y' is not a number"),
    ("a[1-]", "'1-' is not a number"),
])
def test_invalid_host_lists_are_named(text, says):
    with pytest.raises(BadArgument) as info:
        expand(text)
    assert says in str(info.value) and repr(text) in str(info.value)


def test_host_lists_too_large_are_refused_before_expanding():
    with pytest.raises(BadArgument, match=f"more than {MAX_HOSTS} hosts"):
        expand("n[0-999999999]")
    with pytest.raises(BadArgument, match=f"more than {MAX_HOSTS} hosts"):
        expand("a[0-1023]-b[0-1024]")
    with pytest.raises(BadArgument, match="names no host"):
        first_host(" , ")


# -- what init() reads under srun ----------------------------------------------------

def srun_task(procid: int, ntasks: int = 2, *, nodelist: str = "vm", nodes: int = 1, job: str = "41",
              step: str = "0", localid: int | None = None, nodeid: int = 0) -> dict[str, str]:
    """The variables srun sets for one task (those init may read, and others)."""
    return {
        "SLURM_CLUSTER_NAME": "one", "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_STEP_ID": step,
        "SLURM_STEPID": step, "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_LOCALID": str(procid if localid is None else localid), "SLURM_NODEID": str(nodeid),
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_GTIDS": ",".join(map(str, range(ntasks))), "SLURM_SUBMIT_DIR": "/tmp", "SLURMD_NODENAME": "vm",
    }


def batch_script() -> dict[str, str]:
    """What a batch script (sbatch -n 2) sees: SLURM_PROCID=0 but no step."""
    env = srun_task(0)
    for key in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS",
                "SLURM_STEP_NUM_NODES"):
        del env[key]
    return env


def test_srun_task_is_recognised():
    env = srun_task(3, 8, nodelist="node[01-04,07]", nodes=4, localid=1, nodeid=1)
    info = detect_launch(env)
    assert (info.rank, info.size, info.launcher, info.local_rank, info.node_rank) == (3, 8, "slurm", 1, 1)
    assert info.job == "slurm-41.0" and info.all_local is False
    assert info.options["master_addr"] == "node01"
    assert info.options["master_port"] == str(slurm_port("41", "0"))


def test_every_task_of_a_step_agrees_and_the_next_step_differs():
    infos = [detect_launch(srun_task(r, 4)) for r in range(4)]
    assert len({(i.job, i.options["master_addr"], i.options["master_port"]) for i in infos}) == 1
    assert all(i.all_local for i in infos)  # one node: shared memory with transport="auto"
    ports = {slurm_port("41", str(step)) for step in range(50)} | {slurm_port(str(j), "0") for j in range(50)}
    assert len(ports) > 90 and all(SLURM_PORT_BASE <= p < SLURM_PORT_BASE + SLURM_PORT_SPAN for p in ports)
    assert detect_launch(srun_task(0, step="1")).job == "slurm-41.1"


def test_step_nodelist_comes_before_the_jobs_and_master_variables_win():
    env = {**srun_task(0), "SLURM_JOB_NODELIST": "big[1-8]", "SLURM_STEP_NODELIST": "big[3-4]"}
    assert detect_launch(env).options["master_addr"] == "big3"
    del env["SLURM_STEP_NODELIST"]
    assert detect_launch(env).options["master_addr"] == "big1"
    info = detect_launch({**env, "MASTER_ADDR": "head", "MASTER_PORT": "29555"})
    assert (info.options["master_addr"], info.options["master_port"]) == ("head", "29555")


def test_a_batch_script_is_not_a_task():
    info = detect_launch(batch_script())
    assert (info.launcher, info.rank, info.size) == ("none", 0, 1)


def test_launchers_inside_an_allocation_come_first():
    """torchrun, collectives run and mpiexec started inside an srun step or a
    batch script: their ranks inherit SLURM_PROCID, and their own variables win."""
    task = srun_task(0)
    torch = detect_launch({**task, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2"})
    assert (torch.launcher, torch.rank, torch.local_rank, torch.node_rank) == ("torchrun", 5, 1, 2)
    ours = detect_launch({**task, "COLLECTIVES_RANK": "2", "COLLECTIVES_SIZE": "3"})
    assert (ours.launcher, ours.rank) == ("collectives", 2)
    mpi = detect_launch({**batch_script(), "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (mpi.launcher, mpi.rank) == ("mpiexec", 1)


def test_missing_or_invalid_nodelist_is_an_error_that_says_what_to_set():
    env = srun_task(0)
    for key in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"):
        del env[key]
    with pytest.raises(BadArgument, match="set MASTER_ADDR"):
        detect_launch(env)
    assert detect_launch({**env, "MASTER_ADDR": "h0"}).options["master_addr"] == "h0"
    with pytest.raises(BadArgument, match="invalid host list 'n\\[1-'"):
        detect_launch({**srun_task(0), "SLURM_STEP_NODELIST": "n[1-"})


# -- tasks that run collectives ------------------------------------------------------

TASK = """\
import numpy as np, collectives
comm = collectives.init(timeout=30)
x = np.full(1000, comm.rank + 1.0)
comm.allreduce(x)
y = np.arange(4.0) if comm.rank == 0 else np.zeros(4)
comm.bcast(y)
print("task", comm.rank, comm.size, comm.transport.name, x[0], y.tolist(), flush=True)
comm.close()
"""


def _clean_environment() -> dict[str, str]:
    return environment_without(("COLLECTIVES_", "TORCHELASTIC_", "PMI_", "OMPI_", "SLURM_"), LAUNCH_NAMES)


def _run_tasks(envs: list[dict[str, str]], script: str) -> list[subprocess.CompletedProcess]:
    """Run one process per environment; kill them all at the deadline."""
    procs = [subprocess.Popen([sys.executable, script], env={**_clean_environment(), **env}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for env in envs]
    end, results = time.monotonic() + DEADLINE, []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return results


@pytest.mark.parametrize("nodes,transport", [(1, "shm"), (2, "zmq")])
def test_tasks_with_sruns_environment_run_collectives(tmp_path, nodes, transport):
    """Two tasks of one step, on one node (shared memory) or as if on two
    (the first host of the list, localhost, serves the TCP rendezvous on
    MASTER_PORT)."""
    script = tmp_path / "task.py"
    script.write_text(TASK)
    port = str(free_port())
    envs = [{**srun_task(r, 2, nodelist="localhost" if nodes == 1 else "localhost,127.0.0.1", nodes=nodes,
                         job=f"{os.getpid()}{nodes}", localid=r if nodes == 1 else 0, nodeid=0 if nodes == 1 else r),
             "MASTER_PORT": port, "COLLECTIVES_SECRET": "s"} for r in range(2)]
    results = _run_tasks(envs, str(script))
    for r, res in enumerate(results):
        assert res.returncode == 0, "\n".join(x.stdout[-2000:] for x in results)
        assert f"task {r} 2 {transport} 3.0 [0.0, 1.0, 2.0, 3.0]" in res.stdout, res.stdout


# -- a real srun ----------------------------------------------------------------------

def _slurm_cluster() -> str | None:
    """Why no Slurm cluster can run a job here, or None."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "no Slurm here (srun, sinfo)"
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 10s"
    states = res.stdout.split()
    if res.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed") for s in states):
        return f"no idle Slurm node here (sinfo: {(res.stdout + res.stderr).strip()[:200]!r})"
    return None


def test_real_srun_runs_two_tasks(tmp_path):
    reason = _slurm_cluster()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "task.py"
    script.write_text(TASK)
    env = {**_clean_environment(), "COLLECTIVES_SECRET": "s"}
    res = subprocess.run(["srun", "-n", "2", "--time", "2", sys.executable, str(script)], env=env, text=True,
                         capture_output=True, timeout=DEADLINE, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(2):
        assert f"task {r} 2 shm 3.0 [0.0, 1.0, 2.0, 3.0]" in res.stdout, res.stdout + res.stderr
    zmq = subprocess.run(["srun", "-n", "2", "--time", "2", sys.executable, str(script)], text=True,
                         env={**env, "COLLECTIVES_TRANSPORT": "zmq"}, capture_output=True, timeout=DEADLINE,
                         cwd=tmp_path)
    assert zmq.returncode == 0 and "task 1 2 zmq 3.0" in zmq.stdout, zmq.stdout + zmq.stderr


HIER_TASK = """\
import numpy as np, collectives
comm = collectives.init(timeout=30)
x = np.full(1 << 16, comm.rank + 1.0)
comm.allreduce(x, algorithm="hierarchical")
print("task", comm.rank, type(comm).__name__, comm.topology.shape(), x[0], flush=True)
comm.close()
"""


def test_real_srun_runs_a_hierarchical_job(tmp_path):
    """Four tasks of one srun, as two "hosts" of two (a host id per pair of
    tasks), over TCP between the hosts and shared memory within each."""
    reason = _slurm_cluster()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "task.py"
    script.write_text(HIER_TASK)
    env = {**_clean_environment(), "COLLECTIVES_SECRET": "s", "COLLECTIVES_TRANSPORT": "zmq"}
    wrapped = f'COLLECTIVES_HOST_ID=h$((SLURM_PROCID / 2)) exec {sys.executable} {script}'
    res = subprocess.run(["srun", "--overcommit", "-n", "4", "--time", "2", "bash", "-c", wrapped], env=env,
                         text=True, capture_output=True, timeout=DEADLINE, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(4):
        assert f"task {r} HierarchicalCommunicator 2x2 10.0" in res.stdout, res.stdout + res.stderr
