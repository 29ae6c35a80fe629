"""A PyTorch trainer that survives a lost rank: DistributedOptimizer.shrink and
broadcast_state, and examples/elastic_torch.py under the launcher."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from collectives import PeerLost  # noqa: E402
from harness import run_ranks  # noqa: E402

TIMEOUT = 5.0  # the communicators' timeout, seconds
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "elastic_torch.py")
STEPS, GLOBAL_BATCH, KILL_STEP = 40, 48, 12
RUN_DEADLINE = 120.0  # the whole launcher run: four processes importing torch on a busy machine


def _launch(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, float, dict[int, dict]]:
    """Run the example on 4 ranks with ``--on-failure continue``; the launcher's
    result, its wall time and each survivor's report by original rank."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "collectives.cli", "run", "-n", "4", "--on-failure", "continue",
                           EXAMPLE, "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--kill-rank", "2",
                           "--kill-step", str(KILL_STEP), "--timeout", str(TIMEOUT), "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=RUN_DEADLINE)
    took = time.monotonic() - start
    reports = {}
    for name in os.listdir(tmp_path):
        with open(tmp_path / name) as f:
            report = json.load(f)
        reports[report["original"]] = report
    return proc, took, reports


@functools.lru_cache(maxsize=None)
def _references(steps: tuple[int, ...]) -> dict[int, np.ndarray]:
    """The example's single-process parameters after each number of ``steps``,
    computed in one process of its own (torch's thread pool, once used here,
    would hang the ranks that later tests fork from this process), once per run."""
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(EXAMPLE)!r}); import elastic_torch as e; "
            f"print(json.dumps([e.single_process_reference(n, {GLOBAL_BATCH}).tolist() for n in {list(steps)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_DEADLINE,
                         check=True)
    return {n: np.array(v) for n, v in zip(steps, json.loads(out.stdout.splitlines()[-1]))}


def _single_process_reference(steps: int = STEPS) -> np.ndarray:
    """The example's single-process parameters after ``steps`` steps (computed
    beside the neighbouring counts that :func:`test_the_check_tells_a_skipped_or_repeated_step_apart` uses)."""
    return _references((STEPS - 1, STEPS, STEPS + 1))[steps]


def _check_survivors(reports: dict[int, dict], survivors: list[int], epochs: tuple[int, ...]) -> None:
    """Every survivor finished every step on the survivors' communicator, recovered
    within the timeout, left no thread of the old communicator running, and
    holds the same parameters as every other survivor and as the single-process run."""
    assert sorted(reports) == survivors, reports.keys()
    reference = _single_process_reference()
    first = np.array(reports[survivors[0]]["parameters"])
    for original, r in reports.items():
        assert r["size"] == len(survivors) and r["original_ranks"] == survivors, r
        assert r["original_ranks"][r["rank"]] == original and r["epoch"] in epochs, r
        assert r["steps"] == STEPS and r["lost_at"] and set(r["lost_at"]) == {KILL_STEP}, r
        assert r["recovery_s"] < TIMEOUT + 3, r["recovery_s"]
        assert r["threads_left"] == [], r["threads_left"]
        params = np.array(r["parameters"])
        assert np.array_equal(params, first), f"rank {original} disagrees with rank {survivors[0]}"
        assert np.abs(params - reference).max() < 1e-10, np.abs(params - reference).max()


def test_the_check_tells_a_skipped_or_repeated_step_apart():
    """The reference check would catch a step lost or done twice in the recovery."""
    reference = _single_process_reference()
    for steps in (STEPS - 1, STEPS + 1):
        assert np.abs(_single_process_reference(steps) - reference).max() > 1e-6


def test_three_survivors_of_a_killed_rank_finish_with_the_single_process_parameters(tmp_path):
    proc, took, reports = _launch(tmp_path)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
    assert "rank 2 was killed by SIGKILL" in proc.stderr and "1 of 4 ranks failed" in proc.stderr, proc.stderr
    _check_survivors(reports, [0, 1, 3], (1,))
    finals = [line for line in proc.stdout.splitlines() if "parameters" in line]
    assert len(finals) == 3 and all(" of 3 " in line for line in finals), proc.stdout
    assert len({line.rsplit(" ", 1)[1] for line in finals}) == 1, finals  # one digest
    assert took < RUN_DEADLINE, took


def test_a_second_rank_lost_while_the_survivors_shrink(tmp_path):
    """Rank 1 dies 2 ms into its shrink: inside it or in the broadcasts right
    after, depending on timing; ranks 0 and 3 finish either way."""
    proc, took, reports = _launch(tmp_path, "--kill-in-shrink", "1")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout + proc.stderr
    assert "2 of 4 ranks failed" in proc.stderr, proc.stderr
    assert "rank 1 was killed by SIGKILL" in proc.stderr and "rank 2 was killed by SIGKILL" in proc.stderr
    _check_survivors(reports, [0, 3], (1, 2))
    assert took < RUN_DEADLINE, took


# ------------------------------------------------- the wrapper on its own

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)).double()


def _grads_of(x) -> list:
    model = _mlp()
    model(x).sum().backward()
    return [p.grad for p in model.parameters()]


def shrink_with_allreduces_pending(comm, victim: int):
    """``victim`` dies first; the others post their buckets in backward (the
    allreduces wait on the dead rank; a bucket posted once the death is known
    raises PeerLost in backward), then shrink without waiting for them, and
    sum the next round's gradients on the survivors' communicator."""
    import collectives.integrations.torch as ct

    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    model = _mlp()
    opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), comm=comm,
                                  op="sum", first_bucket_cap_mb=0.001, bucket_cap_mb=0.001)
    inputs = {r: torch.full((2, 8), float(r + 1), dtype=torch.float64) for r in range(comm.size)}
    try:
        model(inputs[comm.rank]).sum().backward()  # posts the buckets
    except PeerLost:  # a bucket posted after the death was seen: the first ones are still pending
        pass
    threads = [t for t in threading.enumerate() if t is not threading.main_thread()]
    start = time.monotonic()
    new = opt.shrink()
    took = time.monotonic() - start
    for t in threads:  # the old communicator's worker ends once its queue is empty
        t.join(timeout=TIMEOUT)
    left = [t.name for t in threads if t.is_alive()]
    opt.zero_grad()
    model(inputs[comm.rank]).sum().backward()
    opt.synchronize()
    expected = [sum(g) for g in zip(*(_grads_of(inputs[r]) for r in new.original_ranks))]
    right = all(torch.allclose(p.grad, e, rtol=1e-12, atol=1e-12) for p, e in zip(model.parameters(), expected))
    return new.size, new.original_ranks, len(opt.bucket_sizes), took, left, right


def test_shrink_drops_the_allreduces_pending_on_the_dead_communicator():
    start = time.monotonic()
    outcomes = run_ranks(shrink_with_allreduces_pending, 4, 1, timeout=60, comm_timeout=TIMEOUT,
                         expect_errors=True)
    assert not outcomes[1].ok and outcomes[1].error_type == "ProcessDied", str(outcomes[1])
    for o in (outcomes[0], outcomes[2], outcomes[3]):
        assert o.ok, str(o)
        size, original, buckets, took, left, right = o.value
        assert size == 3 and original == [0, 2, 3] and buckets > 1, o.value
        assert took < TIMEOUT + 3, took
        assert left == [], left  # the old communicator's worker ended
        assert right, "the first round on the new communicator did not sum the survivors' gradients"
    assert time.monotonic() - start < TIMEOUT + 30, time.monotonic() - start



def _adam_on(comm, seed: int, steps: int):
    """A model seeded by ``seed`` and Adam after ``steps`` local steps (each rank's own state)."""
    import collectives.integrations.torch as ct

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).double()
    opt = ct.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model.named_parameters(), comm=comm,
                                  overlap=False)
    for _ in range(steps):
        opt.zero_grad()
        with opt.no_sync():
            model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        opt.optimizer.step()  # a local step
    return model, opt


def _state_of(model, opt) -> list:
    """The parameters, then every parameter's optimizer state (step, exp_avg, exp_avg_sq)."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v.clone() for _, v in sorted(opt.optimizer.state.get(p, {}).items())]
    return [t.numpy() for t in tensors]


def broadcast_from_rank_1(comm, steps_of: dict):
    model, opt = _adam_on(comm, seed=comm.rank, steps=steps_of[comm.rank])
    before = _state_of(model, opt)
    start = time.monotonic()
    try:
        opt.broadcast_state(root=1)
    except Exception as exc:
        comm.barrier()  # still usable: the refusal was collective and aborted nothing
        return "refused", type(exc).__name__, str(exc), time.monotonic() - start
    return "done", before, _state_of(model, opt)


def test_broadcast_state_gives_every_rank_the_roots_parameters_and_optimizer_state():
    results = run_ranks(broadcast_from_rank_1, 3, {0: 2, 1: 3, 2: 4}, timeout=60, comm_timeout=TIMEOUT)
    roots = results[1][1]
    assert len(roots) == 4 * 4  # four parameters, each with Adam's step, exp_avg and exp_avg_sq
    assert not all(np.array_equal(a, b) for a, b in zip(results[0][1], roots))  # they differed before
    for rank, (what, _, after) in enumerate(results):
        assert what == "done" and all(np.array_equal(a, b) for a, b in zip(after, roots)), f"rank {rank}"


def test_broadcast_state_refuses_on_every_rank_when_a_rank_has_another_state():
    """Rank 2 never stepped (no optimizer state): every rank raises BadArgument at once."""
    results = run_ranks(broadcast_from_rank_1, 3, {0: 2, 1: 3, 2: 0}, timeout=60, comm_timeout=TIMEOUT)
    for rank, (what, kind, message, took) in enumerate(results):
        assert what == "refused" and kind == "BadArgument", results[rank]
        assert f"rank {rank}: broadcast_state" in message and "differ from rank 1's" in message, message
        assert ("this rank's differ)" in message) == (rank == 2), message
        assert took < TIMEOUT + 3, took
