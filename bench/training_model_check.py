"""Check the training performance model against real DDP training on this machine.

Trains a small CNN with ``torch.nn.parallel.DistributedDataParallel`` at
2 ranks (one thread each), measures the step time, and compares it with
the model's prediction (:mod:`collectives.cost_models.training`) for the
same network (derived from the live module), with:

- the node measured in-process with torch (1 thread): FP32 GEMM rate and
  copy bandwidth, once alone (``gemm_calibrated``) and once while every
  rank computes at the same time (``gemm_calibrated_busy``: what sharing
  the host's cores and memory costs);
- the link from the transport's calibration profile when one exists
  (``collectives.cost_models.profile.load_profile``), otherwise fitted on
  the spot from a ping-pong of the process group (alpha + n beta); and,
  in ``gemm_calibrated_busy_group_link``, the link fitted to the process
  group's own ``all_reduce`` times, which include the framework's per-call
  costs.

The process group backend is ``--backend`` (default gloo; a backend that
the library registers with torch.distributed can be named instead). DDP
buckets are kept small (``--bucket-mb``) so that gradients travel about one
layer at a time, as the model assumes. Also measures one rank alone and
every rank training without DDP, to separate the compute model's error
from the communication model's.

Run from a checkout (needs torch)::

    timeout 300 python -m bench.training_model_check --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from collectives.cost_models.training import (SKYLAKE_BLOCKING, Cluster, Gemm, Link, Network, Node, allreduce_time,
                                              from_torch, layer_gemms, predict, profile_link)
from collectives.launcher import free_port


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


def _allreduce_times(sizes: list[int], repeats: int = 30) -> list[float]:
    """Median seconds of ``dist.all_reduce`` per size (what each DDP bucket costs)."""
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1))
        for _ in range(3):
            dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
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
        allreduce = _allreduce_times(sizes)
        # Every rank computing at once, no communication: what sharing the
        # host's cores and memory costs, apart from the gradient allreduces.
        model = build_model()
        network = from_torch(model, torch.zeros(1, 3, 32, 32), name="small_cnn")
        dist.barrier()
        busy_node = measure_torch_node(network, args.batch)
        dist.barrier()
        local = _train(model, args.batch, args.steps, args.warmup)
        dist.barrier()
        ddp = DistributedDataParallel(build_model(), bucket_cap_mb=args.bucket_mb)
        step = _train(ddp, args.batch, args.steps, args.warmup)
        if rank == 0:
            with open(result_path, "w") as fh:
                json.dump({"step": step, "local": local, "busy_gflops": busy_node.peak_flops / 1e9,
                           "busy_gbytes_per_s": busy_node.mem_bandwidth / 1e9,
                           "pingpong": dict(zip(map(str, sizes), pingpong)),
                           "allreduce": dict(zip(map(str, sizes), allreduce))}, fh)
    finally:
        dist.destroy_process_group()
    # torch sometimes aborts in its C++ static destructors at interpreter
    # exit; the result is written, so leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fit_link(pingpong: dict[str, float]) -> Link:
    """Least-squares alpha + n beta through the ping-pong times."""
    n = np.array([float(k) for k in pingpong])
    t = np.array(list(pingpong.values()))
    beta, alpha = np.polyfit(n, t, 1)
    return Link(max(alpha, 1e-7), max(beta, 1e-12))


def _fit_allreduce_link(allreduce: dict[str, float], gamma: float) -> Link:
    """The link whose 2-rank bucket allreduce (2 alpha + n beta + n gamma / 2)
    best fits the process group's measured allreduce times: what the
    framework's per-call costs add to the transport's own alpha and beta."""
    n = np.array([float(k) for k in allreduce])
    t = np.array(list(allreduce.values()))
    slope, intercept = np.polyfit(n, t, 1)
    return Link(max(intercept / 2, 1e-7), max(slope - gamma / 2, 1e-12), gamma)


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
        mp.spawn(_worker, args=(2, free_port(), args, path), nprocs=2, join=True)
        with open(path) as fh:
            measured = json.load(fh)
    link, source = profile_link(args.transport)
    if source.startswith("fallback"):
        link, source = _fit_link(measured["pingpong"]), f"ping-pong of the {args.backend} process group"
    report = {
        "network": network.name, "params": network.params, "batch_per_rank": args.batch,
        "link": {"alpha_us": link.alpha * 1e6, "gbytes_per_s": 1e-9 / link.beta, "source": source},
        "measured_ms": {"p1": single * 1e3, "p2": measured["step"] * 1e3,
                        "p2_without_communication": measured["local"] * 1e3},
        "load_average": os.getloadavg(),
    }
    comm_link = replace(link, gamma=link.gamma or 3.0 / gemm_node.mem_bandwidth)
    busy_node = replace(gemm_node, name=gemm_node.name + ", all ranks computing",
                        peak_flops=measured["busy_gflops"] * 1e9,
                        mem_bandwidth=measured["busy_gbytes_per_s"] * 1e9)
    group_link = _fit_allreduce_link(measured["allreduce"], comm_link.gamma)
    report["group_link"] = {"alpha_us": group_link.alpha * 1e6, "gbytes_per_s": 1e-9 / group_link.beta,
                            "source": f"allreduce times of the {args.backend} process group"}
    for label, node, node_link in (
            ("peak_roofline", peak_node, None), ("gemm_calibrated", gemm_node, None),
            ("gemm_calibrated_busy", busy_node, None), ("gemm_calibrated_busy_group_link", busy_node, group_link)):
        node_link = node_link or Link(link.alpha, link.beta, link.gamma or 3.0 / node.mem_bandwidth)
        cluster = Cluster("this machine", node, node_link, 2)
        one = predict(network, cluster, 1, args.batch)
        two = predict(network, cluster, 2, args.batch, allreduce="auto", overlap=True)
        # When the ranks fill the host's cores, moving and reducing gradients
        # takes the cores the backward pass needs: nothing overlaps.
        serial = predict(network, cluster, 2, args.batch, allreduce="auto", overlap=False)
        report[label] = {
            "node_gflops": node.peak_flops / 1e9, "node_gbytes_per_s": node.mem_bandwidth / 1e9,
            "p1_ms": one.step * 1e3, "p1_error": one.step / single - 1,
            "p2_ms": two.step * 1e3, "p2_compute_ms": two.compute * 1e3, "p2_comm_ms": two.communication * 1e3,
            "p2_exposed_ms": two.exposed_communication * 1e3, "p2_error": two.step / measured["step"] - 1,
            "p2_no_overlap_ms": serial.step * 1e3, "p2_no_overlap_error": serial.step / measured["step"] - 1,
        }
    # The library's cost models with the calibration profile, on compute
    # calibrated by measurement: the roofline's per-layer times scaled to the
    # measured step of one rank alone (p1), or of every rank computing
    # without communication (p2 compute). What is left of the p2 error is
    # the communication model's and the overlap assumption's.
    cluster = Cluster("this machine", gemm_node, comm_link, 2)
    roofline = predict(network, cluster, 1, args.batch)
    spread = [(c.fp, c.bp_gc, c.bp_wu) for c in roofline.layers]
    for label, target in (("library_compute_of_p1", single), ("library_compute_of_p2", measured["local"])):
        k = target / roofline.compute
        times = [(fp * k, gc * k, wu * k) for fp, gc, wu in spread]
        two = predict(network, cluster, 2, args.batch, models="library", layer_times=times)
        serial = predict(network, cluster, 2, args.batch, models="library", layer_times=times, overlap=False)
        report[label] = {
            "p1_ms": k * roofline.compute * 1e3, "p1_error": k * roofline.compute / single - 1,
            "p2_ms": two.step * 1e3, "p2_compute_ms": two.compute * 1e3, "p2_comm_ms": two.communication * 1e3,
            "p2_exposed_ms": two.exposed_communication * 1e3, "p2_error": two.step / measured["step"] - 1,
            "p2_no_overlap_ms": serial.step * 1e3, "p2_no_overlap_error": serial.step / measured["step"] - 1,
            "algorithms": sorted({c.algorithm for c in two.layers if c.algorithm != "none"}),
        }
    return report | {
        "pingpong_us": {k: v * 1e6 for k, v in measured["pingpong"].items()},
        "allreduce_us": {k: {"measured": v * 1e6, "predicted": allreduce_time(float(k), 2, comm_link)[0] * 1e6,
                             "predicted_library": allreduce_time(float(k), 2, comm_link, models="library")[0] * 1e6}
                         for k, v in measured["allreduce"].items()},
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
    print(f"measured p2 without communication (every rank computing, no DDP): "
          f"{measured['p2_without_communication']:8.2f} ms/step")
    print(f"link: {report['link']['source']}")
    for label in ("peak_roofline", "gemm_calibrated", "gemm_calibrated_busy", "gemm_calibrated_busy_group_link",
                  "library_compute_of_p1", "library_compute_of_p2"):
        r = report[label]
        for p in ("p1", "p2"):
            print(f"{label:16s} {p}: measured {measured[p]:8.2f} ms/step, predicted {r[p + '_ms']:8.2f} ms/step, "
                  f"error {r[p + '_error'] * 100:+6.1f}%")
        print(f"{label:16s} p2 without overlap: predicted {r['p2_no_overlap_ms']:8.2f} ms/step, "
              f"error {r['p2_no_overlap_error'] * 100:+6.1f}%")
    for size, t in report["allreduce_us"].items():
        print(f"allreduce {int(size):>8d} B: measured {t['measured']:9.1f} us, predicted {t['predicted']:9.1f} us "
              f"(paper), {t['predicted_library']:9.1f} us (library)")
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
