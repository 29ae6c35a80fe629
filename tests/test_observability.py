"""The flight recorder, its analysis, timelines and the debug log, on real ranks."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from collectives import CollectiveError
from collectives.trace_analysis import analyze, load
from collectives.tracing import merge
from harness import run_ranks


def a_few_calls(comm):
    x = np.ones(10, np.float32)
    comm.allreduce(x)
    comm.bcast(x, 1)
    h = comm.iallreduce(x, op="max")
    h.wait()
    comm.barrier()
    return comm.flight_record()


def repeated_calls(comm):
    x = np.ones(4, np.float32)
    for _ in range(6):  # after the first, prepared calls: a compiled call records itself
        comm.allreduce(x)
    comm.allreduce(x, timeout=7.5)
    return comm.flight_record()


def test_the_flight_record_holds_repeated_calls_too():
    for records in run_ranks(repeated_calls, 2, timeout=60):
        assert [c["seq"] for c in records] == list(range(1, 8)), records
        assert all(c["collective"] == "allreduce" and c["count"] == 4 and c["state"] == "completed"
                   and c["end"] >= c["start"] > 0 for c in records), records
        assert [c["timeout"] for c in records] == [20.0] * 6 + [7.5]


def test_the_flight_record_holds_every_call():
    for r, records in enumerate(run_ranks(a_few_calls, 2, timeout=60)):
        calls = [rec for rec in records if "collective" in rec]
        assert [c["seq"] for c in calls] == [1, 2, 3, 4], records
        assert [c["collective"] for c in calls] == ["allreduce", "bcast", "allreduce", "barrier"]
        first = calls[0]
        assert first["dtype"] == "float32" and first["count"] == 10 and first["bytes"] == 40
        assert first["op"] == "sum" and first["algorithm"] == "shared_window" and first["transport"] == "shm"
        assert calls[1]["root"] == 1 and calls[2]["op"] == "max"
        assert all(c["peers"] == "all" for c in calls), calls
        assert all(c["state"] == "completed" and c["end"] >= c["start"] for c in calls), calls


def _fault(comm, kind: str, where: str):
    """Ten allreduces; one rank misbehaves at call 4. Returns where this rank's dump is."""
    os.environ["COLLECTIVES_DEBUG_DIR"] = where  # read when a dump is written
    x = np.ones(16, np.float32)
    try:
        for i in range(1, 11):
            if i == 4 and comm.rank == 2:
                if kind == "sleep":
                    time.sleep(2.0)  # past the others' 1 s timeout
                elif kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "skip":
                    continue  # the bcast everyone else makes
                elif kind == "dtype":
                    comm.bcast(np.ones(16, np.float64), 0)
                    continue
            if i == 4:
                comm.bcast(x, 0)
            else:
                comm.allreduce(x)
    except CollectiveError as exc:
        return type(exc).__name__, comm._recorder.dumped
    return "ok", None


@pytest.mark.parametrize("kind,culprit_kind", [("sleep", "late"), ("kill", "dead"), ("skip", "mismatch"),
                                               ("dtype", "mismatch")])
def test_every_surviving_rank_dumps_and_the_analysis_names_the_culprit(tmp_path, kind, culprit_kind):
    outcomes = run_ranks(_fault, 3, kind, str(tmp_path), timeout=60, comm_timeout=1.0, expect_errors=True)
    for o in outcomes:
        if kind == "kill" and o.rank == 2:
            continue
        assert o.ok and o.value[0] != "ok" and o.value[1] and os.path.exists(o.value[1]), str(o)
    verdict = analyze(load(str(tmp_path)))
    assert verdict["culprit"] == 2 and verdict["seq"] == 4, verdict
    assert verdict["kind"] == culprit_kind, verdict
    text = "\n".join(verdict["lines"])
    if kind == "dtype":
        assert "dtype" in text and "float64" in text, text
    if kind == "skip":  # rank 2's call #4 is an allreduce, and nothing after it tells which
        assert "rank 2 skipped bcast #4" in text and "or called allreduce #4" in text, text
    if kind == "kill":
        assert "ranks [2] left no flight record: dead" in text, text


def _traced(comm, where: str):
    x = np.ones(1000, np.float32)
    for _ in range(10):
        if comm.rank == 1:
            time.sleep(0.02)  # always the last to arrive
        comm.allreduce(x)
    comm.bcast(x, 0, algorithm="binomial")
    return comm.rank


def test_timelines_merge_on_one_clock_and_name_the_late_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TRACE", str(tmp_path))
    run_ranks(_traced, 3, str(tmp_path), timeout=60)
    for r in range(3):
        with open(tmp_path / f"rank{r}.json") as f:
            doc = json.load(f)
        calls = [e for e in doc["traceEvents"] if e.get("cat") == "collective"]
        assert [e["args"]["seq"] for e in calls] == list(range(1, 12)), calls
        assert calls[-1]["name"] == "bcast" and calls[-1]["args"]["algorithm"] == "binomial"
        phases = [e for e in doc["traceEvents"] if e.get("cat") == "phase"]
        if r != 0:  # the binomial bcast's receivers wait for a message
            assert phases and all(e["args"]["seq"] == 11 for e in phases), phases
    summary = merge(str(tmp_path), str(tmp_path / "timeline.json"))
    assert summary["ranks"] == 3 and summary["last_most_often"] == 1, summary
    skews = [s for s in summary["skews"] if s["collective"] == "allreduce"]
    assert len(skews) == 10 and all(s["last"] == 1 and s["skew_us"] > 10_000 for s in skews), skews
    with open(tmp_path / "timeline.json") as f:
        merged = json.load(f)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 2}


def _logged(comm, where: str):
    x = np.ones(8, np.float32)
    comm.allreduce(x)
    comm.allreduce(x)
    return comm.rank


def test_the_debug_log_prefixes_lines_and_says_how_each_rank_started(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DEBUG", "INFO")
    monkeypatch.setenv("COLLECTIVES_DEBUG_SUBSYS", "init,select")
    monkeypatch.setenv("COLLECTIVES_DEBUG_FILE", str(tmp_path / "%h-%p-r%r.log"))
    run_ranks(_logged, 2, str(tmp_path), timeout=60)
    logs = sorted(os.listdir(tmp_path))
    assert len(logs) == 2 and logs[0].endswith("-r0.log") and logs[1].endswith("-r1.log"), logs
    for name in logs:
        text = (tmp_path / name).read_text()
        rank = name.rsplit("-r", 1)[1].split(".")[0]
        assert f":{rank} collectives.init INFO init: rank {rank} of 2, transport shm" in text, text
        assert "auto chose shared_window for allreduce of 32 B" in text, text
        assert text.count("auto chose") == 1, text  # once per collective and size


def _signalled(comm, where: str):
    os.environ["COLLECTIVES_DEBUG_DIR"] = where
    x = np.ones(4)
    comm.allreduce(x)
    comm.barrier()
    if comm.rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    comm.barrier()
    return os.path.exists(os.path.join(where, os.environ["COLLECTIVES_JOB"], "rank0.json"))


def test_sigusr1_dumps_the_flight_record(tmp_path):
    assert run_ranks(_signalled, 2, str(tmp_path), timeout=60)[0] is True


# ---------------------------------------------------------------- peers, queued calls


def test_records_name_the_peers_and_queued_calls_keep_their_fields():
    from collectives import signature
    from collectives.flight_recorder import FlightRecorder

    last = [0]
    rec = FlightRecorder(8, 0, 2, "shm", "job", lambda: last[0], timeout=60.0)
    ar = signature.make("allreduce", "ring", "sum", None, np.dtype(np.float32), 4)
    last[0] = 1
    rec.begin(1, ar, 1.0, 60.0)
    rec.finish(1, 2.0)
    last[0] = 2
    rec.schedule(2, signature.make("bcast", "binomial", None, 1, np.dtype(np.float64), 3), 5.0)
    records = rec.records()
    assert [r["peers"] for r in records] == ["all", "all"]  # a flat communicator over every rank
    queued = records[1]
    assert queued["state"] == "scheduled" and queued["start"] is None and queued["end"] is None
    assert (queued["collective"], queued["algorithm"], queued["root"], queued["dtype"], queued["count"],
            queued["bytes"], queued["timeout"]) == ("bcast", "binomial", 1, "float64", 3, 24, 5.0), queued
    rec.begin(2, signature.make("bcast", "binomial", None, 1, np.dtype(np.float64), 3), 3.0, 5.0)
    assert rec.records()[1]["state"] == "started"  # no longer queued
    rec.peers = [4, 6]  # a group: its ranks in the job's numbering
    rec.talks_to(1, [6])
    assert [r["peers"] for r in rec.records()] == [[6], [4, 6]]
    assert rec.snapshot()["peers"] == [4, 6]


def test_the_flight_record_says_every_rank_is_a_peer_on_real_ranks():
    for records in run_ranks(repeated_calls, 2, timeout=60):  # compiled calls' records too
        assert {r["peers"] for r in records} == {"all"}, records


# ---------------------------------------------------------------- analysis of synthetic dumps


def _rec(seq, collective="allreduce", state="completed", error=None, dtype="float32", **kw):
    base = {"seq": seq, "collective": collective, "algorithm": "shared_window",
            "op": "sum" if collective == "allreduce" else None, "root": 0 if collective == "bcast" else None,
            "dtype": dtype, "count": 16, "counts_digest": None, "state": state, "start": float(seq),
            "end": float(seq) + 0.5 if state == "completed" else None, "timeout": 1.0, "error": error,
            "peers": "all"}
    return {**base, **kw}


def _dump(rank, records, size=3, reason=""):
    return {"rank": rank, "size": size, "host": "h", "pid": 100 + rank, "job": "j", "transport": "shm",
            "reason": reason, "monotonic": 100.0, "time": 1000.0, "records": records}


def test_analysis_names_a_rank_that_skipped_a_call():
    calls = ["allreduce", "allreduce", "bcast", "allreduce", "allreduce"]
    good = [_rec(i + 1, c) for i, c in enumerate(calls)]
    skipper = [_rec(i + 1, c) for i, c in enumerate(calls[:2] + calls[3:])]  # no bcast #3
    verdict = analyze([_dump(0, good), _dump(1, skipper), _dump(2, good)])
    assert (verdict["kind"], verdict["culprit"], verdict["seq"]) == ("skipped", 1, 3), verdict
    assert any("rank 1 skipped bcast #3" in line for line in verdict["lines"]), verdict["lines"]


def test_analysis_names_a_rank_that_added_a_call():
    good = [_rec(1), _rec(2), _rec(3)]
    adder = [_rec(1), _rec(2, "barrier", dtype=None), _rec(3, "allreduce"), _rec(4)]
    verdict = analyze([_dump(0, good), _dump(1, good), _dump(2, adder)])
    assert (verdict["kind"], verdict["culprit"], verdict["seq"]) == ("added", 2, 2), verdict
    assert any("rank 2 added a call: barrier #2" in line for line in verdict["lines"]), verdict["lines"]


def test_a_different_collective_in_the_last_call_says_skipped_or_instead():
    error = "MismatchedCollective: call #2: ranks disagree: collective"
    good = [_rec(1), _rec(2, "bcast", state="failed", error=error)]
    other = [_rec(1), _rec(2, "allreduce", state="failed", error=error)]
    verdict = analyze([_dump(0, good), _dump(1, good), _dump(2, other)])
    assert (verdict["kind"], verdict["culprit"], verdict["seq"]) == ("mismatch", 2, 2), verdict
    assert any(line.startswith("rank 2 skipped bcast #2") and "or called allreduce #2" in line
               and line.endswith("instead") for line in verdict["lines"]), verdict["lines"]
    same_collective = [_rec(1), _rec(2, "bcast", state="failed", error=error, dtype="float64")]
    verdict = analyze([_dump(0, good), _dump(1, good), _dump(2, same_collective)])
    assert verdict["kind"] == "mismatch" and not any("instead" in line for line in verdict["lines"])


@pytest.mark.parametrize("error,kind,words", [
    ("CollectiveTimeout: rank 0: shared window: waited for rank 2", "hung", "hung (no record: stopped or stuck"),
    ("PeerLost: rank 0: rank 2 (pid 7) died", "dead", "dead"),
])
def test_a_rank_without_a_record_is_hung_or_dead_by_the_survivors_errors(error, kind, words):
    survivors = [_dump(r, [_rec(1), _rec(2, "bcast", state="failed", error=error)], reason=error) for r in (0, 1)]
    verdict = analyze(survivors)
    assert (verdict["kind"], verdict["culprit"], verdict["seq"]) == (kind, 2, 2), verdict
    assert any(f"ranks [2] left no flight record: {words}" in line for line in verdict["lines"]), verdict["lines"]


def test_queued_calls_are_where_a_rank_is_not_calls_it_reached():
    error = "CollectiveTimeout: rank 0: waited for rank 1"
    ahead = [_rec(1), _rec(2, state="failed", error=error)]
    behind = [_rec(1), _rec(2, "bcast", state="scheduled", start=None)]
    verdict = analyze([_dump(0, ahead, size=2), _dump(1, behind, size=2)])
    assert (verdict["kind"], verdict["culprit"], verdict["seq"]) == ("late", 1, 2), verdict
    assert any("rank 1 did not reach it" in line and "queued: bcast #2" in line for line in verdict["lines"])


# ---------------------------------------------------------------- merging timelines


def _timeline(rank, host, shift_us, calls, size=4):
    """A rank's timeline whose clock reads ``shift_us`` more than the reference's;
    ``calls``: (seq, name, true start us, true end us)."""
    events = [{"name": name, "cat": "collective", "ph": "X", "ts": t0 + shift_us, "dur": t1 - t0, "pid": rank,
               "tid": 0, "args": {"seq": seq}} for seq, name, t0, t1 in calls]
    return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
            + events, "otherData": {"rank": rank, "size": size, "host": host, "pid": 1, "transport": "zmq",
                                    "monotonic": 50.0 + shift_us / 1e6, "time": 1e9 + rank * 3.0}}


def test_merge_aligns_two_hosts_with_shifted_clocks(tmp_path):
    shift = {"a": 0.0, "b": 7_250_000.0}  # host b's monotonic clock reads 7.25 s more
    late = {0: 0.0, 1: 300.0, 2: 0.0, 3: 900.0}  # rank 3 arrives 900 us after the first
    for rank, host in enumerate(["a", "a", "b", "b"]):
        calls = []
        for seq in range(1, 6):
            start = seq * 10_000.0 + late[rank]
            end = seq * 10_000.0 + 1_000.0 + (rank % 2) * 2.0  # synchronising: the ends nearly coincide
            calls.append((seq, "allreduce" if seq != 3 else "bcast", start, end))
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_timeline(rank, host, shift[host], calls)))
    summary = merge(str(tmp_path), str(tmp_path / "timeline.json"))
    offsets = summary["offsets_us"]
    assert offsets[:2] == [0.0, 0.0] and offsets[2] == offsets[3], offsets  # one clock per host
    assert abs(offsets[2] + shift["b"]) < 5, offsets
    assert summary["calls"] == 5 and summary["last_most_often"] == 3, summary
    assert all(s["last"] == 3 and s["first"] in (0, 2) and abs(s["skew_us"] - 900) < 5
               for s in summary["skews"]), summary["skews"]
    merged = json.loads((tmp_path / "timeline.json").read_text())
    starts = {(e["pid"], e["args"]["seq"]): e["ts"] for e in merged["traceEvents"] if e.get("cat") == "collective"}
    assert abs(starts[(2, 1)] - starts[(0, 1)]) < 5 and abs(starts[(3, 4)] - starts[(1, 4)] - 600) < 5


def test_merge_takes_a_directory_of_jobs_or_one_job(tmp_path):
    from collectives.trace_cli import main as trace_main
    from collectives.tracing import jobs, merge_jobs

    calls = [(1, "allreduce", 0.0, 100.0), (2, "barrier", 200.0, 300.0)]
    for job in ("round1", "round2"):
        (tmp_path / job).mkdir()
        for rank in range(2):
            (tmp_path / job / f"rank{rank}.json").write_text(json.dumps(_timeline(rank, "a", 0.0, calls, 2)))
    assert [name for name, _ in jobs(str(tmp_path))] == ["round1", "round2"]
    with pytest.raises(ValueError, match="several jobs"):
        merge(str(tmp_path), str(tmp_path / "t.json"))
    done = merge_jobs(str(tmp_path), str(tmp_path / "t.json"))
    assert [(job, os.path.basename(out)) for job, out, _ in done] == [("round1", "t-round1.json"),
                                                                      ("round2", "t-round2.json")]
    assert all(summary["ranks"] == 2 and summary["calls"] == 2 for _, _, summary in done)
    assert trace_main(["merge", str(tmp_path / "round2"), "-o", str(tmp_path / "one.json")]) == 0
    assert json.loads((tmp_path / "one.json").read_text())["otherData"]["ranks"] == 2
    assert trace_main(["merge", str(tmp_path), "-o", str(tmp_path / "all.json")]) == 0
    assert (tmp_path / "all-round1.json").exists() and (tmp_path / "all-round2.json").exists()
    assert trace_main(["merge", str(tmp_path / "round1" / "nothing")]) == 1


# ---------------------------------------------------------------- the copying phase


def _copies(comm, where: str):
    comm.allgather(np.ones(300_000, np.float32))  # more than one piece: no compiled call
    comm.bcast(np.ones(600_000, np.float32), 0)
    comm.allreduce(np.ones(600_000, np.float32))  # more than a half: in pieces, not one call of two steps
    comm.allreduce(np.ones(4, np.float32))  # a compiled call: one step, no phases of its own
    return comm.rank


def test_timelines_show_the_shared_window_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TRACE", str(tmp_path))
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(1 << 30))  # the pieces' copies, not direct reads
    monkeypatch.setenv("COLLECTIVES_WINDOW_COMPILED_DIRECT_BYTES", str(1 << 50))  # nor a direct compiled call
    run_ranks(_copies, 3, str(tmp_path), timeout=90)
    for r in range(3):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        calls = {e["args"]["seq"]: e for e in doc["traceEvents"] if e.get("cat") == "collective"}
        assert [calls[s]["name"] for s in sorted(calls)] == ["allgather", "bcast", "allreduce", "allreduce"]
        phases = [e for e in doc["traceEvents"] if e.get("cat") == "phase"]
        copying = {e["args"]["seq"] for e in phases if e["name"] == "copying"}
        assert copying == {1, 2, 3}, phases
        for e in phases:  # inside its call
            call = calls[e["args"]["seq"]]
            assert call["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= call["ts"] + call["dur"] + 1, (e, call)
