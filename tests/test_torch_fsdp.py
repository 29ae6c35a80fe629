"""FSDP2 and torch's functional collectives on the ``collectives`` backend, against Gloo.

Each test starts one job whose ranks run this file as a script
(``python test_torch_fsdp.py CHECK ...``). Every rank joins the default
group on the ``collectives`` backend and a second group on Gloo, and runs
the same work on each:

* ``functional``: ``torch.distributed._functional_collectives``
  (``all_reduce``, ``all_gather_tensor``, ``reduce_scatter_tensor``,
  ``all_to_all_single``, ``broadcast``, with ``wait_tensor``, and results
  used without an explicit wait) give the same tensors on both groups;
* ``fsdp``: a model sharded with ``torch.distributed.fsdp.fully_shard`` on
  a CPU device mesh of each group, trained from the same seed (in float32,
  and with bfloat16 parameters reduced in float32), ends with the same
  parameters on both.

Every rank prints one ``RESULT`` line with the checks that failed.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest

from launched import collectives_run, run_checked, run_torch_checks

HERE = os.path.abspath(__file__)
DEADLINE = 150

# ---------------------------------------------------------------------- rank side


def _setup():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend="collectives", timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _functionalresults(torch, dist, group):
    """What each functional collective gives on ``group``."""
    import torch.distributed._functional_collectives as fc

    r, p = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6.0) * (r + 1) + 0.25
    out = {
        "all_reduce sum": fc.wait_tensor(fc.all_reduce(x, "sum", group)),
        "all_reduce max": fc.wait_tensor(fc.all_reduce(x, "max", group)),
        "all_gather_tensor": fc.wait_tensor(fc.all_gather_tensor(x, 0, group)),
        "reduce_scatter_tensor": fc.wait_tensor(fc.reduce_scatter_tensor(torch.arange(2.0 * p) * (r + 1),
                                                                         "sum", 0, group)),
        "all_to_all_single": fc.wait_tensor(fc.all_to_all_single(torch.arange(float(p)) + 10 * r,
                                                                  None, None, group)),
        "broadcast": fc.wait_tensor(fc.broadcast(x, p - 1, group)),
    }
    # Used without wait_tensor: the first use waits (AsyncCollectiveTensor).
    out["all_reduce, used at once"] = fc.all_reduce(x, "sum", group) * 2
    out["all_gather_tensor, dim 1"] = fc.all_gather_tensor(x.reshape(2, 3), 1, group) + 0
    return out


def check_functional(torch, dist):
    """Functional collectives on the collectives group equal Gloo's."""
    gloo = dist.new_group(backend="gloo")
    ours = _functionalresults(torch, dist, dist.group.WORLD)
    theirs = _functionalresults(torch, dist, gloo)
    return [f"{name}: {ours[name].tolist()} on collectives, {theirs[name].tolist()} on gloo"
            for name in ours if not torch.equal(ours[name], theirs[name])]


def _fsdp_train(torch, dist, group, mixed):
    """Train a model sharded with fully_shard on a CPU mesh of ``group``; its full parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 3))
    mesh = DeviceMesh.from_group(group, "cpu")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed
              else MixedPrecisionPolicy())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(4):
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return [param.full_tensor().detach().clone() for param in model.parameters()]


def check_fsdp(torch, dist):
    """fully_shard training on the collectives group equals it on Gloo's."""
    gloo = dist.new_group(backend="gloo")
    fails = []
    for mixed in (False, True):
        label = "fsdp bf16 params / fp32 reduce" if mixed else "fsdp float32"
        ours = _fsdp_train(torch, dist, dist.group.WORLD, mixed)
        theirs = _fsdp_train(torch, dist, gloo, mixed)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                fails.append(f"{label}: parameter {i} differs from Gloo's by {(a - b).abs().max().item():.3g}")
    return fails


CHECKS = {"functional": check_functional, "fsdp": check_fsdp}


def main(names):
    run_torch_checks(CHECKS, names, _setup)


# ---------------------------------------------------------------------- test side


def _run(p, *checks):
    run_checked(collectives_run(p, HERE, *checks, deadline=DEADLINE), p, DEADLINE)


@pytest.fixture(scope="module")
def torch_installed():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("p", [2, 3])
def test_functional_collectives_match_gloo(torch_installed, p):
    _run(p, "functional")


@pytest.mark.parametrize("p", [2, 3])
def test_fully_shard_matches_gloo(torch_installed, p):
    _run(p, "fsdp")


if __name__ == "__main__":
    main(sys.argv[1:])
