"""Test-suite wide checks: nothing is left in /dev/shm by the library."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

SHM = "/dev/shm"


def _shm_entries() -> set[str]:
    try:
        # MPICH's own segments (mpich_shm_*) are left by any aborted mpiexec
        # job, ours or not; the check is about this library's segments.
        return {n for n in os.listdir(SHM) if not n.startswith(("sem.", "mpich_shm_"))}
    except FileNotFoundError:
        return set()


def pytest_sessionstart(session):
    session.config._shm_before = _shm_entries()


def pytest_sessionfinish(session, exitstatus):
    left = sorted(_shm_entries() - session.config._shm_before)
    if left:
        sys.stderr.write(f"\nERROR: the test suite left files in {SHM}: {left[:10]}\n")
        session.exitstatus = 1
