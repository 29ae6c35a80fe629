"""Test-suite wide settings and checks.

The suite runs apart from the user's cache: calibration profiles (which
``auto`` would follow) and flight-record dumps go to folders of this run
(``COLLECTIVES_PROFILE``, ``COLLECTIVES_DEBUG_DIR``), which every rank
inherits. And the library leaves nothing in /dev/shm:

Only this library's segments count (``coll-<job>-<rank>``, see
``collectives.transports.shm.layout``), only those that appeared during this
run, and only those whose creator has exited: another job running beside
this suite (another suite, a benchmark) keeps its live segments to itself.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

_RUN_DIR = tempfile.TemporaryDirectory(prefix="collectives-tests-")
os.environ["COLLECTIVES_PROFILE"] = os.path.join(_RUN_DIR.name, "profiles")  # none: auto follows the rule
os.environ["COLLECTIVES_DEBUG_DIR"] = os.path.join(_RUN_DIR.name, "flight")

SHM = "/dev/shm"
PREFIX = "coll-"
_PID_WORD = 1  # the creator's process id: word 1 of a segment's control page


def _ours() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


def _creator_alive(name: str) -> bool:
    try:
        with open(os.path.join(SHM, name), "rb") as f:
            f.seek(8 * _PID_WORD)
            (pid,) = struct.unpack("<q", f.read(8))
    except (OSError, struct.error):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pytest_sessionstart(session):
    session.config._shm_before = _ours()


def pytest_sessionfinish(session, exitstatus):
    left = sorted(n for n in _ours() - session.config._shm_before if not _creator_alive(n))
    if left:
        sys.stderr.write(f"\nERROR: the test suite left segments in {SHM}: {left[:10]}\n")
        session.exitstatus = 1
