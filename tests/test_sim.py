"""The sim transport: real algorithm code on p virtual ranks, virtual time vs the formulas."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import collectives
from collectives.cost_models import Params, predict
from collectives.registry import all_algorithms
from collectives.transports.sim import SimParams, simulate

SP = SimParams(alpha=2e-6, beta=1e-9, gamma=5e-10)
#: The formulas' parameters for the simulator: copies are free there.
MP = Params(alpha=SP.alpha, beta=SP.beta, gamma=SP.gamma, mem_bandwidth=math.inf)
SIM_ALGOS = sorted((a.collective, a.name) for a in all_algorithms() if not a.needs)
BLOCKED = {"scatter", "gather", "allgather", "reduce_scatter", "alltoall"}
#: Non-power-of-two folding of these algorithms has a critical path the
#: formula does not follow yet (ports shared by the fold and the first
#: exchange): checked within 35% there, exactly for powers of two.
FOLD_APPROXIMATE = {("bcast", "scatter_recursive_doubling_allgather"), ("allgather", "recursive_doubling"),
                    ("allreduce", "recursive_doubling"), ("reduce_scatter", "recursive_halving")}


def _size(collective: str, p: int, nbytes: int) -> int:
    return nbytes - nbytes % (8 * p) if collective in BLOCKED else nbytes


def _check(collective: str, name: str, p: int, nbytes: int) -> None:
    res = simulate(collective, name, p, nbytes, SP)
    assert res.correct(), f"{collective}/{name} p={p}: results differ from numpy"
    model = predict(collective, name, p, _size(collective, p, nbytes), MP, np.float64)
    pow2 = p & (p - 1) == 0
    tol = 0.01 if pow2 or (collective, name) not in FOLD_APPROXIMATE else 0.35
    assert model == pytest.approx(res.time, rel=tol, abs=1e-12), (
        f"{collective}/{name} p={p} n={nbytes}: simulated {res.time * 1e6:.3f} us, "
        f"formula {model * 1e6:.3f} us")


@pytest.mark.parametrize("collective,name", SIM_ALGOS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 8, 12, 16, 31, 64])
def test_time_equals_formula(collective: str, name: str, p: int) -> None:
    _check(collective, name, p, 8 * 64 * 64)


@pytest.mark.parametrize("collective,name", SIM_ALGOS)
def test_time_equals_formula_large_message(collective: str, name: str) -> None:
    _check(collective, name, 8, 1 << 20)


@pytest.mark.parametrize("collective,name,p", [
    ("bcast", "binomial", 1024), ("allreduce", "recursive_doubling", 1024),
    ("allreduce", "rabenseifner", 1024), ("reduce", "binomial", 1024),
    ("allgather", "bruck", 1024), ("barrier", "dissemination", 1024),
    ("allreduce", "ring", 128), ("allgather", "ring", 128),  # p steps of p threads each: 256 took 14 s
])
def test_large_worlds(collective: str, name: str, p: int) -> None:
    _check(collective, name, p, 8 * p * 4)


def test_roots_and_dtypes() -> None:
    for collective in ("bcast", "reduce", "scatter", "gather"):
        for name in ("binomial", "linear", "rabenseifner", "pipelined_chain"):
            if (collective, name) in SIM_ALGOS:
                for dtype in (np.int32, np.float32):
                    assert simulate(collective, name, 6, 6 * 4 * 10, SP, root=4, dtype=dtype).correct()


def test_contention_shows() -> None:
    full = simulate("allgather", "ring", 16, 16 * 8 * 512, SP, "full").time
    switch = simulate("allgather", "ring", 16, 16 * 8 * 512, SP, "switch").time
    mesh = simulate("alltoall", "pairwise", 16, 16 * 8 * 512, SP, "mesh").time
    assert switch > 1.5 * full  # a node's send and receive take turns on one port
    assert mesh > simulate("alltoall", "pairwise", 16, 16 * 8 * 512, SP, "full").time


def test_reductions_charge_gamma() -> None:
    slow = simulate("allreduce", "recursive_doubling", 4, 8000, SimParams(alpha=1e-6, beta=0, gamma=1e-9)).time
    assert slow == pytest.approx(2 * (1e-6 + 8000 * 1e-9))


def test_init_from_threads() -> None:
    collectives.registry.all_algorithms()
    out: dict[int, float] = {}

    def run(r: int) -> None:
        comm = collectives.init(r, 4, transport="sim", job="test-init-from-threads")
        x = np.full(100, r + 1.0)
        comm.allreduce(x, algorithm="ring")
        out[r] = float(x[0])
        comm.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {r: 10.0 for r in range(4)}
