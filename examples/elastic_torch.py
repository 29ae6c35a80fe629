"""Data-parallel PyTorch training that keeps going when a rank dies.

A small MLP (float64) learns a fixed function with SGD and momentum,
wrapped in ``DistributedOptimizer`` (gradients summed in buckets while
backward runs). Every step trains on the same global batch, split over the
ranks in contiguous shares; each rank's loss is its share's sum of squared
errors divided by the global batch size, so the summed gradient is the
global batch's mean gradient however many ranks share it.

When a rank is lost, the survivors catch ``PeerLost``, shrink the wrapper to
the survivors (``opt.shrink()``: the allreduces pending on the dead
communicator are dropped, the buckets move to the new one), take the step
number, the parameters and the optimizer state from the new rank 0
(``opt.broadcast_state()``), split the same global batch over fewer ranks
and redo the step. A failure during that recovery is caught the same way.
Run::

    collectives run -n 4 --on-failure continue examples/elastic_torch.py --kill-rank 2 --kill-step 12

``--kill-rank R --kill-step S``: original rank R kills itself (SIGKILL) in
the backward pass of step S, after its first gradient buckets were posted.
``--kill-in-shrink R``: original rank R also dies, 2 ms after it starts to
shrink (inside the shrink or in the broadcasts after it, as timing goes).
``--check``: every survivor compares its parameters with a single-process
run on the whole global batch. ``--out DIR``: every survivor writes what it
did to ``DIR/rank<original rank>.json``. The launcher exits with the lost
rank's status (137 for SIGKILL); every survivor prints a line ending in a
digest of its parameters, the same on every survivor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import torch

import collectives
import collectives.integrations.torch as ct
from collectives import Communicator, PeerLost

FEATURES = 16


def make_model() -> torch.nn.Sequential:
    """The same initial model on every rank (a fixed seed)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank and in every run."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, FEATURES, generator=gen, dtype=torch.float64)
    truth = torch.linspace(-0.25, 0.25, FEATURES, dtype=torch.float64)
    return x, torch.sin(x @ truth).unsqueeze(1)


def share(x: torch.Tensor, y: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of the global batch (sizes differ by one at most)."""
    bounds = np.linspace(0, len(x), size + 1).round().astype(int)
    return x[bounds[rank]:bounds[rank + 1]], y[bounds[rank]:bounds[rank + 1]]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, global_size: int) -> torch.Tensor:
    """The share's part of the global batch's mean squared error."""
    return ((model(x) - y) ** 2).sum() / global_size


def parameters_of(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def single_process_reference(steps: int, global_size: int) -> np.ndarray:
    """The parameters after ``steps`` steps of the plain optimizer on the whole global batch."""
    model = make_model()
    opt = make_optimizer(model)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *global_batch(step, global_size), global_size).backward()
        opt.step()
    return parameters_of(model)


def arm_kill(model: torch.nn.Sequential, progress: dict, kill_step: int) -> None:
    """Kill this process in the backward pass of ``kill_step`` (first epoch), when
    the first layer's gradient is in: the later layers' buckets are posted by
    then, the first layer's never is. Register it before the wrapper's hooks
    so that it runs first."""
    def kill(_: torch.Tensor) -> None:
        if progress["epoch"] == 0 and progress["step"] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    model[0].weight.register_post_accumulate_grad_hook(kill)


def resume_step(comm: Communicator, step: int) -> int:
    """Rank 0's step: the survivors go on from where it is."""
    mine = np.array([step], np.int64)
    comm.bcast(mine, root=0)
    return int(mine[0])


def train_step(model: torch.nn.Module, opt: ct.DistributedOptimizer, step: int, global_size: int) -> None:
    """One step on this rank's share of the global batch (shares follow ``opt.comm.size``)."""
    x, y = share(*global_batch(step, global_size), opt.comm.rank, opt.comm.size)
    opt.zero_grad()
    loss_of(model, x, y, global_size).backward()
    opt.step()


def train(comm: Communicator, steps: int, global_size: int, kill_rank: int = -1, kill_step: int = -1,
          kill_in_shrink: int = -1) -> dict[str, Any]:
    """Train for ``steps`` steps, surviving lost ranks; returns what happened on this rank."""
    torch.set_num_threads(1)
    original = comm.original_ranks[comm.rank]
    model = make_model()
    progress = {"step": 0, "epoch": comm.epoch}
    if original == kill_rank:
        arm_kill(model, progress, kill_step)
    opt = ct.DistributedOptimizer(make_optimizer(model), model.named_parameters(), comm=comm, op="sum",
                                  first_bucket_cap_mb=0.002, bucket_cap_mb=0.008)
    step, recovering, lost_at, recovery_s, started = 0, False, [], 0.0, 0.0
    old_threads: list[threading.Thread] = []
    while step < steps:
        try:
            if recovering:  # every survivor goes on from rank 0's step, parameters and optimizer state
                step = resume_step(opt.comm, step)
                opt.broadcast_state(root=0)
                recovering, recovery_s = False, recovery_s + time.monotonic() - started
            progress.update(step=step, epoch=opt.comm.epoch)
            train_step(model, opt, step, global_size)
            step += 1
        except PeerLost as exc:
            started = started if recovering else time.monotonic()
            lost_at.append(step)
            old_threads = old_threads or [t for t in threading.enumerate() if t is not threading.main_thread()]
            print(f"rank {opt.comm.rank} (originally {original}): lost a peer at step {step}: {exc}", flush=True)
            if original == kill_in_shrink and opt.comm.epoch == 0:
                threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()
            opt.shrink()
            recovering = True
    report = outcome(model, opt.comm, original, step, global_size, lost_at, recovery_s, old_threads)
    opt.comm.close()
    return report


def outcome(model: torch.nn.Module, comm: Communicator, original: int, steps: int, global_size: int,
            lost_at: list[int], recovery_s: float, old_threads: list[threading.Thread]) -> dict[str, Any]:
    """What this rank did and where it ended, for the report."""
    for t in old_threads:  # the old communicators' workers end once their queues are empty
        t.join(timeout=comm.timeout)
    params = parameters_of(model)
    with torch.no_grad():
        final_loss = float(loss_of(model, *global_batch(steps, global_size), global_size))
    return {"rank": comm.rank, "size": comm.size, "original": original, "epoch": comm.epoch,
            "original_ranks": comm.original_ranks, "steps": steps, "lost_at": lost_at, "recovery_s": recovery_s,
            "loss": final_loss, "digest": hashlib.sha256(params.tobytes()).hexdigest()[:16],
            "parameters": params.tolist(), "threads_left": sorted(t.name for t in old_threads if t.is_alive())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=12)
    ap.add_argument("--kill-in-shrink", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=10.0, help="the communicator's timeout, seconds")
    ap.add_argument("--check", action="store_true", help="compare with a single-process run")
    ap.add_argument("--out", default=None, help="write DIR/rank<original rank>.json")
    args = ap.parse_args()

    start = time.monotonic()
    r = train(collectives.init(timeout=args.timeout), args.steps, args.global_batch, args.kill_rank,
              args.kill_step, args.kill_in_shrink)
    r["seconds"] = time.monotonic() - start
    if args.check:
        r["max_diff"] = float(np.abs(np.array(r["parameters"]) -
                                     single_process_reference(args.steps, args.global_batch)).max())
    if args.out:
        with open(os.path.join(args.out, f"rank{r['original']}.json"), "w") as f:
            json.dump(r, f)
    checked = f", max |w - w_single| {r['max_diff']:.1e}" if args.check else ""
    print(f"rank {r['rank']} of {r['size']} (originally {r['original']}, epoch {r['epoch']}): {r['steps']} steps, "
          f"lost a peer at steps {r['lost_at']}, recovered in {r['recovery_s']:.2f}s, final loss "
          f"{r['loss']:.3e}{checked}, parameters {r['digest']}", flush=True)


if __name__ == "__main__":
    main()
