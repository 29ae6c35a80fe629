"""Every collective and algorithm (ours over MPI point-to-point, and MPI's
native ones) under ``mpiexec -n 2..4`` with the mpich wheel, against numpy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from launched import environment_without

HERE = os.path.dirname(__file__)
MPIEXEC = shutil.which("mpiexec")

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (mpich wheel) is not installed")


def _run_checks(p: int, tmp_path, *checks: str) -> None:
    env = environment_without(("COLLECTIVES_", "PMI_"))
    res = subprocess.run([MPIEXEC, "-n", str(p), sys.executable, os.path.join(HERE, "mpi_rank_main.py"),
                          str(tmp_path), *checks], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in results) == list(range(p))
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_collective_over_mpi(p, tmp_path):
    _run_checks(p, tmp_path)


@pytest.mark.parametrize("p", [2, 4])
def test_messages_of_one_tag_meet_their_own_receives(p, tmp_path):
    """Large messages (a header and a payload message) between small ones,
    all with one tag and posted ahead, with and without a signature; each
    rank waits for its sends before its receives."""
    _run_checks(p, tmp_path, "message_order")


def _native_names():
    import collectives

    return {c: "native" in collectives.algorithms_for(c) for c in collectives.COLLECTIVES}


def test_native_registered_for_every_collective():
    assert all(_native_names().values())
