"""What ``algorithm="auto"`` follows: rank 0's calibration profile, agreed at init.

Real ranks over shared memory and TCP, each given its own profile folder
(``COLLECTIVES_PROFILE``): rank 0's profile wins on every rank, none on
rank 0 means the rule everywhere, ``COLLECTIVES_SELECTOR`` chooses, and a
call with ``auto`` runs what the models chose. Also ``explain`` and the
calibration's closing reading.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import harness
from collectives.cost_models.calibrate import reading
from collectives.cost_models.profile import DEFAULTS
from collectives.launcher import rank_environment


def _profile(folder, transport: str) -> str:
    """A profile of ``transport`` in ``folder`` (the transport's default parameters)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {**DEFAULTS[transport].as_dict(), "transport": transport, "host": "h0"}
    data.pop("source", None)
    path = folder / f"profile-{transport}-{__import__('socket').gethostname()}.json"
    path.write_text(json.dumps(data))
    return str(path)


def with_profiles(monkeypatch, folders: list[str], selector: str | None = None) -> None:
    """Rank r reads its profiles from ``folders[r]``."""
    def environment(rank: int, size: int, **kwargs):
        env = rank_environment(rank, size, **kwargs)
        env["COLLECTIVES_PROFILE"] = folders[rank]
        if selector:
            env["COLLECTIVES_SELECTOR"] = selector
        return env
    monkeypatch.setattr(harness, "rank_environment", environment)


def what_auto_follows(comm):
    """The selector's kind, its profile's source, and auto's choice for a 64 KiB allreduce at 3 ranks."""
    sel = comm.selector
    params = getattr(sel, "params", None)
    choice = sel.choose("allreduce", 64 << 10, 3, np.dtype(np.float32), frozenset(comm.transport.capabilities))
    return type(sel).__name__, getattr(params, "source", None), choice


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_rank_zeros_profile_is_every_ranks(monkeypatch, tmp_path, transport):
    path = _profile(tmp_path / "r0", transport)
    (tmp_path / "none").mkdir()
    with_profiles(monkeypatch, [str(tmp_path / "r0"), str(tmp_path / "none"), str(tmp_path / "none")])
    results = harness.run_ranks(what_auto_follows, 3, transport=transport, timeout=60)
    assert len(set(results)) == 1, results
    kind, source, _ = results[0]
    assert kind == "ModelSelector" and source.startswith(path) and "rank 0's" in source, results


def test_no_profile_on_rank_zero_is_the_rule_everywhere(monkeypatch, tmp_path):
    _profile(tmp_path / "r1", "zmq")
    (tmp_path / "none").mkdir()
    with_profiles(monkeypatch, [str(tmp_path / "none"), str(tmp_path / "r1"), str(tmp_path / "r1")])
    results = harness.run_ranks(what_auto_follows, 3, transport="zmq", timeout=60)
    assert results == [("RuleSelector", None, "rabenseifner")] * 3, results


def test_the_setting_chooses(monkeypatch, tmp_path):
    _profile(tmp_path / "r0", "zmq")
    with_profiles(monkeypatch, [str(tmp_path / "r0")] * 2, selector="rule")
    assert {r[0] for r in harness.run_ranks(what_auto_follows, 2, transport="zmq", timeout=60)} == {"RuleSelector"}
    (tmp_path / "none").mkdir()
    with_profiles(monkeypatch, [str(tmp_path / "none")] * 2, selector="model")
    results = harness.run_ranks(what_auto_follows, 2, transport="zmq", timeout=60)
    assert {(r[0], r[1]) for r in results} == {("ModelSelector", "defaults")}, results


def models_race(comm):
    """The model's copy race (bytes from which a cross-memory read wins) and the transport's."""
    return comm.selector.params.cma_from, comm.transport.cma_from


@pytest.mark.parametrize("faster,want", [("0", "never"), ("1", 0)])
def test_the_model_follows_this_jobs_copy_race_not_the_profiles(monkeypatch, tmp_path, faster, want):
    """The profile was calibrated in another state of the host: the window's paths follow this job's race,
    and so do the models' predictions of them."""
    from collectives.transports.shm.copy_race import NEVER

    folder = tmp_path / "r0"
    path = _profile(folder, "shm")
    data = json.loads(open(path).read())
    data["cma_from"] = 1 << 20
    open(path, "w").write(json.dumps(data))
    with_profiles(monkeypatch, [str(folder)] * 2)
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_FASTER", faster)
    want = NEVER if want == "never" else want
    assert harness.run_ranks(models_race, 2, timeout=60) == [(want, want)] * 2


def auto_runs_the_models_choice(comm):
    x = np.ones(16 << 10, np.float32)  # 64 KiB
    comm.allreduce(x)
    last = comm.flight_record()[-1]
    return last["algorithm"], float(x[0]), comm.explain("allreduce", 64 << 10).table()


def test_auto_runs_what_the_models_chose_and_explain_says_so(monkeypatch, tmp_path):
    """At 3 ranks over TCP with the default parameters as a profile, the
    models take ring for a 64 KiB allreduce where the rule takes rabenseifner."""
    path = _profile(tmp_path / "r0", "zmq")
    (tmp_path / "none").mkdir()
    with_profiles(monkeypatch, [str(tmp_path / "r0"), str(tmp_path / "none"), str(tmp_path / "none")])
    for algorithm, value, said in harness.run_ranks(auto_runs_the_models_choice, 3, transport="zmq", timeout=60):
        assert algorithm == "ring" and value == 3.0, (algorithm, value)
        assert "auto runs ring: auto follows the cost models, with " + path in said, said


def test_explain_says_what_auto_runs_and_why(tmp_path):
    env_none = {"COLLECTIVES_PROFILE": str(tmp_path / "none")}
    cmd = [sys.executable, "-m", "collectives.cli", "explain", "bcast", "--bytes", "4M", "-n", "3",
           "--transport", "zmq"]
    ruled = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                           env={**__import__("os").environ, **env_none})
    assert "choice: binomial (the cost models would take pipelined_chain)" in ruled.stdout, ruled.stdout
    assert "auto runs binomial: auto follows the rule: no calibration profile of zmq" in ruled.stdout, ruled.stdout
    path = _profile(tmp_path / "r0", "zmq")
    modelled = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**__import__("os").environ, "COLLECTIVES_PROFILE": str(tmp_path / "r0")})
    assert "choice: pipelined_chain" in modelled.stdout and path in modelled.stdout, modelled.stdout


def test_the_calibrations_reading_names_where_the_models_and_the_rule_differ(tmp_path):
    path = _profile(tmp_path, "zmq")
    text = reading(__import__("pathlib").Path(path), "zmq", 3)
    assert text.startswith("reading: a message costs 40.00 us"), text
    assert "allreduce: 8 B" in text and "64 KiB ring (the rule: rabenseifner)" in text, text
