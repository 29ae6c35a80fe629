"""The rank side of :mod:`collectives.bench.torch_suite`: what runs in its
worker processes and in the ranks torch's suite spawns from them.

A worker runs test names read from stdin and writes one JSON result per
line; on our backend each rank binds the suite's ``dist`` to a copy of
``torch.distributed`` whose group creators make ``"collectives"`` groups
where the suite asks for Gloo (docs/torch.md says exactly what changes).
The ranks find the test class by name in this module.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import types
import unittest
from typing import Any

__all__ = ["GLOO_ONLY", "GLOO_ONLY_CODE", "START_METHODS", "first_line", "gloo_only", "suite_tests", "worker"]

SUITE = "torch.testing._internal.distributed.distributed_test"
BACKEND_ENV = "COLLECTIVES_SUITE_BACKEND"
PROFILE_ENV = "COLLECTIVES_SUITE_PROFILE_CHECKS"
SPAWN_ALL_ENV = "COLLECTIVES_SUITE_SPAWN_ALL"
TIMEOUT_ENV = "COLLECTIVES_SUITE_TIMEOUT"
START_ENV = "COLLECTIVES_SUITE_START"
#: How the ranks start: ``spawn`` (torch's way: each rank imports torch and
#: the suite anew, about 5 s on 2 cores) or ``forkserver`` (each rank is
#: forked from a server that imported torch once, with the test's own
#: environment; the suite module is imported in the rank, as under spawn).
START_METHODS = ("forkserver", "spawn")
#: What the fork server imports once: torch and its test helpers, not the
#: suite (which reads ``BACKEND`` and ``INIT_METHOD`` as it is imported).
_SERVER_PRELOAD = ["torch", "torch.distributed", "torch.testing._internal.common_distributed"]
MODULE = "collectives.bench.torch_suite_rank"

#: Tests that cannot pass on another backend than Gloo, and the code of torch
#: that decides it (found in the installed torch by :func:`gloo_only`): the
#: front end's ``dist.monitored_barrier`` refuses every backend not named
#: ``gloo``, and ``test_get_backend`` checks that the backend is named as
#: ``BACKEND`` says.
GLOO_ONLY_CODE = {
    "test_monitored_barrier_gloo": ("torch.distributed.distributed_c10d", "monitored_barrier",
                                    "get_backend(group) != Backend.GLOO"),
    "test_monitored_barrier_gloo_subgroup": ("torch.distributed.distributed_c10d", "monitored_barrier",
                                             "get_backend(group) != Backend.GLOO"),
    "test_monitored_barrier_failure_order": ("torch.distributed.distributed_c10d", "monitored_barrier",
                                             "get_backend(group) != Backend.GLOO"),
    "test_monitored_barrier_wait_all_ranks": ("torch.distributed.distributed_c10d", "monitored_barrier",
                                              "get_backend(group) != Backend.GLOO"),
    "test_get_backend": (SUITE, "DistributedTest._DistTestBase.test_get_backend",
                         "self.assertEqual(dist.get_backend(), backend_str)"),
}
GLOO_ONLY: dict[str, str] = {}


def _code_line(module: str, qualname: str, text: str) -> str:
    """``path:line: code`` of the first line of ``module.qualname``'s source that
    contains ``text`` (read from the installed torch)."""
    import importlib
    import inspect

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    obj = inspect.unwrap(obj)
    lines, first = inspect.getsourcelines(obj)
    path = inspect.getsourcefile(obj) or module
    short = path[path.rindex("torch/"):] if "torch/" in path else path
    for offset, line in enumerate(lines):
        if text in line:
            return f"{short}:{first + offset}: {line.strip()}"
    return f"{short}:{first}: (no line with {text!r})"


def gloo_only() -> dict[str, str]:
    """:data:`GLOO_ONLY_CODE` with the code of the installed torch (needs the
    suite's environment: ``BACKEND`` and ``WORLD_SIZE`` set)."""
    if not GLOO_ONLY:
        for test, where in GLOO_ONLY_CODE.items():
            GLOO_ONLY[test] = _code_line(*where)
    return GLOO_ONLY


# ------------------------------------------------------------------- the ranks


class _SuiteDist(types.ModuleType):
    """``torch.distributed`` as the suite sees it on our backend: groups it asks
    of Gloo are created on ``backend``; everything else is the real module."""

    _CREATORS = ("init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration")

    def __init__(self, real: types.ModuleType, backend: str) -> None:
        super().__init__(real.__name__)
        self._real = real
        self._backend = backend
        for name in self._CREATORS:
            setattr(self, name, self._substituting(getattr(real, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _substituting(self, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("backend", "")).lower() == "gloo":
                kwargs["backend"] = self._backend
            elif fn.__name__ == "init_process_group" and args and str(args[0]).lower() == "gloo":
                args = (self._backend,) + tuple(args[1:])
            return fn(*args, **kwargs)

        call.__name__ = fn.__name__
        call.__wrapped__ = fn
        return call


def _prepare_rank() -> None:
    """In a rank's process: bind the suite to our backend when asked to."""
    backend = os.environ.get(BACKEND_ENV, "gloo")
    if backend == "gloo":
        return
    import torch.distributed as dist

    import collectives.integrations.torch  # noqa: F401  (registers the backend)
    from torch.testing._internal.distributed import distributed_test as suite

    suite.dist = _SuiteDist(dist, backend)
    if os.environ.get(PROFILE_ENV, "1") == "1":
        for listed in (suite.PROFILING_SUPPORTED_BACKENDS, suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
            if backend not in listed:
                listed.append(backend)


def _suite_class() -> type:
    """The suite's test class, as torch's ``test_distributed_spawn.py`` builds it."""
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TorchSuiteTest(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(START_ENV, "spawn") == "forkserver":
                self._start_processes(_forkserver().Process)
            else:
                self._spawn_processes()

        def _start_processes(self, proc: Any) -> None:
            """torch's, with the rank's entry :func:`_rank_main` and this
            test's environment (a fork server's children have the server's)."""
            import torch.multiprocessing as mp

            self.processes = []
            environ = dict(os.environ)
            for rank in range(int(self.world_size)):
                parent_conn, child_conn = mp.Pipe()
                process = proc(target=_rank_main, name=f"process {rank}",
                               args=(environ, rank, self._current_test_name(), self.file_name, child_conn),
                               kwargs={"fake_pg": getattr(self, "fake_pg", False)})
                process.start()
                self.pid_to_pipe[process.pid] = parent_conn
                self.processes.append(process)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            _prepare_rank()
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    TorchSuiteTest.__module__ = MODULE
    TorchSuiteTest.__qualname__ = "TorchSuiteTest"
    return TorchSuiteTest


def _forkserver() -> Any:
    """The fork server's context (torch's default start method set to spawn, as torch's driver does)."""
    import torch.multiprocessing as mp

    try:
        mp.set_start_method("spawn")
    except RuntimeError:
        pass
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_SERVER_PRELOAD)
    return ctx


def _rank_main(environ: dict[str, str], rank: int, test_name: str, file_name: str, pipe: Any,
               **kwargs: Any) -> None:
    """A rank's process: the test's environment first, then torch's ``_run``."""
    os.environ.clear()
    os.environ.update(environ)
    _test_class()._run(rank, test_name, file_name, pipe, **kwargs)


def _test_class() -> type:
    """The suite's test class, made once per process."""
    cls = globals().get("TorchSuiteTest")
    if cls is None:
        cls = globals()["TorchSuiteTest"] = _suite_class()
    return cls


def __getattr__(name: str) -> Any:
    # The spawned ranks find the test class by name in this module.
    if name == "TorchSuiteTest":
        return _test_class()
    raise AttributeError(name)


def suite_tests() -> list[str]:
    """Every test name of the suite (needs the suite's environment set)."""
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    return sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test"))


# ----------------------------------------------------------------- the worker


_FRAME = re.compile(r"^\s+File \"")
_PROCESS = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")


def _exception_line(traceback_text: str) -> str:
    """The first line of the exception a traceback ends with, and the line that
    says what was expected when it has one (torch's ``Expected 1 but got 0.``,
    ``Expected exit code 0 but got 10``)."""
    lines = traceback_text.strip("\n").splitlines()
    last_frame = max((i for i, line in enumerate(lines) if _FRAME.match(line)), default=-1)
    block = lines[last_frame + 1:]
    start = next((i for i, line in enumerate(block) if line and not line.startswith(" ")), None)
    if start is None:
        return lines[-1].strip() if lines else ""
    first = block[start].strip()
    expected = [line.strip() for line in block[start + 1:] if line.strip().startswith("Expected")]
    return " | ".join([first] + expected[-1:])


def first_line(message: str) -> str:
    """The first line worth showing of a failed test's error: the exception of
    the first rank that raised one, prefixed with its rank."""
    parts = _PROCESS.split(message)
    if len(parts) >= 3:
        return f"rank {parts[1]}: {_exception_line(parts[2])}"[:300]
    return _exception_line(message)[:300]


def _classify(outcome: unittest.TestResult) -> tuple[str, str]:
    if outcome.skipped:
        return "skipped", outcome.skipped[0][1].splitlines()[0] if outcome.skipped[0][1] else ""
    problems = outcome.failures + outcome.errors
    if not problems:
        return "passed", ""
    text = problems[0][1]
    line = first_line(text)
    if "terminated or timed out" in text or "Timing out after" in text:
        return "errored", f"timed out: {line}"
    if outcome.failures or "AssertionError" in line:
        return "failed", line
    return "errored", line


def _certain_skip(fn: Any) -> str | None:
    """The skip message of a test whose decorators make every rank exit with a
    skip code here whatever the backend does: ``skip_if_no_gpu`` and
    ``skip_if_lt_x_gpu`` on a machine without accelerators,
    ``skip_if_small_worldsize`` below 8 ranks, ``skip_if_odd_worldsize`` at an
    odd number of ranks (as torch decides them: by ``BACKEND`` and
    ``WORLD_SIZE``); None for any other test."""
    import torch
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TEST_HPU, TEST_XPU

    accelerators = torch.cuda.is_available() or TEST_HPU or TEST_XPU
    not_mpi = os.environ["BACKEND"] != "mpi"
    world_size = int(os.environ["WORLD_SIZE"])
    while fn is not None:
        code = getattr(fn, "__code__", None)
        where = getattr(code, "co_qualname", "")
        if where == "skip_if_no_gpu.<locals>.wrapper" and not accelerators:
            return TEST_SKIPS["no_cuda"].message
        if where == "skip_if_lt_x_gpu.<locals>.decorator.<locals>.wrapper" and not accelerators:
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            if not cells.get("allow_cpu", False):
                return TEST_SKIPS[f"multi-gpu-{cells['x']}"].message
        if where == "skip_if_small_worldsize.<locals>.wrapper" and not_mpi and world_size < 8:
            return TEST_SKIPS["small_worldsize"].message
        if where == "skip_if_odd_worldsize.<locals>.wrapper" and not_mpi and world_size % 2 == 1:
            return TEST_SKIPS["odd_worldsize"].message
        fn = getattr(fn, "__wrapped__", None)
    return None


def _run_one(cls: type, name: str) -> tuple[str, str]:
    fn = getattr(cls, name, None)
    if os.environ.get(SPAWN_ALL_ENV) != "1" and not getattr(fn, "__unittest_skip__", False):
        reason = _certain_skip(fn)
        if reason is not None:
            return "skipped", reason
    outcome = unittest.TestResult()
    try:
        cls(name).run(outcome)
    except BaseException as exc:  # the harness itself broke
        return "errored", f"{type(exc).__name__}: {exc}"
    return _classify(outcome)


def worker() -> None:
    """Run test names read from stdin, one JSON result per line on the original stdout.

    The backend and world size come from the environment (set by :func:`run_suite`)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the tests' and ranks' own output goes to the log
    sys.stdout = os.fdopen(1, "w", buffering=1)
    from torch.testing._internal import common_distributed

    timeout = float(os.environ[TIMEOUT_ENV])
    common_distributed.get_timeout = lambda test_id: timeout
    cls = _test_class()
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        start = time.monotonic()
        status, message = _run_one(cls, name)
        results.write(json.dumps({"test": name, "status": status, "message": message,
                                  "seconds": round(time.monotonic() - start, 2)}) + "\n")
