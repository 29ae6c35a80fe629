"""Test scripts that run as ranks under a launcher (``collectives run``,
torchrun, mpiexec) and print one ``RESULT <json>`` line each: the
environment they start from, a torch rank's main, and reading their
results back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any, Callable

__all__ = ["clean_env", "environment_without", "results", "run_torch_checks", "SUITE_SETTINGS", "suite_settings",
           "LAUNCH_NAMES", "collectives_run", "run_checked"]

#: Variables of the test process's own launch that must not reach the ranks.
_DROP = ("COLLECTIVES_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
         "PMI_", "OMPI_")


#: The suite's own settings (tests/conftest.py: calibration profiles and flight records in
#: folders of this run, apart from the user's), which every rank the suite starts keeps,
#: whatever else of the test process's environment it drops.
SUITE_SETTINGS = ("COLLECTIVES_PROFILE", "COLLECTIVES_DEBUG_DIR")


def suite_settings() -> dict[str, str]:
    """The :data:`SUITE_SETTINGS` this process has."""
    return {k: os.environ[k] for k in SUITE_SETTINGS if k in os.environ}


#: The variables a launcher sets for each rank (torchrun's, the launcher's own).
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment_without(prefixes: tuple[str, ...], names: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without the variables that start with one of
    ``prefixes`` or are named in ``names``, the suite's own settings
    (:data:`SUITE_SETTINGS`) kept: every rank a test starts by hand gets its
    environment here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env.update(suite_settings())
    return env


def clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variables (the suite's own settings
    kept), one thread per rank."""
    return environment_without(_DROP) | {"OMP_NUM_THREADS": "1"}


def results(stdout: str) -> list[dict]:
    """Every rank's RESULT object (lines of different ranks may interleave)."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("RESULT ")
    while at >= 0:
        obj, _ = decoder.raw_decode(stdout, at + len("RESULT "))
        found.append(obj)
        at = stdout.find("RESULT ", at + 1)
    return found


def collectives_run(p: int, script: str, *args: str, deadline: float) -> list[str]:
    """The command that runs ``script args`` as ``p`` ranks under our
    launcher, which stops them 10 s before ``deadline``."""
    return [sys.executable, "-m", "collectives.cli", "run", "-n", str(p), "--timeout", str(deadline - 10),
            script, *args]


def run_checked(argv: list[str], p: int, deadline: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run a job whose ranks each print one RESULT with its ``failures``;
    assert it ended well, every rank of ``p`` reported and none failed.
    Returns the RESULT objects."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=deadline,
                         env=clean_env() if env is None else env)
    out = res.stdout + res.stderr
    found = results(res.stdout)
    assert res.returncode == 0, out[-4000:]
    assert sorted(r["rank"] for r in found) == list(range(p)), out[-4000:]
    failures = [f"rank {r['rank']}: {f}" for r in found for f in r["failures"]]
    assert not failures, "\n".join(failures)
    return found


def run_torch_checks(checks: dict[str, Callable[[Any, Any], list[str]]], names: list[str],
                     setup: Callable[[], tuple[Any, Any]]) -> None:
    """A torch rank's main: ``setup()`` gives (torch, dist); run the named
    checks (each returns its failures; one that raises fails with its
    traceback), print this rank's RESULT, end the process group and leave
    without torch's C++ static destructors (torch 2.13 sometimes aborts in
    them at exit, under torchrun too, after all work is done)."""
    torch, dist = setup()
    failures: list[str] = []
    for name in names:
        try:
            failures += checks[name](torch, dist)
        except Exception:
            failures.append(f"{name} raised:\n{traceback.format_exc()}")
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "failures": failures}), flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)
