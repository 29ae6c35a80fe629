"""The torch backend's threads and the interpreter's exit: a thread that
completes a Work and then frees tensors must be done before the interpreter
shuts down, or the process aborts inside torch's native code ("terminate
called without an active exception"). Real processes, real exits."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launched import clean_env

pytest.importorskip("torch")

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


@pytest.mark.parametrize("how", ["destroy", "exit"], ids=["destroy_process_group", "plain exit"])
def test_a_work_thread_still_freeing_tensors_does_not_abort_the_exit(tmp_path, how):
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
