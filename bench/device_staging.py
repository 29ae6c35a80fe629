"""What staging GPU arrays costs: ``python -m collectives.bench.device_staging``.

An allreduce of a CUDA tensor (staged through pinned host memory by the
CUDA device plugin) against the same allreduce of a host array of the same
size, in turns, on shared memory; with the copies alone (device to pinned
host and back, on one stream) and the pinned allocation alone, so that the
difference can be read. Each figure is the median over ``--repeat`` timed
calls after warm-up, the slowest rank's, in microseconds. Needs torch with
CUDA.

    python -m collectives.bench.device_staging                  # 2 ranks
    python -m collectives.bench.device_staging -n 4 --sizes 4K,1M,64M
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from .cli import parse_sizes

__all__ = ["main"]


def _median_us(fn: Callable[[], Any], barrier: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank_main(sizes: list[int], repeat: int) -> int:
    import numpy as np
    import torch

    import collectives
    from collectives.devices import cuda

    comm = collectives.init(timeout=60)
    rt = cuda.runtime()
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        dev = torch.ones(n, device="cuda")
        host = np.ones(n, dtype=np.float32)
        pinned = cuda.PinnedBuffer(rt, 4 * n)
        stream = cuda.Stream(rt)

        def copies() -> None:
            rt.memcpy(pinned.array.ctypes.data, dev.data_ptr(), 4 * n, cuda.MEMCPY_DEVICE_TO_HOST, stream)
            rt.memcpy(dev.data_ptr(), pinned.array.ctypes.data, 4 * n, cuda.MEMCPY_HOST_TO_DEVICE, stream)
            stream.synchronize()

        parts = {"device": lambda: comm.allreduce(dev), "host": lambda: comm.allreduce(host),
                 "copies": copies, "pin": lambda: cuda.PinnedBuffer(rt, 4 * n).close()}
        for fn in parts.values():
            fn()
        got: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(3):  # in turns
            for k, fn in parts.items():
                got[k].append(_median_us(fn, comm.barrier, max(1, repeat // 3)))
        row = np.array([statistics.median(v) for v in got.values()])
        comm.allreduce(row, op="max")
        rows.append({"bytes": 4 * n, **dict(zip(parts, (float(v) for v in row)))})
        stream.close()
        pinned.close()
    if comm.rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    comm.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m collectives.bench.device_staging",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--sizes", default="4K,256K,4M,64M")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    sizes = parse_sizes(ns.sizes)
    if ns.rank:
        return _rank_main(sizes, ns.repeat)
    from collectives.devices import cuda

    ok, why = cuda.probe()
    if not ok:
        print(f"no usable GPU: {why}")
        return 1
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "PMI_", "OMPI_"))}
    argv2 = [sys.executable, "-m", "collectives.cli", "run", "-n", str(ns.nprocs), sys.executable, "-m",
             "collectives.bench.device_staging", "--sizes", ns.sizes, "--repeat", str(ns.repeat), "--rank"]
    res = subprocess.run(argv2, capture_output=True, text=True, timeout=ns.timeout, env=clean)
    found = [line.split("ROWS ", 1)[1] for line in res.stdout.splitlines() if "ROWS " in line]
    if res.returncode != 0 or not found:
        print((res.stdout + res.stderr)[-3000:])
        return 1
    print(f"# {ns.nprocs} ranks, float32 allreduce in place: microseconds (median, the slowest rank's)")
    print(f"{'bytes':>10s} {'device':>10s} {'host':>10s} {'ratio':>7s} {'copies':>10s} {'pin':>10s}")
    for r in json.loads(found[-1]):
        print(f"{r['bytes']:>10d} {r['device']:>10.1f} {r['host']:>10.1f} {r['device'] / r['host']:>7.2f} "
              f"{r['copies']:>10.1f} {r['pin']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
