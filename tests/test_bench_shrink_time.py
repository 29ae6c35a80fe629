"""The shrink-time bench end to end: one job of 4 ranks on shared memory
under ``collectives run --on-failure continue``, one rank killed, every
survivor's phases measured and summed up in the table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_one_repeat_at_4_ranks_on_shared_memory(tmp_path):
    out = tmp_path / "shrink.json"
    timeout = 10.0
    res = subprocess.run([sys.executable, "-m", "collectives.bench.shrink_time", "--ranks", "4", "--transports", "shm",
                          "--repeat", "1", "--timeout", str(timeout), "--out", str(out)],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "detect med" in lines[1] and "first call med" in lines[1], res.stdout
    assert lines[2].split()[:4] == ["shm", "4", "1", "0"], res.stdout
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert (result["transport"], result["p"], data["victim"]) == ("shm", 4, 1)
    (job,) = result["jobs"]
    assert sorted(r["rank"] for r in job["ranks"]) == [0, 2, 3], job
    for r in job["ranks"]:
        assert all(r[phase] >= 0 for phase in ("detect_s", "shrink_s", "first_s")), r
        assert abs(r["detect_s"] + r["shrink_s"] + r["first_s"] - r["total_s"]) < 1e-6, r
        assert r["total_s"] < timeout + 2, r  # no phase waited out the timeout
    summary = result["summary"]
    assert summary["failed"] == 0 and summary["total_s"]["max"] == max(r["total_s"] for r in job["ranks"])
