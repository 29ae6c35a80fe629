"""Train a small MLP with DistributedDataParallel on the ``collectives`` backend.

Run with either launcher::

    collectives run -n 2 examples/train_ddp.py
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py

``--hook`` routes the gradient buckets through our comm hook (``fp16``
compresses them); the loss printed by rank 0 should fall.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives.integrations.torch as ct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hook", choices=["none", "plain", "fp16"], default="none")
    args = ap.parse_args()

    dist.init_process_group(backend="collectives")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    if args.hook != "none":
        hook = ct.allreduce_hook if args.hook == "plain" else ct.fp16_compress_hook
        model.register_comm_hook(ct.HookState(), hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of data
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  ({size} ranks, backend {dist.get_backend()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
