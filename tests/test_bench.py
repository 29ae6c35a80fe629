"""The bench command end to end: a tiny sweep of every collective on shared
memory reports no wrong result, its JSON matches the documented schema, a
baseline comparison and the plots work, and absent peers are skipped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from collectives.bench.cli import parse_sizes
from collectives.bench.report import load_schema, validate

BENCH = [sys.executable, "-m", "collectives.bench"]


def _run(args, tmp_path, timeout=240):
    res = subprocess.run(BENCH + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return res


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    res = _run(["all", "-n", "2", "--sizes", "8:1K", "--factor", "4", "--iters", "3", "--warmup", "1",
                "--mode", "both", "--json", "r.json", "--plot", "r.png"], tmp)
    return res, tmp


def test_every_collective_runs_with_no_wrong_result(tiny_run):
    res, tmp = tiny_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp / "r.json").read_text())
    import collectives

    assert {r["collective"] for r in doc["results"]} == set(collectives.COLLECTIVES)
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert {r["mode"] for r in doc["results"] if r["collective"] == "allreduce"} == {"inplace", "outplace"}
    assert "# wrong results: 0" in res.stdout


def test_json_matches_the_schema(tiny_run):
    _, tmp = tiny_run
    doc = json.loads((tmp / "r.json").read_text())
    assert validate(doc) == []
    broken = dict(doc, results=[dict(doc["results"][0], wrong=-1)])
    assert validate(broken, load_schema())  # the validator does reject


def test_plots_are_written(tiny_run):
    pytest.importorskip("matplotlib")
    _, tmp = tiny_run
    assert (tmp / "r.png").stat().st_size > 0 and (tmp / "r.svg").stat().st_size > 0


def test_baseline_prints_the_change(tiny_run):
    _, tmp = tiny_run
    res = _run(["allreduce", "-n", "2", "--sizes", "8:1K", "--factor", "4", "--iters", "3", "--warmup", "1",
                "--baseline", "r.json"], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "change against the baseline" in res.stdout
    assert "%" in res.stdout.split("change against the baseline", 1)[1]


def test_unknown_peer_is_skipped_with_a_message(tmp_path):
    res = _run(["barrier", "-n", "1", "--compare", "nosuchlib", "--iters", "2"], tmp_path)
    assert res.returncode == 0
    assert "skipping nosuchlib" in res.stderr


def test_size_specs():
    assert parse_sizes("8:64") == [8, 16, 32, 64]
    assert parse_sizes("1K,1M") == [1024, 1 << 20]
    assert parse_sizes("1K:4K", 4) == [1024, 4096]
