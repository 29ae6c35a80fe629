"""Step time of data-parallel training and the share of communication hidden behind backward.

Trains the same CPU MLP (a few million parameters) for a fixed number of
steps, in one job, with:

* ``compute``: no communication at all (the floor),
* ``ddp-gloo``: DistributedDataParallel on Gloo,
* ``ddp-collectives``: DDP on our ``collectives`` backend,
* ``ddp-gloo+hook``: DDP on Gloo with our comm hook doing the bucket allreduce,
* ``wrapper``: our DistributedOptimizer (overlapped),
* ``wrapper-no-overlap``: the same, every bucket posted at ``step()``.

Communication alone is the allreduce of the same gradient buckets without
compute (on Gloo and on ours). The hidden share of a mode is
``1 - (step - compute) / comm_alone``. Run::

    collectives run -n 2 bench/train_overlap.py [--steps 20] [--json out.json]
    torchrun --standalone --nproc-per-node 2 bench/train_overlap.py
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives.integrations.torch as ct

MiB = 1 << 20


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def timed(step: Callable[[], None], steps: int, warmup: int, sync_group=None) -> float:
    """Mean seconds per step, the slowest rank's (synchronized on ``sync_group``)."""
    for _ in range(warmup):
        step()
    dist.barrier(group=sync_group)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    t = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sync_group)
    return float(t.item())


def train_step(model: torch.nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def bucket_numels(model: torch.nn.Module, cap_mb: float, first_mb: float) -> list[int]:
    """Bucket sizes (elements) the way DDP and the wrapper group the gradients."""
    sizes, current, limit = [], 0, first_mb * MiB
    for p in reversed(list(model.parameters())):
        current += p.numel()
        if current * 4 >= limit:
            sizes.append(current)
            current, limit = 0, cap_mb * MiB
    return sizes + ([current] if current else [])


def comm_alone(numels: list[int], group, comm) -> Callable[[], None]:
    bufs = [torch.ones(n) for n in numels]

    def step() -> None:
        if comm is not None:
            handles = [comm.iallreduce(ct.as_numpy(b), "sum") for b in bufs]
            for h in handles:
                h.wait()
        else:
            works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs]
            for w in works:
                w.wait()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(backend="collectives")
    gloo = dist.new_group(backend="gloo")
    comm = ct.communicator_of()
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, 16, generator=gen)
    n_params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    numels = bucket_numels(make_model(args.width, args.depth), args.bucket_cap_mb, 1.0)
    cap = {"bucket_cap_mb": args.bucket_cap_mb}

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    modes: dict[str, Callable[[], Callable[[], None]]] = {}
    modes["compute"] = lambda: (lambda m: train_step(m, sgd(m), x, y))(make_model(args.width, args.depth))
    modes["ddp-gloo"] = lambda: (lambda m: train_step(m, sgd(m), x, y))(
        DDP(make_model(args.width, args.depth), process_group=gloo, **cap))
    modes["ddp-collectives"] = lambda: (lambda m: train_step(m, sgd(m), x, y))(
        DDP(make_model(args.width, args.depth), **cap))

    def ddp_hook():
        m = DDP(make_model(args.width, args.depth), process_group=gloo, **cap)
        m.register_comm_hook(ct.HookState(comm), ct.allreduce_hook)
        return train_step(m, sgd(m), x, y)

    def wrapper(overlap: bool):
        m = make_model(args.width, args.depth)
        opt = ct.DistributedOptimizer(sgd(m), m.named_parameters(), comm=comm,
                                      bucket_cap_mb=args.bucket_cap_mb, overlap=overlap)
        return train_step(m, opt, x, y)

    modes["ddp-gloo+hook"] = ddp_hook
    modes["wrapper"] = lambda: wrapper(True)
    modes["wrapper-no-overlap"] = lambda: wrapper(False)

    results = {name: timed(make(), args.steps, args.warmup, gloo) for name, make in modes.items()}
    alone = {"gloo": timed(comm_alone(numels, gloo, None), args.steps, args.warmup, gloo),
             "collectives": timed(comm_alone(numels, None, comm), args.steps, args.warmup, gloo)}
    if rank == 0:
        report(results, alone, n_params, size, args)
    dist.destroy_process_group()


def report(results: dict, alone: dict, n_params: int, size: int, args) -> None:
    compute = results["compute"]
    uses = {"ddp-gloo": "gloo", "ddp-collectives": "collectives", "ddp-gloo+hook": "collectives",
            "wrapper": "collectives", "wrapper-no-overlap": "collectives"}
    print(f"{n_params / 1e6:.2f} M parameters ({n_params * 4 / MiB:.1f} MiB of gradients), "
          f"{size} ranks, batch {args.batch} per rank, {args.steps} steps")
    print(f"allreduce of the gradient buckets alone: gloo {alone['gloo'] * 1e3:.1f} ms, "
          f"collectives {alone['collectives'] * 1e3:.1f} ms")
    print(f"{'mode':22s} {'step ms':>9s} {'vs gloo':>8s} {'comm ms':>8s} {'hidden':>7s}")
    rows = []
    for name, t in results.items():
        comm_ms = alone[uses[name]] if name in uses else 0.0
        hidden = max(0.0, min(1.0, 1 - (t - compute) / comm_ms)) if comm_ms else float("nan")
        ratio = t / results["ddp-gloo"]
        print(f"{name:22s} {t * 1e3:9.1f} {ratio:8.2f} {comm_ms * 1e3:8.1f} {hidden * 100:6.0f}%")
        rows.append({"mode": name, "step_s": t, "vs_gloo": ratio, "comm_alone_s": comm_ms, "hidden": hidden})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n_params, "ranks": size, "batch": args.batch, "steps": args.steps,
                       "comm_alone_s": alone, "modes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
