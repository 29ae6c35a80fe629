"""PyTorch's own distributed tests on the ``collectives`` backend, beside Gloo.

A subset of ``torch.testing._internal.distributed.distributed_test`` (the
suite behind torch's ``test_distributed_spawn.py``), chosen to cover
what the suite found missing at first (receiving from any source, sparse
allreduce, timeouts, the monitored barrier, the profiled variants) beside
the plain collectives, point-to-point with tags and DDP, runs at 2 ranks
through ``python -m collectives.bench.torch_suite`` on both backends (the
ranks forked from a server that imported torch once: about 40 s rather than
three minutes); every test that passes on Gloo must pass on ours. The whole sweep (2, 3 and 8
ranks) is ``python -m collectives.bench.torch_suite``; see docs/torch.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from launched import environment_without

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("expecttest") is None,
    reason="needs torch and expecttest (pip install -e '.[torch]')")

SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_reduce_sum", "test_all_gather_coalesced_simple",
    "test_gather", "test_barrier_timeout_full_group", "test_send_recv_any_source",
    "test_send_recv_any_source_torch_profiler", "test_send_recv_with_tag_autograd_profiler",
    "test_isend_torch_profiler", "test_irecv", "test_sparse_all_reduce_sum", "test_DistributedDataParallelCPU",
    "test_monitored_barrier_gloo_rank_0_timeout",
]
DEADLINE = 540


def _clean_env() -> dict[str, str]:
    drop = ("COLLECTIVES_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "BACKEND",
            "TEMP_DIR", "INIT_METHOD")
    env = environment_without(drop)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(DEADLINE + 60)
def test_subset_passes_on_collectives_wherever_it_passes_on_gloo(tmp_path):
    out = tmp_path / "results.json"
    pattern = "^(" + "|".join(SUBSET) + ")$"
    argv = [sys.executable, "-m", "collectives.bench.torch_suite", "--ranks", "2", "--jobs", "2",
            "-k", pattern, "--timeout", "90", "--start", "forkserver", "--json", str(out), "--logs", str(tmp_path / "logs"), "-q"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE, env=_clean_env())
    report = res.stdout[-6000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    by = {(r["test"], r["backend"]): r for r in results}
    assert {t for t, _ in by} == set(SUBSET), report
    on_gloo = [t for t in SUBSET if by[(t, "gloo")]["status"] == "passed"]
    assert len(on_gloo) >= len(SUBSET) - 1, f"Gloo itself fails here:\n{report}"
    missing = [f"{t}: {by[(t, 'collectives')]['status']}: {by[(t, 'collectives')]['message']}"
               for t in on_gloo if by[(t, "collectives")]["status"] != "passed"]
    assert not missing, "\n".join(missing) + "\n" + report
    assert res.returncode == 0, report


def test_first_line_names_the_rank_and_the_exception():
    from collectives.bench.torch_suite import first_line

    text = ("Process 1 exited with error code 10 and exception:\n"
            "Traceback (most recent call last):\n"
            '  File "suite.py", line 9, in check\n'
            "    self.assertEqual(len(events), 1)\n"
            "AssertionError: Scalars are not equal!\n\nExpected 1 but got 0.\nAbsolute difference: 1\n")
    assert first_line(text) == "rank 1: AssertionError: Scalars are not equal! | Expected 1 but got 0."


def test_differences_list_what_passes_on_gloo_only():
    from collectives.bench.torch_suite import TestResult, differences

    results = [TestResult("test_a", "gloo", 2, "passed", 1.0), TestResult("test_a", "collectives", 2, "failed", 1.0, "x"),
               TestResult("test_b", "gloo", 2, "passed", 1.0), TestResult("test_b", "collectives", 2, "passed", 1.0),
               TestResult("test_c", "gloo", 2, "skipped", 0.0), TestResult("test_c", "collectives", 2, "errored", 1.0)]
    assert [(g.test, m.status) for g, m in differences(results)] == [("test_a", "failed")]
