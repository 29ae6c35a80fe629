"""Train without DDP: ``DistributedOptimizer`` averages the gradients in buckets,
overlapped with backward, with gradient accumulation over two micro-batches.

Run with either launcher::

    collectives run -n 2 examples/train_optimizer_wrapper.py
    torchrun --standalone --nproc-per-node 2 examples/train_optimizer_wrapper.py
"""

import argparse

import torch

import collectives
import collectives.integrations.torch as ct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=2)
    args = ap.parse_args()

    comm = collectives.init()
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = ct.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model.named_parameters(),
                                  comm=comm, backward_passes_per_step=args.micro_batches)
    gen = torch.Generator().manual_seed(1 + comm.rank)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        opt.zero_grad()
        for _ in range(args.micro_batches):
            x = torch.randn(32, 32, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ target) / args.micro_batches
            loss.backward()
        opt.step()
        if comm.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item() * args.micro_batches:.4f}  "
                  f"({comm.size} ranks, {len(opt.bucket_sizes)} buckets)")
    comm.close()


if __name__ == "__main__":
    main()
