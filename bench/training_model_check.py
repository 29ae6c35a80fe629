"""Check the training performance model against real DDP training on this machine.

Trains a small CNN with ``torch.nn.parallel.DistributedDataParallel`` at
2 ranks (one thread each), measures the step time, and compares it with
the model's prediction (:mod:`collectives.cost_models.training`) for the
same network (derived from the live module), with:

- the node measured in-process with torch (1 thread): FP32 GEMM rate and
  copy bandwidth;
- the link from the transport's calibration profile when one exists
  (``collectives.cost_models.calibrate.load_profile``), otherwise fitted on
  the spot from a ping-pong of the process group (alpha + n beta).

The process group backend is ``--backend`` (default gloo; a backend that
the library registers with torch.distributed can be named instead). DDP
buckets are kept small (``--bucket-mb``) so that gradients travel about one
layer at a time, as the model assumes. Also measures one rank alone (no
communication) to separate the compute model's error from the
communication model's.

Run from a checkout (needs torch)::

    timeout 300 python -m bench.training_model_check --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np

from collectives.cost_models.clusters import profile_link
from collectives.cost_models.networks import Network, from_torch
from collectives.cost_models.training import SKYLAKE_BLOCKING, Cluster, Gemm, Link, Node, layer_gemms, predict


def build_model() -> Any:
    """The small CNN of the check (about 1.1 M parameters, 32x32x3 input)."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _best(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_torch_node(network: Network | None = None, batch: int = 32, size: int = 512, mbytes: int = 64,
                       repeats: int = 5) -> Node:
    """FP32 GEMM rate and copy bandwidth of torch on one thread.

    Args:
        network: if given, the GEMM rate is the effective rate of this
            network's own GEMMs at ``batch`` (total flops / total time of
            ``torch.mm`` at each FP, BP-GC and BP-WU shape); otherwise that
            of one square GEMM of order ``size``.
        batch: samples per step for the network's GEMMs.
        size: order of the square GEMM.
        mbytes: size of the copied buffer (bandwidth).
        repeats: median of this many runs.

    Returns:
        The node.
    """
    import torch

    torch.set_num_threads(1)
    gemms = [Gemm(size, size, size)]
    if network is not None:
        gemms = [g for layer in network.layers for g in layer_gemms(layer, batch).values()]
    seconds = 0.0
    for g in gemms:
        a, b = torch.randn(g.m, g.k), torch.randn(g.k, g.n)
        c = torch.empty(g.m, g.n)
        seconds += g.count * _best(lambda: torch.mm(a, b, out=c), repeats)
    rate = sum(g.flops for g in gemms) / seconds
    src = torch.ones(mbytes * (1 << 18))
    dst = torch.empty_like(src)
    bandwidth = 2.0 * src.numel() * 4 / _best(lambda: dst.copy_(src), repeats)
    label = "network GEMMs" if network is not None else f"{size}^3 GEMM"
    return Node(f"this machine, torch 1 thread, rate of {label}", rate, bandwidth, SKYLAKE_BLOCKING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(model: Any, batch: int, steps: int, warmup: int) -> float:
    """Median seconds per SGD step (forward, backward, update) on random data."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _pingpong(rank: int, sizes: list[int], repeats: int = 30) -> list[float]:
    """Half round-trip seconds per size between ranks 0 and 1."""
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1))
        for _ in range(3):
            _exchange(dist, buf, rank)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _exchange(dist, buf, rank)
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)) / 2)
    return out


def _exchange(dist: Any, buf: Any, rank: int) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.backend == "collectives":
        import collectives.integrations.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        sizes = [4, 64 << 10, 1 << 20, 4 << 20]
        pingpong = _pingpong(rank, sizes)
        ddp = DistributedDataParallel(build_model(), bucket_cap_mb=args.bucket_mb)
        step = _train(ddp, args.batch, args.steps, args.warmup)
        if rank == 0:
            with open(result_path, "w") as fh:
                json.dump({"step": step, "pingpong": dict(zip(map(str, sizes), pingpong))}, fh)
    finally:
        dist.destroy_process_group()


def _fit_link(pingpong: dict[str, float]) -> Link:
    """Least-squares alpha + n beta through the ping-pong times."""
    n = np.array([float(k) for k in pingpong])
    t = np.array(list(pingpong.values()))
    beta, alpha = np.polyfit(n, t, 1)
    return Link(max(alpha, 1e-7), max(beta, 1e-12))


def run(args: argparse.Namespace) -> dict:
    """Measure and predict; returns the report as a dict."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    model = build_model()
    network = from_torch(model, torch.zeros(1, 3, 32, 32), name="small_cnn")
    peak_node = measure_torch_node()
    gemm_node = measure_torch_node(network, args.batch)
    single = _train(model, args.batch, args.steps, args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(2, _free_port(), args, path), nprocs=2, join=True)
        with open(path) as fh:
            measured = json.load(fh)
    link, source = profile_link(args.transport)
    if source.startswith("fallback"):
        link, source = _fit_link(measured["pingpong"]), f"ping-pong of the {args.backend} process group"
    report = {
        "network": network.name, "params": network.params, "batch_per_rank": args.batch,
        "link": {"alpha_us": link.alpha * 1e6, "gbytes_per_s": 1e-9 / link.beta, "source": source},
        "measured_ms": {"p1": single * 1e3, "p2": measured["step"] * 1e3},
        "load_average": os.getloadavg(),
    }
    for label, node in (("peak_roofline", peak_node), ("gemm_calibrated", gemm_node)):
        cluster = Cluster("this machine", node, Link(link.alpha, link.beta, link.gamma or 3.0 / node.mem_bandwidth), 2)
        one = predict(network, cluster, 1, args.batch)
        two = predict(network, cluster, 2, args.batch, allreduce="auto", overlap=True)
        report[label] = {
            "node_gflops": node.peak_flops / 1e9, "node_gbytes_per_s": node.mem_bandwidth / 1e9,
            "p1_ms": one.step * 1e3, "p1_error": one.step / single - 1,
            "p2_ms": two.step * 1e3, "p2_compute_ms": two.compute * 1e3, "p2_comm_ms": two.communication * 1e3,
            "p2_exposed_ms": two.exposed_communication * 1e3, "p2_error": two.step / measured["step"] - 1,
        }
    return report | {
        "pingpong_us": {k: v * 1e6 for k, v in measured["pingpong"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the comparison and optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="gloo",
                    help="torch.distributed backend of the DDP run (gloo, or collectives for ours)")
    ap.add_argument("--transport", default="shm", help="calibration profile to use for the link")
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("training_model_check needs torch (pip install torch)", file=sys.stderr)
        return 2
    report = run(args)
    measured = report["measured_ms"]
    for label in ("peak_roofline", "gemm_calibrated"):
        r = report[label]
        for p in ("p1", "p2"):
            print(f"{label:16s} {p}: measured {measured[p]:8.2f} ms/step, predicted {r[p + '_ms']:8.2f} ms/step, "
                  f"error {r[p + '_error'] * 100:+6.1f}%")
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
