"""Data-parallel training that keeps going when a rank dies.

A linear model learned by SGD on a fixed global batch. Every step averages
the ranks' gradients with allreduce. When a rank is lost, the others catch
:class:`collectives.PeerLost`, shrink to the survivors, take the model from
the new rank 0 (so every survivor starts again from the same weights), give
each survivor a larger share of the global batch, and finish. Run::

    collectives run -n 4 --on-failure continue examples/elastic_numpy.py --kill-rank 2 --kill-step 30

(``--kill-rank`` makes that rank kill itself at that step, to see it happen.)
The same on TCP: add ``--transport zmq`` before the script. The launcher
exits with the lost rank's status; the survivors print the final loss.
"""

import argparse
import os
import signal

import numpy as np

import collectives
from collectives import PeerLost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--global-batch", type=int, default=240)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=30)
    args = ap.parse_args()

    comm = collectives.init(timeout=10)
    features = 16
    truth = np.random.default_rng(0).standard_normal(features)
    w = np.zeros(features)  # the same on every rank
    step = 0
    while step < args.steps:
        if comm.epoch == 0 and comm.original_ranks[comm.rank] == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = args.global_batch // comm.size  # each rank's share of the global batch
        rng = np.random.default_rng((step, comm.original_ranks[comm.rank]))
        x = rng.standard_normal((batch, features))
        y = x @ truth
        grad = 2 * x.T @ (x @ w - y) / batch
        try:
            comm.allreduce(grad, op="avg")
        except PeerLost as exc:
            print(f"rank {comm.rank}: lost a peer at step {step} ({exc}); shrinking", flush=True)
            survivors = comm.shrink()
            comm.close()
            comm = survivors
            comm.bcast(w, root=0)  # every survivor resumes from the same model
            continue  # redo this step with the survivors
        w -= 0.05 * grad
        step += 1
    loss = float(np.mean((np.random.default_rng(99).standard_normal((100, features)) @ (w - truth)) ** 2))
    print(f"rank {comm.rank} of {comm.size} (originally {comm.original_ranks[comm.rank]}, epoch {comm.epoch}): "
          f"final loss {loss:.2e}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
