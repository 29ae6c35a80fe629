"""PyTorch's own distributed test suite on the ``collectives`` backend, beside Gloo.

``python -m collectives.bench.torch_suite [--ranks 2,3,8] [--backend both]
[-k PATTERN] [--jobs N] [--timeout S] [--json FILE] [--reference FILE]
[--start spawn|forkserver]``
runs the CPU tests of ``torch.testing._internal.distributed.distributed_test``
at each world size on both backends and prints, per world size and
backend, the tests passed, failed, skipped and errored, and every test that
passes on Gloo but not on ours. What the driver changes (Gloo's selection,
every group built as ours, our profiler events checked as Gloo's, certain
skips not started, hard timeouts) and the tests torch restricts to Gloo by
name (:data:`GLOO_ONLY`) are in docs/torch.md. This module drives; what runs
in the workers and the ranks is :mod:`.torch_suite_rank`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from .torch_suite_rank import (BACKEND_ENV, GLOO_ONLY, MODULE as RANK_MODULE, PROFILE_ENV, SPAWN_ALL_ENV,
                               START_ENV, START_METHODS, TIMEOUT_ENV, first_line, gloo_only, suite_tests)

__all__ = ["TestResult", "GLOO_ONLY", "SuiteOptions", "run_suite", "suite_tests", "gloo_only", "first_line", "main"]

BACKENDS = ("collectives", "gloo")
_GRACE = 30.0

@dataclass
class TestResult:
    """One test's outcome on one backend and world size."""

    test: str
    backend: str
    world_size: int
    status: str  # passed, failed, skipped, errored
    seconds: float
    message: str = ""


# ---------------------------------------------------------------- driver side


@dataclass
class SuiteOptions:
    """How one world size is run.

    Args:
        world_size: ranks per test.
        timeout: hard timeout of one test, seconds (default 120 + 15 per rank).
        jobs: tests run at once.
        logs: folder for the workers' logs (default: a new temporary folder).
        profile_checks: let the suite check our profiler events as it checks Gloo's.
        spawn_all: start the ranks of tests whose decorators skip them anyway.
        start: how the ranks start, ``"spawn"`` (torch's way) or
            ``"forkserver"`` (forked from a server that imported torch once;
            see :data:`~.torch_suite_rank.START_METHODS`).
    """

    world_size: int
    timeout: float | None = None
    jobs: int = 1
    logs: str | None = None
    profile_checks: bool = True
    spawn_all: bool = False
    start: str = "spawn"

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = 120.0 + 15.0 * self.world_size
        if self.logs is None:
            self.logs = tempfile.mkdtemp(prefix="torch-suite-logs-")
        os.makedirs(self.logs, exist_ok=True)


def suite_environment(backend: str, options: SuiteOptions, scratch: str) -> dict[str, str]:
    """The environment a worker runs the suite in."""
    env = dict(os.environ)
    init_file = os.path.join(scratch, f"init-{backend}-{options.world_size}-{os.getpid()}")
    env.update({"BACKEND": "gloo", "WORLD_SIZE": str(options.world_size), "TEMP_DIR": scratch,
                "INIT_METHOD": f"file://{init_file}", BACKEND_ENV: backend,
                PROFILE_ENV: "1" if options.profile_checks else "0",
                SPAWN_ALL_ENV: "1" if options.spawn_all else "0", START_ENV: options.start,
                TIMEOUT_ENV: str(options.timeout), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def list_tests(pattern: str | None = None) -> list[str]:
    """The suite's test names matching the regular expression ``pattern`` (and,
    as a side effect, :data:`GLOO_ONLY` filled from the installed torch)."""
    env = suite_environment("gloo", SuiteOptions(2, logs=tempfile.gettempdir()), tempfile.gettempdir())
    code = (f"import json; from {RANK_MODULE} import suite_tests, gloo_only; "
            f"print(json.dumps([suite_tests(), gloo_only()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120)
    names, restricted = json.loads(out.stdout.strip().splitlines()[-1])
    GLOO_ONLY.update(restricted)
    return [n for n in names if pattern is None or re.search(pattern, n)]


class _Worker:
    """One worker process, bound to a backend and world size, in a session of its own."""

    def __init__(self, env: dict[str, str], log_path: str) -> None:
        self.log = open(log_path, "a")
        code = f"from {RANK_MODULE} import worker; worker()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.ready:
                self.lines.append(line)
                self.ready.notify_all()
        with self.ready:
            self.lines.append("")  # end of output
            self.ready.notify_all()

    def run(self, name: str, deadline: float) -> dict | None:
        """The result of test ``name``; None when the worker died or ``deadline`` passed."""
        self.log.write(f"\n===== {name}\n")
        self.log.flush()
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        with self.ready:
            while not self.lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.ready.wait(left)
            line = self.lines.pop(0)
        return json.loads(line) if line else None

    def kill(self) -> None:
        """Kill the worker and every process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def close(self) -> None:
        """Let the worker finish (end of its input), killing it if it lingers."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class _Pool:
    """Workers taking (backend, test) tasks from one queue, one worker per
    backend and slot; every worker is killed when the pool stops."""

    def __init__(self, options: SuiteOptions, scratch: str, progress: Any) -> None:
        self.options = options
        self.scratch = scratch
        self.progress = progress
        self.lock = threading.Lock()
        self.tasks: list[tuple[str, str]] = []
        self.results: list[TestResult] = []
        self.workers: list[_Worker] = []
        self.stopping = False

    def _worker(self, backend: str, slot: int) -> _Worker:
        log = os.path.join(self.options.logs, f"{backend}-{self.options.world_size}-{slot}.log")
        worker = _Worker(suite_environment(backend, self.options, self.scratch), log)
        with self.lock:
            self.workers.append(worker)
        return worker

    def _one(self, worker: _Worker, backend: str, name: str) -> TestResult | None:
        """Run one test; None when its worker had to be killed (then it is)."""
        hard = self.options.timeout + _GRACE
        start = time.monotonic()
        got = worker.run(name, start + hard)
        if got is None:
            worker.kill()
            if self.stopping:
                return None
            got = {"status": "errored", "seconds": round(time.monotonic() - start, 2),
                   "message": f"timed out: killed after {hard:.0f}s (hard timeout)"}
        return TestResult(name, backend, self.options.world_size, got["status"], got["seconds"],
                          got.get("message", ""))

    def _slot(self, slot: int) -> None:
        workers: dict[str, _Worker] = {}
        try:
            while not self.stopping:
                with self.lock:
                    if not self.tasks:
                        return
                    backend, name = self.tasks.pop(0)
                worker = workers.get(backend)
                if worker is None or worker.proc.poll() is not None:
                    worker = workers[backend] = self._worker(backend, slot)
                result = self._one(worker, backend, name)
                if result is None:
                    return
                with self.lock:
                    self.results.append(result)
                self.progress(result)
        finally:
            for worker in workers.values():
                worker.close()

    def run(self, tasks: list[tuple[str, str]]) -> list[TestResult]:
        """Run every task; on an interrupt, kill every worker and re-raise."""
        self.tasks = list(tasks)
        threads = [threading.Thread(target=self._slot, args=(slot,), daemon=True)
                   for slot in range(max(1, self.options.jobs))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except BaseException:
            self.stopping = True
            with self.lock:
                workers = list(self.workers)
            for worker in workers:
                worker.kill()
            raise
        return self.results


def run_suite(tests: Sequence[str], options: SuiteOptions, backends: Sequence[str] = BACKENDS,
              progress: Any = None) -> tuple[list[TestResult], float]:
    """Run ``tests`` as ``options`` say on each backend; the results and the wall time.

    Args:
        tests: test names of the suite.
        options: world size, timeout, jobs, ...
        backends: ``"collectives"`` and/or ``"gloo"``.
        progress: called with each :class:`TestResult` as it comes.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as scratch:
        pool = _Pool(options, scratch, progress or (lambda result: None))
        results = pool.run([(b, t) for t in tests for b in backends])
    order = {name: i for i, name in enumerate(tests)}
    results.sort(key=lambda r: (order[r.test], r.backend))
    return results, time.monotonic() - start


def load_results(path: str) -> list[TestResult]:
    """Results written by ``--json``."""
    with open(path) as f:
        return [TestResult(**item) for item in json.load(f)]


# ---------------------------------------------------------------- reporting


STATUSES = ("passed", "failed", "skipped", "errored")


def counts(results: Iterable[TestResult], backend: str) -> dict[str, Any]:
    """Counts per status and total seconds of one backend's results."""
    mine = [r for r in results if r.backend == backend]
    c: dict[str, Any] = {s: sum(r.status == s for r in mine) for s in STATUSES}
    c["seconds"] = round(sum(r.seconds for r in mine), 1)
    return c


def differences(results: Iterable[TestResult], ours: str = "collectives",
                reference: str = "gloo") -> list[tuple[TestResult, TestResult]]:
    """(reference, ours) for every test that passes on ``reference`` and not on ``ours``."""
    by = {(r.test, r.backend): r for r in results}
    pairs = []
    for (test, backend), ref in sorted(by.items()):
        if backend == reference and ref.status == "passed":
            mine = by.get((test, ours))
            if mine is not None and mine.status != "passed":
                pairs.append((ref, mine))
    return pairs


def report(results: list[TestResult], world_size: int, wall: float | None) -> str:
    """The text printed for one world size (both backends' counts, then the differences)."""
    backends = [b for b in BACKENDS if any(r.backend == b for r in results)]
    took = f": {wall:.0f} s wall" if wall is not None else ""
    lines = [f"== world size {world_size}{took}",
             f"{'backend':<12} {'passed':>6} {'failed':>6} {'skipped':>7} {'errored':>7} {'seconds':>8}"]
    for b in backends:
        c = counts(results, b)
        lines.append(f"{b:<12} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {c['errored']:>7} "
                     f"{c['seconds']:>8.0f}")
    if set(BACKENDS) <= set(backends):
        diffs = differences(results)
        real = [m for _, m in diffs if m.test not in GLOO_ONLY]
        known = [m for _, m in diffs if m.test in GLOO_ONLY]
        lines.append(f"passes on gloo, not on collectives: {len(real)}")
        lines += [f"  {m.test}: {m.status}: {m.message}" for m in real]
        if known:
            lines.append(f"restricted to gloo by torch (not counted): {len(known)}")
            lines += [f"  {m.test}: {GLOO_ONLY[m.test]}" for m in known]
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.torch_suite",
                                 description="torch's distributed test suite on collectives and on Gloo")
    ap.add_argument("--ranks", default="2,3,8", help="world sizes, comma separated (default 2,3,8)")
    ap.add_argument("--backend", default="both", choices=["collectives", "gloo", "both"])
    ap.add_argument("-k", dest="pattern", default=None, help="run the tests whose name matches this regex")
    ap.add_argument("--jobs", type=int, default=1, help="tests run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=None, help="hard timeout per test, s (default 120 + 15/rank)")
    ap.add_argument("--json", dest="json_path", default=None, help="write every result to this file")
    ap.add_argument("--reference", default=None,
                    help="results of an earlier --json run; its gloo results stand in for tests not run on gloo now")
    ap.add_argument("--logs", default=None, help="folder for the workers' logs")
    ap.add_argument("--no-profile-checks", action="store_true",
                    help="do not check our profiler events (torch's lists unchanged)")
    ap.add_argument("--spawn-all", action="store_true",
                    help="start the ranks of tests whose decorators skip them anyway (no accelerators, world size)")
    ap.add_argument("--start", default="spawn", choices=START_METHODS,
                    help="how the ranks start: spawn (torch's way, default) or forkserver (torch imported once)")
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per test")
    return ap.parse_args(argv)


def _with_reference(results: list[TestResult], reference: list[TestResult], world_size: int) -> list[TestResult]:
    """``results`` plus the reference's gloo results of the same tests at ``world_size``
    that were not run on gloo now."""
    ran = {(r.test, r.backend) for r in results}
    tests = {r.test for r in results}
    extra = [r for r in reference if r.backend == "gloo" and r.world_size == world_size
             and r.test in tests and (r.test, "gloo") not in ran]
    return results + extra


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; 1 when a test passes on Gloo but not on ours."""
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # so that the workers are killed too
    tests = list_tests(args.pattern)
    if args.list:
        print("\n".join(tests))
        return 0
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    reference = load_results(args.reference) if args.reference else []
    logs = args.logs or tempfile.mkdtemp(prefix="torch-suite-logs-")
    print(f"{len(tests)} tests; logs in {logs}", flush=True)

    def show(r: TestResult) -> None:
        if args.json_path:  # after every test, so that an interrupted sweep keeps what it did
            done.append(r)
            with open(args.json_path, "w") as f:
                json.dump([asdict(x) for x in done], f, indent=1)
        if not args.quiet:
            note = f"  {r.message}" if r.status != "passed" and r.message else ""
            print(f"[{r.world_size}] {r.backend:<11} {r.status:<7} {r.seconds:6.1f}s {r.test}{note}", flush=True)

    done: list[TestResult] = []
    everything: list[TestResult] = []
    summaries = []
    status = 0
    for world_size in [int(x) for x in args.ranks.split(",") if x]:
        options = SuiteOptions(world_size, timeout=args.timeout, jobs=args.jobs, logs=logs,
                               profile_checks=not args.no_profile_checks, spawn_all=args.spawn_all,
                               start=args.start)
        results, wall = run_suite(tests, options, backends, progress=show)
        everything += results
        compared = _with_reference(results, reference, world_size)
        summaries.append(report(compared, world_size, wall))
        print(summaries[-1], flush=True)
        if any(m.test not in GLOO_ONLY for _, m in differences(compared)):
            status = 1
        if args.json_path:  # after each world size, so that a long sweep keeps what it did
            with open(args.json_path, "w") as f:
                json.dump([asdict(r) for r in everything], f, indent=1)
    if len(summaries) > 1:
        print("\n" + "\n\n".join(summaries))
    return status


if __name__ == "__main__":
    sys.exit(main())
