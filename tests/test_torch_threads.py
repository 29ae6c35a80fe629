"""The threads that complete the torch backend's works
(``collectives.integrations.torch_threads``): each body runs once, in a
thread of the pool or in the waiter that claims it; bodies that wait for
each other each get a thread; and the interpreter's exit waits for a thread
that completed a Work and then frees tensors, or the process aborts inside
torch's native code ("terminate called without an active exception").
Real threads, real processes, real exits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from collectives.integrations import torch_threads
from launched import clean_env

DEADLINE = 120

SCRIPT = '''
import sys, time, torch, torch.distributed as dist
import collectives.integrations.torch  # noqa: F401  (the backend's name)
from collectives.integrations.torch_work import CollectivesWork

dist.init_process_group(backend="collectives")
rank, pg = dist.get_rank(), dist.distributed_c10d._get_default_group()


class SlowToFree:
    """Freed by the thread that completes the Work, after it completed it:
    half a second of torch's native code that lets go of the GIL."""

    def __del__(self):
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            torch.ones(1 << 16).sum()


work = CollectivesWork([], "exit-check", rank)
slow = SlowToFree()
pg._in_thread(work, lambda held=slow: None)  # the thread's body holds the last reference
del slow
work.wait(30)
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
print(f"EXITING {rank}", flush=True)
'''


def test_a_task_runs_once_whoever_claims_it():
    ran = []
    task = torch_threads.Task(lambda: ran.append(threading.current_thread().name))
    run = task.claim()
    assert task.claim() is None and run is not None
    torch_threads.submit(task)  # a thread of the pool finds it claimed
    run()
    assert torch_threads.settle(5) and ran == [threading.current_thread().name]


def test_tasks_that_wait_for_each_other_each_get_a_thread_and_settle_waits_for_them():
    n = 5
    met, release, finished = threading.Barrier(n + 1), threading.Event(), []

    def body(i: int) -> None:
        met.wait(10)  # every body must be running at once
        release.wait(10)
        finished.append(i)
    start = time.monotonic()
    for i in range(n):
        torch_threads.submit(torch_threads.Task(lambda i=i: body(i)))
    met.wait(10)
    assert not torch_threads.settle(0.05)  # five bodies still run
    release.set()
    assert torch_threads.settle(10)
    assert sorted(finished) == list(range(n)) and time.monotonic() - start < 10


@pytest.mark.parametrize("how", ["destroy", "exit"], ids=["destroy_process_group", "plain exit"])
def test_a_work_thread_still_freeing_tensors_does_not_abort_the_exit(tmp_path, how):
    pytest.importorskip("torch")
    script = tmp_path / "exit_check.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "collectives.cli", "run", "-n", "2", "--timeout", str(DEADLINE - 10),
            str(script), how]
    start = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE, env=clean_env())
    took = time.monotonic() - start
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "Aborted" not in out, out[-3000:]
    assert out.count("EXITING") == 2, out[-3000:]
    assert took < 60, f"the exit took {took:.1f}s"
