"""Cost models: coverage of the algorithms, calibration fits, profiles, selection, explain."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from collectives.cost_models import MODELS, Params, _load, predict
from collectives.cost_models.digests import anchor_digests
from collectives.cost_models.calibration_fits import fit_line, fit_overheads, fit_piecewise
from collectives.cost_models.calibration_measurements import PROBE_BYTES, PROBES
from collectives.cost_models.explain import main as explain_main, parse_bytes
from collectives.cost_models.profile import DEFAULTS, UNSTEADY_SPREAD, load_profile, profile_path, unsteady
from collectives.cost_models.selector import TIE, WINDOW_TIE, ModelSelector
from collectives.registry import all_algorithms, algorithms_for
from collectives.selection import rule


def test_every_algorithm_has_a_model_and_every_model_an_algorithm() -> None:
    _load()
    algos = {(a.collective, a.name) for a in all_algorithms()}
    assert algos - set(MODELS) == set(), "algorithms without a cost model"
    assert set(MODELS) - algos == set(), "cost models without an algorithm"


@pytest.mark.parametrize("key", sorted({(a.collective, a.name) for a in all_algorithms()}))
def test_predictions_are_finite_and_grow_with_size(key) -> None:
    collective, name = key
    P = Params()
    for p in (1, 2, 3, 8, 1000):
        small = predict(collective, name, p, 8 * p, P)
        large = predict(collective, name, p, 1000 * 8 * p, P)
        assert math.isfinite(small) and small >= 0
        assert large >= small


def test_textbook_forms_for_powers_of_two() -> None:
    P = Params(alpha=1e-6, beta=1e-9, gamma=0.0, mem_bandwidth=math.inf)
    n, p = 1 << 16, 16
    assert predict("allgather", "ring", p, n, P) == pytest.approx((p - 1) * (1e-6 + n / p * 1e-9))
    assert predict("allgather", "recursive_doubling", p, n, P) == pytest.approx(4e-6 + (p - 1) / p * n * 1e-9)
    assert predict("bcast", "binomial", p, n, P) == pytest.approx(4 * (1e-6 + n * 1e-9))
    assert predict("barrier", "dissemination", 1000, 0, P) == pytest.approx(10e-6)


def test_gamma_per_dtype() -> None:
    P = Params(gamma=1e-9, gamma_by_dtype={"float16": 4e-9})
    assert predict("allreduce", "ring", 4, 1 << 16, P, np.float16) > predict("allreduce", "ring", 4, 1 << 16, P, np.float32)


def test_fit_line_recovers_parameters() -> None:
    sizes = [0, 64, 1024, 16384, 1 << 20]
    alpha, beta, err = fit_line(sizes, [3e-6 + n * 2e-10 for n in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6) and err < 1e-9


def test_fit_piecewise_finds_the_protocol_switch() -> None:
    sizes = [0, 8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20]
    times = [1e-6 + n * 1e-9 if n <= 4096 else 20e-6 + n * 2e-10 for n in sizes]
    fit = fit_piecewise(sizes, times)
    assert fit["protocol"] and fit["protocol"][0][0] == 4096
    assert fit["alpha"] == pytest.approx(20e-6, rel=1e-3) and fit["beta"] == pytest.approx(2e-10, rel=1e-3)
    P = Params(alpha=fit["alpha"], beta=fit["beta"], protocol=tuple(tuple(t) for t in fit["protocol"]))
    assert P.msg(512) == pytest.approx(1e-6 + 512e-9, rel=1e-3)


def test_fit_piecewise_three_ranges() -> None:
    sizes = [0, 8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]

    def t(n: int) -> float:
        if n <= 512:
            return 5e-6 + n * 1e-9
        return 10e-6 + n * 1e-10 if n <= 1 << 20 else n * 2e-10

    fit = fit_piecewise(sizes, [t(n) for n in sizes])
    assert [piece[0] for piece in fit["protocol"]] == [512, 1 << 20]
    assert fit["beta"] == pytest.approx(2e-10, rel=1e-3)


def test_fit_overheads_recovers_call_and_overhead() -> None:
    base = Params(alpha=4e-6, beta=2e-10, gamma=3e-11, mem_bandwidth=8e9)
    truth = Params(alpha=4e-6, beta=2e-10, gamma=3e-11, mem_bandwidth=8e9, overhead=6e-6, call=3e-6)
    p = 4
    probes = [(c, a, n, predict(c, a, p, n, truth)) for c, a in PROBES for n in PROBE_BYTES]
    overhead, call = fit_overheads(probes, base, p)
    assert overhead == pytest.approx(6e-6, rel=1e-6) and call == pytest.approx(3e-6, rel=1e-6)


def test_call_and_shared_cores_in_predict() -> None:
    P = Params(alpha=1e-6, beta=0.0, gamma=0.0, call=2e-6)
    rd = predict("allreduce", "recursive_doubling", 4, 8, P)
    assert rd == pytest.approx(2e-6 + 2 * 1e-6)
    shared = predict("allreduce", "recursive_doubling", 4, 8, Params(alpha=1e-6, beta=0.0, gamma=0.0, call=2e-6,
                                                                      cores=2))
    assert shared == pytest.approx(2 * rd)


def test_profiles_default_and_override(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COLLECTIVES_PROFILE", str(tmp_path))
    assert load_profile("shm") == DEFAULTS["shm"]
    path = profile_path("shm")
    assert path.parent == tmp_path
    path.write_text(json.dumps(Params(alpha=7e-6, gamma_by_dtype={"float32": 1e-10}).as_dict()))
    loaded = load_profile("shm")
    assert loaded.alpha == 7e-6 and loaded.gamma_by_dtype == {"float32": 1e-10}
    assert loaded.source == str(path)


def test_selector_picks_least_predicted_runnable() -> None:
    sel = ModelSelector(Params(alpha=1e-6, beta=1e-9, gamma=1e-10))
    for collective in ("bcast", "allreduce", "allgather", "reduce_scatter", "alltoall", "barrier"):
        for nbytes in (8, 1 << 12, 1 << 22):
            exp = sel.explain(collective, nbytes, 8, np.float32, frozenset())
            runnable = [c for c in exp.candidates if c.runnable and c.name != "native"]
            best = min(runnable, key=lambda c: c.seconds)
            chosen = next(c for c in runnable if c.name == exp.choice)
            # the least predicted, or the rule's choice when the least is within TIE of it (a tie)
            assert exp.choice == best.name or (exp.choice == rule(collective, nbytes, 8, 4, frozenset())
                                               and best.seconds >= (1 - TIE) * chosen.seconds), exp.table()
            assert not algorithms_for(collective)[exp.choice].needs
    assert sel.choose("allreduce", 8, 8, np.dtype(np.float32), frozenset()) == "recursive_doubling"
    assert sel.choose("allreduce", 1 << 24, 8, np.dtype(np.float32), frozenset()) in ("rabenseifner", "ring")
    assert sel.choose("allreduce", 1 << 24, 8, np.dtype(np.float32), frozenset({"window"})) == "shared_window"
    assert len(sel._cache) == 3


def test_a_tie_goes_to_the_rule_and_explain_says_so() -> None:
    P = Params(alpha=1e-6, beta=1e-9, gamma=1e-10)
    sel = ModelSelector(P)
    ties = wins = 0
    for collective in ("bcast", "allreduce", "allgather", "reduce_scatter", "alltoall", "scatter", "gather"):
        for p in (3, 5, 8):
            for nbytes in (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24):
                exp = sel.explain(collective, nbytes, p, np.float32, frozenset())
                pool = [c for c in exp.candidates if c.runnable and c.name != "native"]
                best = min(pool, key=lambda c: c.seconds)
                ruled = next(c for c in pool if c.name == rule(collective, nbytes, p, 4, frozenset()))
                if best.name == ruled.name:
                    continue
                if best.seconds >= (1 - TIE) * ruled.seconds:
                    ties += 1
                    assert exp.choice == ruled.name and "a tie" in exp.table(), exp.table()
                else:
                    wins += 1
                    assert exp.choice == best.name and "would take" not in exp.table(), exp.table()
    assert ties and wins  # both cases came up


def test_a_prediction_within_the_window_tie_keeps_the_window() -> None:
    """Where the rule takes the shared window, another algorithm runs only when
    predicted more than WINDOW_TIE faster than it; explain says which."""
    assert WINDOW_TIE > TIE
    sel = ModelSelector(Params(alpha=1e-6, beta=1e-9, gamma=1e-10, cores=2))
    caps = frozenset({"window"})
    ties = wins = 0
    for collective in ("bcast", "allreduce", "allgather", "reduce_scatter", "alltoall", "scatter", "gather", "reduce"):
        for p in (2, 3, 4, 8):
            for nbytes in (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26):
                exp = sel.explain(collective, nbytes, p, np.float32, caps)
                pool = [c for c in exp.candidates if c.runnable and c.name != "native"]
                best = min(pool, key=lambda c: c.seconds)
                assert rule(collective, nbytes, p, 4, caps) == "shared_window"
                window = next(c for c in pool if c.name == "shared_window")
                if best.name == "shared_window":
                    assert exp.choice == "shared_window"
                elif best.seconds >= (1 - WINDOW_TIE) * window.seconds:
                    ties += 1
                    assert exp.choice == "shared_window" and f"within {WINDOW_TIE:.0%}" in exp.table(), exp.table()
                else:
                    wins += 1
                    assert exp.choice == best.name, exp.table()
    assert ties and wins  # both cases came up


def test_decisions_are_made_per_quarter_octave_on_its_least_size() -> None:
    from collectives.selection import bucket_floor, size_bucket

    for n in list(range(64)) + [1000, 1 << 20, (1 << 20) - 16, 3 << 19, 16777200, (1 << 30) + 1]:
        b = size_bucket(n)
        assert size_bucket(bucket_floor(b)) == b and bucket_floor(b) <= n < 1.25 * bucket_floor(b) + 1
    assert size_bucket((1 << 20) - 16) != size_bucket(1 << 19)  # just below 1 MiB is not decided at 512 KiB
    assert bucket_floor(size_bucket((1 << 20) - 16)) == 7 << 17


def test_parse_bytes() -> None:
    assert parse_bytes("4M") == 4 << 20 and parse_bytes("512") == 512 and parse_bytes("64KiB") == 64 << 10
    # one reader for every size the library reads: the CLIs, the bench and COLLECTIVES_* settings
    assert parse_bytes("1.5g") == 3 << 29 and parse_bytes("4Ki") == 4096 and parse_bytes("8KB") == 8192
    assert parse_bytes(" 2 MB ") == 2 << 20 and parse_bytes("7B") == 7
    for bad in ("", "K", "4X", "4..5M", "M4"):
        with pytest.raises(ValueError, match="cannot read a size"):
            parse_bytes(bad)
    from collectives import config
    from collectives.bench.cli import parse_sizes

    assert config._parse(config.SETTINGS["SHM_RING_BYTES"], "2MiB") == 2 << 20
    assert parse_sizes("8,64K,1M") == [8, 64 << 10, 1 << 20]


def test_explain_cli(capsys) -> None:
    assert explain_main(["allreduce", "--bytes", "4M", "-n", "8", "--transport", "shm"]) == 0
    out = capsys.readouterr().out
    for name in ("ring", "rabenseifner", "recursive_doubling", "mst", "shared_window", "choice:"):
        assert name in out


def test_calibrate_on_shared_memory(tmp_path) -> None:
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "collectives.cost_models.calibrate", "--transport", "shm",
                           "-n", "2", "--quick", "--out", str(out), "--timeout", "120",
                           "--stretch-ranks", "4"],  # one stretch job (the default runs 3 to 8 ranks: 30 s more)
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["transport"] == "shm" and data["alpha"] > 0 and data["beta"] > 0
    anchored = {(c, a) for c, a, p, n, t in data["anchors"] if p == 2 and t > 0}
    runnable = {(a.collective, a.name) for a in all_algorithms() if a.name != "native"}
    assert anchored == runnable  # every algorithm shared memory runs, timed at its smallest size
    # each anchored algorithm's code digest, which loading checks: every anchor is kept
    assert set(data["anchor_digests"]) == {f"{c}/{a}" for c, a in anchored}
    assert data["gamma_by_dtype"]["float32"] > 0 and data["mem_bandwidth"] > 0
    # an 8-byte allreduce timed before each of the main job's 5 steps and at its end, and at the
    # start and end of each stretch job (the suite's load may make them differ: not checked here)
    whens = [(p, when) for p, when, t in data["latency_probes"] if t > 0]
    assert whens[:6] == [(2, f"before step {k} of 5") for k in range(1, 6)] + [(2, "at the end")]
    stretched = {int(t[0]) for t in data["stretch"]} - {2}
    assert sorted(whens[6:]) == sorted((p, w) for p in stretched for w in ("at the start", "at the end"))
    loaded = load_profile("shm", out)
    assert loaded.alpha == data["alpha"] and len(loaded.anchors) == len(data["anchors"])
    note = unsteady(data)
    assert loaded.source == (f"{out}; {note}" if note else str(out))
    assert (note != "") == ("this profile was measured while the host changed state" in proc.stderr)


def test_a_profile_measured_while_the_host_changed_state_says_so(tmp_path, capsys) -> None:
    """Latency probes that differ by more than UNSTEADY_SPREAD within one job
    mark the profile (its source, which explain prints); across jobs of
    different rank counts they are not compared."""
    steady = [[2, "before step 1 of 5", 0.30e-6], [2, "at the end", 0.31e-6],
              [8, "at the start", 2.0e-6], [8, "at the end", 2.1e-6]]
    assert unsteady({"latency_probes": steady}) == ""
    slow = 0.30e-6 * UNSTEADY_SPREAD * 1.2
    moved = steady + [[3, "at the start", 0.40e-6], [3, "at the end", 0.40e-6 * UNSTEADY_SPREAD * 1.01],
                      [2, "before step 4 of 5", slow]]
    note = unsteady({"latency_probes": moved})
    assert note.startswith("measured while the host changed state: in the 2-rank job")  # the worse of two jobs
    assert "0.30 us before step 1 of 5" in note and f"{slow * 1e6:.2f} us before step 4 of 5" in note
    assert "calibrate again" in note
    assert unsteady({"latency_probes": [[2, "at the end", 0.3e-6]]}) == unsteady({}) == ""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**Params().as_dict(), "latency_probes": moved}))
    assert load_profile("shm", path).source == f"{path}; {note}"
    assert explain_main(["allreduce", "--bytes", "4M", "-n", "2", "--profile", str(path)]) == 0
    assert note in capsys.readouterr().out


# ----------------------------------------------------- timing and stretch


def _timed_sleeps(comm, lead: float) -> tuple[bool, float]:
    from collectives.cost_models import timing

    timing.START_LEAD = lead  # a tiny lead makes the first tries late: they must be retried
    nap = 0.003 if comm.rank == comm.size - 1 else 0.0
    return timing.shared_clock(comm), timing.slowest_best(comm, lambda: time.sleep(nap), 5)


@pytest.mark.parametrize("lead", [200e-6, 1e-9])
def test_slowest_best_times_from_a_common_start(lead) -> None:
    from harness import run_ranks

    results = run_ranks(_timed_sleeps, 3, lead, timeout=60)
    assert all(shared for shared, _ in results)  # one kernel: one clock
    seconds = {t for _, t in results}
    assert len(seconds) == 1  # every rank reports the same time
    # a sleep never ends early; above it, the bound only rules out gross errors (a sum over
    # tries or ranks): with a tiny lead the last try is taken late, lateness included, and a
    # busy machine makes that milliseconds
    assert 0.003 <= seconds.pop() < 3 * 0.003


def _timed_turns(comm) -> tuple[dict, list]:
    from collectives.cost_models import timing

    order: list[str] = []

    def nap(name: str, seconds: float):
        def call() -> None:
            order.append(name)
            time.sleep(seconds if comm.rank == 0 else 0.0)
        return call

    best = timing.slowest_best_each(comm, {"short": nap("short", 0.001), "long": nap("long", 0.003)}, 3)
    return best, order


def test_slowest_best_each_takes_turns() -> None:
    from harness import run_ranks

    results = run_ranks(_timed_turns, 2, timeout=60)
    assert results[0] == results[1]  # every rank reports the same times
    best, order = results[0]
    # sleeps never end early; above them only gross errors are ruled out (a busy machine adds
    # milliseconds to a try): the short call stays shorter than the long one
    assert 0.001 <= best["short"] < best["long"] and 0.003 <= best["long"] < 3 * 0.003
    # each round times both, each timed call after an untimed one of its own (a late try is
    # retried later)
    assert order[:4] == ["short", "short", "long", "long"]
    assert order.count("short") >= 6 and order.count("long") >= 6


def test_stretch_table_interpolates_and_scales() -> None:
    P = Params(stretch=((2, 1.0, 1.0, 2.0, 1.0), (4, 3.0, 2.0, 10.0, 1.5)))
    assert P.stretch_at(1) == (1.0, 1.0, 1.0, 1.0)
    assert P.stretch_at(3) == pytest.approx((2.0, 1.5, 6.0, 1.25))
    assert P.stretch_at(8) == pytest.approx((6.0, 4.0, 20.0, 3.0))  # beyond the table: grows as p
    assert Params.from_dict(P.as_dict()).stretch == P.stretch
    old = Params.from_dict({"stretch": [[2, 1.0, 1.5, 2.0]]})  # a profile from before the local factor
    assert old.stretch_at(2) == (1.0, 1.5, 2.0, 1.5)


def test_fit_stretch_recovers_known_factors() -> None:
    from collectives.cost_models.calibration_fits import fit_stretch
    from collectives.cost_models.calibration_measurements import STRETCH_BYTES, WINDOW_PROBES
    from collectives.cost_models.model import split_terms

    base = Params(alpha=5e-6, beta=2e-10, gamma=1e-10, mem_bandwidth=8e9, fence=1e-6, overhead=2e-6)
    truth = (3.0, 1.5, 40.0, 1.2)
    p = 4
    probes = []
    for c, a in PROBES + WINDOW_PROBES:
        for n in PROBE_BYTES + STRETCH_BYTES:
            terms = split_terms(c, a, p, n, base)
            probes.append((c, a, n, sum(f * t for f, t in zip(truth, terms))))
    assert fit_stretch(probes, base, p) == pytest.approx(truth, rel=1e-6)
    stretched = Params(**{**base.__dict__, "stretch": ((p, *truth),)})
    c, a, n, t = probes[0]
    assert predict(c, a, p, n, stretched) == pytest.approx(t, rel=1e-9)


def test_anchors_fix_an_algorithms_own_fixed_cost() -> None:
    base = Params(alpha=5e-6, beta=2e-10, gamma=1e-10, mem_bandwidth=8e9)
    anchored = Params(**{**base.__dict__, "anchors": (("allreduce", "ring", 4, 16, 80e-6),)})
    for n in (16, 4096, 1 << 20):
        grows = predict("allreduce", "ring", 4, n, base) - predict("allreduce", "ring", 4, 16, base)
        assert predict("allreduce", "ring", 4, n, anchored) == pytest.approx(80e-6 + grows)
    # other algorithms and other rank counts keep the formula
    assert predict("allreduce", "mst", 4, 4096, anchored) == predict("allreduce", "mst", 4, 4096, base)
    assert predict("allreduce", "ring", 8, 4096, anchored) == predict("allreduce", "ring", 8, 4096, base)
    assert Params.from_dict(anchored.as_dict()).anchors == anchored.anchors


def test_a_large_anchor_scales_what_the_formula_adds() -> None:
    base = Params(alpha=5e-6, beta=2e-10, gamma=1e-10, mem_bandwidth=8e9)
    big = 4 << 20
    grows = predict("allreduce", "ring", 4, big, base) - predict("allreduce", "ring", 4, 16, base)
    anchored = Params(**{**base.__dict__, "anchors": (("allreduce", "ring", 4, big, 80e-6 + 3 * grows),
                                                     ("allreduce", "ring", 4, 16, 80e-6))})
    assert predict("allreduce", "ring", 4, 16, anchored) == pytest.approx(80e-6)
    assert predict("allreduce", "ring", 4, big, anchored) == pytest.approx(80e-6 + 3 * grows)
    for n in (1 << 16, 1 << 20, 16 << 20):  # in between and beyond: three times what the formula adds
        adds = predict("allreduce", "ring", 4, n, base) - predict("allreduce", "ring", 4, 16, base)
        assert predict("allreduce", "ring", 4, n, anchored) == pytest.approx(80e-6 + 3 * adds)


def test_anchors_between_scale_each_interval_apart() -> None:
    base = Params(alpha=5e-6, beta=2e-10, gamma=1e-10, mem_bandwidth=8e9)
    f = {n: predict("allreduce", "ring", 4, n, base) for n in (16, 1 << 20, 4 << 20, 16 << 20, 2 << 20)}
    t = {16: 80e-6, 1 << 20: 80e-6 + 2 * (f[1 << 20] - f[16])}
    t[4 << 20] = t[1 << 20] + 0.5 * (f[4 << 20] - f[1 << 20])
    anchored = Params(**{**base.__dict__, "anchors": tuple(("allreduce", "ring", 4, n, s) for n, s in t.items())})
    for n, seconds in t.items():
        assert predict("allreduce", "ring", 4, n, anchored) == pytest.approx(seconds)
    mid = t[1 << 20] + 0.5 * (f[2 << 20] - f[1 << 20])  # between 1 and 4 MiB: that interval's scale
    assert predict("allreduce", "ring", 4, 2 << 20, anchored) == pytest.approx(mid)
    beyond = t[4 << 20] + 0.5 * (f[16 << 20] - f[4 << 20])  # beyond: the last interval's
    assert predict("allreduce", "ring", 4, 16 << 20, anchored) == pytest.approx(beyond)


def test_a_larger_message_never_costs_less() -> None:
    # a range fitted apart may start below where the range before it ended
    P = Params(alpha=20e-6, beta=2.5e-10, protocol=((131072, 60e-6, 3e-10),), exchange=1.5)
    sizes = [1 << k for k in range(22)] + [131073, 200_000, 300_000]
    for cost in (P.msg, P.xmsg):
        costs = [cost(m) for m in sorted(sizes)]
        assert costs == sorted(costs)
    assert P.msg(1 << 21) == pytest.approx(20e-6 + (1 << 21) * 2.5e-10)  # far above, its own line


def test_anchored_predictions_follow_a_cheaper_path_in_proportion() -> None:
    from collectives.window_contract import CMA_NEVER

    MiB = 1 << 20
    base = Params(cores=2, cma_from=CMA_NEVER)  # 4 ranks, reads lose: the window's bcast reads directly from 4 MiB
    f = {n: predict("bcast", "shared_window", 4, n, base) for n in (7 * MiB // 2, 4 * MiB)}
    assert f[4 * MiB] < f[7 * MiB // 2]  # one copy instead of two
    P = Params(cores=2, cma_from=CMA_NEVER, anchors=(("bcast", "shared_window", 4, 16, 30e-6),
                                 ("bcast", "shared_window", 4, 7 * MiB // 2, 800e-6),
                                 ("bcast", "shared_window", 4, 16 * MiB, 2500e-6)))
    assert predict("bcast", "shared_window", 4, 4 * MiB, P) == pytest.approx(800e-6 * f[4 * MiB] / f[7 * MiB // 2])


def test_a_chain_sends_one_piece_hop_by_hop_and_pipelines_the_rest() -> None:
    P = Params(alpha=5e-6, beta=2e-10, exchange=1.5, segment_bytes=1 << 20)
    one, four = 1 << 20, 4 << 20
    assert predict("bcast", "pipelined_chain", 5, one, P) == pytest.approx(4 * P.msg(one))
    assert predict("bcast", "pipelined_chain", 5, four, P) == pytest.approx(4 * P.msg(one) + 3 * P.xmsg(one))
    assert predict("bcast", "pipelined_chain", 2, four, P) == pytest.approx(4 * P.msg(one))  # no middle rank


def test_window_models_switch_to_direct_reads_where_the_algorithms_do(monkeypatch) -> None:
    from collectives.algorithms.window.tuning import DIRECT_FROM, PIECE_BYTES, compiled_direct, direct_from
    from collectives.cost_models.window import direct
    from collectives.window_contract import CMA_NEVER

    MiB = 1 << 20
    assert direct_from("allreduce", 2, 2) == 4 * MiB and direct_from("allreduce", 4, 2) == 4 * MiB
    assert direct_from("allreduce", 8, 0) == 4 * MiB  # a core each
    assert direct_from("alltoall", 2, 2) == 4 * MiB and direct_from("alltoall", 4, 2) == 2 * MiB  # sooner
    assert direct_from("gather", 2, 2) == 2 * MiB and direct_from("gather", 4, 2) == 8 * MiB  # later
    assert direct_from("bcast", 4, 2) == 4 * MiB and direct_from("bcast", 8, 2) == 4 * MiB  # the window up to there
    P = Params(cores=2)
    for collective in DIRECT_FROM:
        at = direct_from(collective, 4, 2)
        assert direct(collective, 4, at, P)
        assert direct(collective, 4, at - 1, P) == compiled_direct(collective, at - 1, 4, 2)  # its compiled call
    assert direct("allreduce", 2, 64 << 10, P) and not direct("allreduce", 2, (64 << 10) - 1, P)
    assert direct("allreduce", 4, MiB, P) and not direct("allreduce", 4, MiB - 1, P)  # ranks share cores
    assert direct("allreduce", 2, 2 * PIECE_BYTES - 2, P)  # the compiled call up to where DIRECT_FROM takes over
    assert direct("scatter", 4, 128 << 10, P) and not direct("scatter", 4, (128 << 10) - 1, P)
    assert direct("alltoall", 4, 256 << 10, P) and not direct("alltoall", 4, (256 << 10) - 1, P)
    for collective in ("gather", "bcast"):  # the compiled call from 512 KiB, then the pool's direct path
        assert direct(collective, 4, 512 << 10, P) and not direct(collective, 4, (512 << 10) - 1, P)
        assert direct(collective, 4, 16 << 20, P)
    assert not direct("gather", 4, 512 << 10, replace(P, cma_from=CMA_NEVER))  # the race's answer: the window
    # allreduce: the direct compiled call up to DIRECT_FROM (each rank writes its reduced 1/p into every
    # peer's pooled buffer), then the pool's direct path (which reads what it reduces too)
    own = replace(P, cores=4)  # a core each (no stretch)
    share = 3 / 4 * 3 * MiB
    assert predict("allreduce", "shared_window", 4, 3 * MiB, own) == pytest.approx(
        2 * P.fence + P.copy(share) + share * P.gamma)
    share = 3 / 4 * 4 * MiB
    assert predict("allreduce", "shared_window", 4, 4 * MiB, own) == pytest.approx(
        2 * P.fence + 2 * P.copy(share) + share * P.gamma)
    from collectives.cost_models.window.reduce import reduce as reduce_model
    share = 3 / 4 * MiB  # reduce's direct call from 1 MiB where ranks share cores: each rank writes 1/p to the root
    assert reduce_model(4, MiB, P) == pytest.approx(2 * P.fence + P.copy(MiB / 4) + share * P.gamma)
    assert reduce_model(4, MiB - 4, P) != pytest.approx(2 * P.fence + P.copy((MiB - 4) / 4) + share * P.gamma)
    monkeypatch.setenv("COLLECTIVES_WINDOW_DIRECT_BYTES", str(MiB))
    assert direct_from("gather", 8, 2) == MiB and direct("bcast", 2, MiB, P)


def test_window_models_follow_the_copy_race_of_the_profile() -> None:
    """The race's answer (bytes from which a cross-memory read wins) travels in the profile and
    moves the models' direct reads where ranks have a core each, as it moves the algorithms'."""
    from collectives.cost_models.window import direct
    from collectives.transports.shm.copy_race import NEVER

    P = Params(cores=2)
    assert Params.from_dict(replace(P, cma_from=1 << 20).as_dict()).cma_from == 1 << 20
    assert Params.from_dict(P.as_dict()).cma_from == 0
    assert direct("alltoall", 2, 256 << 10, P) and direct("allgather", 2, 256 << 10, P)
    assert not direct("alltoall", 2, 256 << 10, replace(P, cma_from=NEVER))
    assert not direct("alltoall", 2, 512 << 10, replace(P, cma_from=1 << 20))
    assert direct("alltoall", 2, 1 << 20, replace(P, cma_from=1 << 20))
    # shared cores: below the race's size too, from 4 MiB of all ranks' buffers per core
    assert direct("alltoall", 8, 1 << 20, replace(P, cma_from=NEVER)) and direct("alltoall", 4, 2 << 20, replace(P, cma_from=NEVER))
    assert not direct("alltoall", 4, 1 << 20, replace(P, cma_from=NEVER)) and direct("alltoall", 4, 1 << 20, P)
    assert not direct("alltoall", 4, 256 << 10, replace(P, cma_from=NEVER)) and direct("alltoall", 4, 256 << 10, P)
    assert not direct("scatter", 4, 128 << 10, replace(P, cma_from=NEVER)) and direct("scatter", 4, 128 << 10, P)


def test_exchange_steps_cost_the_exchange_factor() -> None:
    from collectives.cost_models.calibration_fits import fit_exchange

    base = Params(alpha=5e-6, beta=2e-10, gamma=0.0, mem_bandwidth=8e9)
    doubled = Params(**{**base.__dict__, "exchange": 2.0})
    n = 1 << 20
    assert doubled.xmsg(n) == pytest.approx(base.msg(n) + n * 2e-10)
    assert doubled.msg(n) == base.msg(n)  # one-way messages keep beta
    # the ring's steps are exchanges, the binomial tree's are not
    assert predict("allgather", "ring", 4, n, doubled) > predict("allgather", "ring", 4, n, base) * 1.5
    assert predict("bcast", "binomial", 4, n, doubled) == predict("bcast", "binomial", 4, n, base)
    sizes = (1 << 20, 4 << 20)
    measured = [base.msg(0) + 2.0 * (base.msg(m) - base.msg(0)) for m in sizes]
    assert fit_exchange(sizes, measured, base) == pytest.approx(2.0)
    assert fit_exchange(sizes, [base.msg(m) * 0.5 for m in sizes], base) == 1.0  # never below one-way
    assert Params.from_dict(doubled.as_dict()).exchange == 2.0


def test_a_failed_stretch_job_is_tried_once_more_but_not_one_stopped_at_its_timeout(tmp_path):
    from collectives.cost_models.calibrate import TIMED_OUT, _ran

    calls = []

    def flaky(p, out):
        calls.append(p)
        if len(calls) > 1:
            (tmp_path / "probes.json").write_text("{}")
            return 0
        return 1

    assert _ran(flaky, 3, str(tmp_path / "probes.json"), tries=2) and calls == [3, 3]
    calls.clear()
    assert not _ran(lambda p, out: calls.append(p) or 1, 4, str(tmp_path / "none.json"), tries=2)
    assert calls == [4, 4]
    calls.clear()  # a job stopped at --timeout would only take as long again: it is not run twice
    assert not _ran(lambda p, out: calls.append(p) or TIMED_OUT, 5, str(tmp_path / "none.json"), tries=2)
    assert calls == [5]


def test_beyond_the_last_anchor_a_path_switch_is_not_a_trend() -> None:
    """The window's bcast at 3 ranks on 2 cores (reads losing to the window's
    copies) reads directly from 4 MiB:
    anchors just below and above that switch rise far more than the formula
    does between them; beyond them the prediction scales from the last anchor
    in proportion, not with that rise's slope (which once predicted a 64 MiB
    scatter at twice its measured time and chose binomial)."""
    from collectives.window_contract import CMA_NEVER

    base = Params(alpha=5e-6, beta=2e-10, gamma=1e-10, mem_bandwidth=20e9, fence=1e-6, cores=2, cma_from=CMA_NEVER)
    below, above, far = (2 << 20) - 12, 4 << 20, 64 << 20
    f = {n: predict("bcast", "shared_window", 3, n, base) for n in (below, above, far)}
    assert f[above] - f[below] < 0.5 * f[below]  # the cheaper direct path starts in between
    anchored = Params(**{**base.__dict__, "anchors": (("bcast", "shared_window", 3, below, f[below]),
                                                     ("bcast", "shared_window", 3, above, 3 * f[above]))})
    assert predict("bcast", "shared_window", 3, far, anchored) == pytest.approx(3 * f[far])


def _profile_with_anchors(tmp_path, digests: dict[str, str] | None):
    anchors = [["reduce", "shared_window", 2, 8, 5e-6], ["reduce", "binomial", 2, 8, 40e-6],
               ["bcast", "binomial", 2, 8, 30e-6]]
    data = {**Params().as_dict(), "anchors": anchors}
    if digests is not None:
        data["anchor_digests"] = digests
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_anchors_of_changed_code_are_dropped_and_the_source_says_so(tmp_path) -> None:
    """An anchor measured one algorithm's code: after that code changes (its
    digest differs), or where a profile carries no digests, the profile loads
    without it, and what auto follows names the algorithms and the remedy."""
    current = anchor_digests([("reduce", "shared_window"), ("reduce", "binomial"), ("bcast", "binomial")])
    assert len(set(current.values())) == 3
    changed = {**current, "reduce/shared_window": "0" * 16}
    params = load_profile("shm", _profile_with_anchors(tmp_path, changed))
    assert {(c, a) for c, a, *_ in params.anchors} == {("reduce", "binomial"), ("bcast", "binomial")}
    assert "1 algorithm(s) whose code changed" in params.source and "reduce/shared_window" in params.source
    assert "collectives calibrate" in params.source
    assert len(load_profile("shm", _profile_with_anchors(tmp_path, current)).anchors) == 3
    bare = load_profile("shm", _profile_with_anchors(tmp_path, None))
    assert bare.anchors == () and "3 algorithm(s)" in bare.source


def test_a_digest_covers_the_helpers_an_algorithm_imports(monkeypatch) -> None:
    """The window's reduce imports its pieces, which import the tuning table:
    a change there changes its digest; binomial's does not import them."""
    from collectives.cost_models import digests

    before = {a: digests.algorithm_digest("reduce", a) for a in ("shared_window", "binomial")}
    real = digests._source
    monkeypatch.setattr(digests, "_source",
                        lambda m: None if real(m) is None else real(m) + ("# changed" if m.endswith("window.tuning") else ""))
    digests.algorithm_digest.cache_clear()
    try:
        after = {a: digests.algorithm_digest("reduce", a) for a in ("shared_window", "binomial")}
    finally:
        digests.algorithm_digest.cache_clear()
    assert after["shared_window"] != before["shared_window"]
    assert after["binomial"] == before["binomial"]


def test_the_message_paths_call_cost_is_not_the_windows() -> None:
    """Calibration fits ``call`` on message algorithms (the Python around
    their messages, about 20 us on shared memory); the window's compiled
    calls do not pay it, so an unanchored prediction of the window leaves it out."""
    base = Params(fence=1e-6, mem_bandwidth=20e9)
    slow = replace(base, call=20e-6)
    for collective in ("bcast", "allreduce", "gather", "alltoall", "barrier"):
        n = 0 if collective == "barrier" else 64
        assert predict(collective, "shared_window", 4, n, slow) == pytest.approx(
            predict(collective, "shared_window", 4, n, base))
    for collective, algorithm in (("bcast", "binomial"), ("allreduce", "ring"), ("barrier", "dissemination")):
        n = 0 if collective == "barrier" else 64
        assert predict(collective, algorithm, 4, n, slow) == pytest.approx(
            predict(collective, algorithm, 4, n, base) + 20e-6)
